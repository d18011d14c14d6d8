"""OpenAI compatibility as an outside scanner sees it: compatcanary's probes against simulated engines directly and
through the gateway in front of them, verdict by verdict and reply by reply.

For each engine kind, two simulated engines with the same options are started (each scan meets a freshly started
engine, so the second cannot find the first one's prompts in its prefix cache) and a gateway of this tree in front
of one of them. The npm package compatcanary (a pinned version, installed on first use into benchmarks/.npm) scans the
other engine directly and the gateway, with the same model name and key, its `fetch` wrapped so that every request
and reply is kept as well. The report puts the scanner's verdicts side by side, checks that each probe passed
directly passes through the gateway too, and compares the replies themselves, ids and clock times aside.

Usage: python3 -m benchmarks.compat [--engines vllm sglang llamacpp] [--timeout S] [--render]
Exit status 1 when a probe that passes directly does not pass through the gateway; 2 when the scanner cannot run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import backends
from benchmarks import kit
from benchmarks.compat_diff import VOLATILE, compare_runs, replay_with_usage
from gateway.keys.principal import hash_key

SCANNER = "compatcanary"
SCANNER_VERSION = "0.2.2"
SCANNER_INTEGRITY = ("sha512-16AofE9bptzJHx4hGJs7KYAy8QvRGz2wpAcIB8Wc017o/+H0dZ9//AT1ywd3kNOC/5dkXqQnblsFwI7YqN/jSA"
                     "==")
NPM_DIR = kit.BENCH / ".npm"  # the scanner's install (ignored by git)
OUT = kit.RESULTS / "compat"
MODEL = "bench"
ENGINES = ("vllm", "sglang", "llamacpp")
BODY_KEEP = 2000  # characters of each reply kept in the saved data (the comparison reads the whole reply)

# Loaded before the scanner's own CLI (node --import): every fetch it makes, with the reply's status, headers and
# text, written as JSON to $COMPAT_WIRE_LOG when the process exits. The scanner reads the reply from a copy.
WIRE_JS = """\
import { writeFileSync } from "node:fs";
const exchanges = [];
const realFetch = globalThis.fetch;
globalThis.fetch = async (url, init = {}) => {
  const rec = { url: String(url), method: init.method ?? "GET", requestBody: init.body ?? null };
  exchanges.push(rec);
  try {
    const res = await realFetch(url, init);
    const text = await res.text();
    Object.assign(rec, { status: res.status, headers: Object.fromEntries(res.headers), body: text });
    return new Response(text, { status: res.status, statusText: res.statusText, headers: res.headers });
  } catch (error) {
    rec.error = String(error?.cause ?? error);
    throw error;
  }
};
process.on("exit", () => writeFileSync(process.env.COMPAT_WIRE_LOG, JSON.stringify(exchanges)));
"""

# Each engine's own way of naming its build: vLLM's /version, SGLang's /v1/loads, llama.cpp's /props.
VERSION_ROUTES = {"vllm": ("/version", "version"), "sglang": ("/v1/loads", "version"),
                  "llamacpp": ("/props", "build_info")}
RANK = {"pass": 2, "warn": 1, "fail": 0}


# -- the scanner ---------------------------------------------------------------------------------
def fail(reason: str) -> SystemExit:
    """The run cannot go on: the reason on stderr, exit status 2."""
    print(f"benchmarks.compat: {reason}", file=sys.stderr, flush=True)
    return SystemExit(2)


def _tool_version(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _installed(npm_dir: Path) -> tuple[str, str]:
    """(version, integrity) of the scanner installed in npm_dir, ("", "") when there is none."""
    try:
        version = json.loads((npm_dir / "node_modules" / SCANNER / "package.json").read_text())["version"]
        lock = json.loads((npm_dir / "package-lock.json").read_text())
        return version, lock["packages"][f"node_modules/{SCANNER}"].get("integrity", "")
    except (OSError, ValueError, KeyError):
        return "", ""


def install_scanner(npm_dir: Path = NPM_DIR) -> dict:
    """The pinned scanner in npm_dir, installed by npm when it is not there yet: its version, the tarball's
    integrity, the command that runs it and the Node.js and npm versions; exit status 2 with the reason when it
    cannot be had."""
    node = shutil.which("node")
    if node is None:
        raise fail(f"Node.js 20 or newer is needed to run {SCANNER} (`node` is not on PATH)")
    node_version = _tool_version([node, "--version"])
    if not node_version.startswith("v") or int(node_version[1:].split(".")[0]) < 20:
        raise fail(f"{SCANNER} needs Node.js 20 or newer; `node --version` says {node_version or 'nothing'}")
    npm = shutil.which("npm")
    if _installed(npm_dir) != (SCANNER_VERSION, SCANNER_INTEGRITY):
        if npm is None:
            raise fail(f"{SCANNER} {SCANNER_VERSION} is not installed in {npm_dir} and `npm` is not on PATH to "
                       "install it")
        npm_dir.mkdir(parents=True, exist_ok=True)
        print(f"installing {SCANNER}@{SCANNER_VERSION} into {npm_dir}", flush=True)
        done = subprocess.run([npm, "install", "--prefix", str(npm_dir), "--ignore-scripts", "--no-audit", "--no-fund",
                               "--save-exact", f"{SCANNER}@{SCANNER_VERSION}"],
                              check=False, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise fail(f"npm could not install {SCANNER}@{SCANNER_VERSION} (exit {done.returncode}):\n"
                       f"{(done.stderr or done.stdout)[-2000:]}")
        found = _installed(npm_dir)
        if found != (SCANNER_VERSION, SCANNER_INTEGRITY):
            raise fail(f"npm installed {SCANNER} {found[0] or '(none)'} with integrity {found[1] or '(none)'}; "
                       f"expected {SCANNER_VERSION} with {SCANNER_INTEGRITY}")
    cli = npm_dir / "node_modules" / SCANNER / "src" / "cli.js"
    wire = npm_dir / "wire.mjs"
    wire.write_text(WIRE_JS)
    return {"name": SCANNER, "version": SCANNER_VERSION, "integrity": SCANNER_INTEGRITY, "node": node_version,
            "npm": _tool_version([npm, "--version"]) if npm else "", "argv": [node, "--import", str(wire), str(cli)]}


def scan(scanner: dict, base: str, timeout: float, work: Path, name: str) -> dict:
    """The scanner's JSON report on base/v1 (modern profile: Chat Completions and the Responses API), and every
    request and reply it made (`exchanges`)."""
    wire_log = work / f"{name}.wire.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "COMPATCANARY_"))}
    env.update(OPENAI_API_KEY=kit.KEY, COMPAT_WIRE_LOG=str(wire_log))
    flags = ["scan", "--base-url", f"{base}/v1", "--model", MODEL, "--profile", "modern", "--format", "json",
             "--fail-on", "never", "--timeout", f"{timeout:g}"]
    done = subprocess.run([*scanner["argv"], *flags], check=False, capture_output=True, text=True, env=env,
                          timeout=timeout * 10 + 60)
    if done.returncode != 0:
        raise fail(f"{SCANNER} exited {done.returncode} on {base}:\n{done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    report["exchanges"] = json.loads(wire_log.read_text()) if wire_log.exists() else []
    report["flags"] = flags
    return report


# -- the processes -------------------------------------------------------------------------------
def start_sim(kind: str, procs: list) -> str:
    """A simulated engine of `kind` serving MODEL on a free port (the fast default profile, seed 0): its URL."""
    port = kit.free_port()
    argv = [sys.executable, "-m", "gateway.sim", "--engine", kind, "--port", str(port), "--model", MODEL]
    url = f"http://127.0.0.1:{port}"
    kit.start(argv, procs, url + "/health", cwd=kit.ROOT, **kit.QUIET)
    return url


def gateway_toml(path: Path, kind: str, url: str) -> Path:
    """The gateway's config: the benchmarks' key, no access log, no warm-up request, one backend of `kind`."""
    path.write_text(f'[server]\naccess_log = false\n\n[[auth.keys]]\nid = "bench"\nsha256 = "{hash_key(kit.KEY)}"\n\n'
                    f'[health]\nwarmup = false\n\n[[backends]]\nid = "{kind}-0"\nengine = "{kind}"\nurl = "{url}"\n'
                    f'models = ["{MODEL}"]\n')
    return path


def engine_version(kind: str, url: str) -> str:
    path, field = VERSION_ROUTES[kind]
    try:
        with urllib.request.urlopen(url + path, timeout=10) as r:
            return str(json.loads(r.read())[field])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def run_kind(kind: str, scanner: dict, timeout: float, work: Path) -> dict:
    """Both scans of one engine kind: the engine directly, then the gateway in front of its twin."""
    procs: list = []
    try:
        direct_url, behind_url = start_sim(kind, procs), start_sim(kind, procs)
        cfg = gateway_toml(work / f"{kind}.toml", kind, behind_url)
        log = work / f"{kind}-gateway.log"
        with log.open("wb") as err:
            try:
                gateway_url, _ = kit.start_gateway(cfg, procs, stdout=subprocess.DEVNULL, stderr=err)
            except TimeoutError:
                raise fail(f"the gateway did not get ready:\n{log.read_text()[-3000:]}") from None
        print(f"{kind}: engine {direct_url}, gateway {gateway_url} in front of {behind_url}", flush=True)
        out = {"engine_version": engine_version(kind, direct_url),
               "private_fields": list(getattr(backends.REGISTRY[kind], "private_fields", ()))}
        for name, base in (("direct", direct_url), ("gateway", gateway_url)):
            out[name] = scan(scanner, base, timeout, work, f"{kind}-{name}")
            print(f"  {name}: " + ", ".join(f"{r['id']} {r['status']}" for r in out[name]["results"]), flush=True)
        out["wire"] = compare_runs(out["direct"], out["gateway"])
        for ex, w in zip(out["direct"]["exchanges"], out["wire"]):
            if w and any(d["kind"] == "absent through the gateway" for d in w["differences"]) and "events" in w:
                w["with_usage"] = replay_with_usage(ex)
        for name in ("direct", "gateway"):  # the saved data keeps the head of each reply
            for ex in out[name]["exchanges"]:
                if len(ex.get("body") or "") > BODY_KEEP:
                    ex["body"] = ex["body"][:BODY_KEEP] + f"... ({len(ex['body']):,} characters in all)"
        return out
    finally:
        kit.stop_all(procs)


# -- the report ----------------------------------------------------------------------------------
def cell(result: dict) -> str:
    return f"**{result['status'].upper()}**: {result['summary']}".replace("|", "\\|")


def short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def events_text(d: dict, total: int | None) -> str:
    ev = d["events"]
    if not ev:
        return ""
    if total is not None and len(ev) == total:
        return " (every event)"
    shown = ", ".join(str(i + 1) for i in ev[:6]) + (", ..." if len(ev) > 6 else "")
    return f" (event{'s' if len(ev) > 1 else ''} {shown}" + (f" of {total})" if total else ")")


def describe(d: dict, total: int | None) -> str:
    where = f"`{d['path']}`" if d["path"] else ""
    if d["kind"] == "absent through the gateway":
        text = f"{where} absent through the gateway"
    elif d["kind"] == "added by the gateway":
        text = f"{where} added by the gateway ({short(d['gateway'])})"
    else:
        text = f"{d['kind']} {where} {short(d['direct'])} directly, {short(d['gateway'])} through the gateway"
    return " ".join(text.split()) + events_text(d, total)


# What a difference is, when this run can tell: the first three are the gateway's by design.
CLASSES = {
    "model list": "the gateway's own model list (GET /v1/models answers from its config: `id`, `object`, "
                  "`created` and `owned_by: shapegate` for each model, not the engine's list)",
    "private field": "a field of the engine's own that the gateway drops so that every engine answers alike "
                     "(`[server]` or the backend's `engine_private_fields = true` keeps it)",
    "usage chunk": "a member that the engine puts on its usage chunk alone once it is asked for usage, as the "
                   "gateway asks it for its own token count (`stream_options.include_usage`); the gateway then "
                   "drops that chunk, with the member, for a client that did not ask for usage (checked by sending "
                   "the same request with `include_usage` to the engine directly)",
    "charset": "the content type's charset parameter (the media type is the same)",
    "other": "not explained by this run",
}


def classify(probe: str, d: dict, private: list[str], w: dict | None = None) -> str:
    top = d["path"].split(".")[0].split("[")[0]
    if probe == "models.list":
        return "model list"
    if d["kind"] == "absent through the gateway" and top in private:
        return "private field"
    replay = (w or {}).get("with_usage")
    if (d["kind"] == "absent through the gateway" and replay and top in replay["usage_chunk_members"]
            and top not in replay["other_chunk_members"]):
        return "usage chunk"
    if (d["kind"] == "content type" and isinstance(d["direct"], str) and isinstance(d["gateway"], str)
            and d["direct"].split(";")[0].strip() == d["gateway"].split(";")[0].strip()):
        return "charset"
    return "other"


def classified(run: dict) -> list[tuple[str, str, dict, int | None]]:
    """(probe id, class, difference, events in the stream or None) of each difference of one engine kind."""
    out = []
    for r, w in zip(run["direct"]["results"], run["wire"]):
        for d in (w or {}).get("differences", []):
            out.append((r["id"], classify(r["id"], d, run["private_fields"], w), d, (w.get("events") or [None])[0]))
    return out


def wire_cell(w: dict | None) -> str:
    if w is None:
        return "not paired"
    n = len(w["differences"])
    return "alike" if n == 0 else f"{n} difference{'s' if n > 1 else ''}"


def verdicts(data: dict) -> dict:
    """Per engine kind: the probes passed directly, those of them not passed through the gateway, those failed
    directly, and those the gateway does worse or better on."""
    out = {}
    for kind, run in data["engines"].items():
        pairs = list(zip(run["direct"]["results"], run["gateway"]["results"]))
        out[kind] = {
            "probes": len(pairs),
            "passed_direct": [d["id"] for d, _ in pairs if d["status"] == "pass"],
            "lost": [d["id"] for d, g in pairs if d["status"] == "pass" and g["status"] != "pass"],
            "worse": [d["id"] for d, g in pairs if RANK[g["status"]] < RANK[d["status"]]],
            "better": [d["id"] for d, g in pairs if RANK[g["status"]] > RANK[d["status"]]],
            "not_direct": [f"{d['id']} ({d['status']}: {d['summary']})" for d, _ in pairs if d["status"] != "pass"],
            "wire": sum(1 for w in run["wire"] if w and w["differences"]),
            "classes": [c for _, c, _, _ in classified(run)],
        }
    return out


def reading(data: dict) -> list[str]:
    v = verdicts(data)
    kinds = list(v)
    lines = ["## Reading", ""]
    held = all(not x["lost"] for x in v.values())
    for kind in kinds:
        x = v[kind]
        s = (f"- {kind}: {len(x['passed_direct'])} of {x['probes']} probes pass directly; "
             + (f"all {len(x['passed_direct'])} pass through the gateway too" if not x["lost"]
                else f"through the gateway {', '.join(x['lost'])} do{'es' if len(x['lost']) == 1 else ''} not"))
        if x["not_direct"]:
            s += (". Not passed directly, so the simulator's own and not the gateway's: "
                  + "; ".join(x["not_direct"]))
        if x["better"]:
            s += f". The gateway does better than the engine on {', '.join(x['better'])}"
        lines.append(s + ".")
    lines += ["", ("Every probe that passes against an engine directly passes through the gateway in front of it, "
                   "for each engine kind scanned." if held else
                   "The requirement that every probe passing directly also passes through the gateway is NOT met: "
                   "see the probes named above and their wire differences below.")]
    n_wire = sum(x["wire"] for x in v.values())
    total = sum(x["probes"] for x in v.values())
    lines += ["", f"Beyond the scanner's verdicts, {total - n_wire} of the {total} replies through the gateway are "
                  "the engine's own reply (ids and clock times aside; headers of the connection and the gateway's "
                  "own `x-` headers aside)" + (f"; {n_wire} differ." if n_wire else ".")]
    found: dict[str, list[str]] = {c: [] for c in CLASSES}
    for kind, run in data["engines"].items():
        for probe, c, d, total_events in classified(run):
            found[c].append(f"{kind} `{probe}`: {describe(d, total_events)}")
    if any(found.values()):
        lines += ["", f"The {sum(map(len, found.values()))} differences in them, by what they are:", ""]
        for c, items in found.items():
            if not items:
                continue
            lines.append(f"- {len(items)} {'is' if len(items) == 1 else 'are'} {CLASSES[c]}"
                         + ("." if c == "model list" else ":"))
            if c != "model list":  # (the model list's are in each engine's section)
                lines += [f"  - {item}" for item in items]
    return lines


def engine_section(kind: str, run: dict) -> list[str]:
    d_rep, g_rep = run["direct"], run["gateway"]
    lines = [f"## {kind} (simulated, version {run['engine_version']})", "",
             f"Score {d_rep['score']}/100 directly, {g_rep['score']}/100 through the gateway; required "
             f"compatibility {'PASS' if d_rep['compatible'] else 'FAIL'} directly, "
             f"{'PASS' if g_rep['compatible'] else 'FAIL'} through the gateway.", "",
             "| probe | required | engine directly | through the gateway | ms direct / gateway | replies |",
             "|---|---|---|---|---|---|"]
    for d, g, w in zip(d_rep["results"], g_rep["results"], run["wire"]):
        lines.append(f"| {d['name']} (`{d['id']}`) | {'yes' if d['required'] else 'no'} | {cell(d)} | {cell(g)} | "
                     f"{d['durationMs']} / {g['durationMs']} | {wire_cell(w)} |")
    notes = []
    for r, w, dx in zip(d_rep["results"], run["wire"], d_rep["exchanges"]):
        if w is None:
            continue
        head = f"- `{r['id']}` ({dx['method']} {dx['url'].split('/v1', 1)[-1]})"
        if not w["request_same"]:
            notes.append(f"{head}: the scanner's two requests differ, so the replies are not comparable")
            continue
        total = w["events"][0] if "events" in w else None
        for diff in w["differences"]:
            c = classify(r["id"], diff, run["private_fields"], w)
            notes.append(f"{head}: {describe(diff, total)}" + (f" [{c}]" if c != "other" else ""))
        if w.get("headers_dropped"):
            notes.append(f"{head}: response headers of the engine not passed on: "
                         + ", ".join(f"`{h}`" for h in w["headers_dropped"]))
    added = sorted({h for w in run["wire"] if w for h in w.get("headers_added", [])})
    lines += ["", "Where the replies through the gateway differ from the engine's own:", ""]
    lines += notes or ["- nowhere (ids and clock times aside)"]
    if added:
        lines += ["", "Headers the gateway adds: " + ", ".join(f"`{h}`" for h in added) + "."]
    lines += [""]
    for x in (d_rep, g_rep):
        errors = [r for r in x["results"] if r.get("error")]
        for r in errors:
            lines.append(f"`{r['id']}` against {x['target']['baseUrl']}: {json.dumps(r['error'])[:600]}")
    return lines + [""]


def markdown(data: dict) -> str:
    s, c = data["scanner"], data["conditions"]
    kinds = list(data["engines"])
    probes = [(r["id"], r["name"], r["required"]) for r in data["engines"][kinds[0]]["direct"]["results"]]
    head = "| probe | required | " + " | ".join(f"{k} direct | {k} gateway" for k in kinds) + " |"
    table = [head, "|" + "---|" * (2 + 2 * len(kinds))]
    for i, (pid, name, req) in enumerate(probes):
        row = [f"{name} (`{pid}`)", "yes" if req else "no"]
        for k in kinds:
            run = data["engines"][k]
            row += [run["direct"]["results"][i]["status"].upper(), run["gateway"]["results"][i]["status"].upper()]
        table.append("| " + " | ".join(row) + " |")
    flags = list(data["engines"][kinds[0]]["direct"]["flags"])
    flags[flags.index("--base-url") + 1] = "URL/v1"
    flags = " ".join(flags)
    sim = c["simulator"]
    lines = [
        "# OpenAI compatibility: an outside scanner, direct and through the gateway", "",
        kit.run_line(c) + ".", "",
        f"Scanner: {s['name']} {s['version']} from npm (tarball integrity `{s['integrity']}`), run by Node.js "
        f"{s['node']}: `compatcanary {flags}`, once against a simulated engine's base URL and once against the "
        f"gateway's, with the same model name (`{MODEL}`) and API key. Its probes run one request each, in order: "
        "the model list, a chat completion, a streamed one, a forced function call (`tool_choice` naming a strict "
        "function), strict `json_schema` structured output, a Responses API request and a streamed one. A probe "
        "passes, warns (optional or non-canonical behaviour) or fails; its reason is the scanner's own text.", "",
        f"Engines: per kind, two `python3 -m gateway.sim` processes with the same options (model `{MODEL}`, the "
        "kind's fast default profile, seed 0): the scanner meets one directly and the other behind a gateway of "
        "this tree (`shapegate serve`, one backend of that engine kind, no access log, no warm-up request), so "
        "each scan meets an engine no request has reached before. The simulator's sources (gateway/sim) hashed "
        f"`{sim['sha256']}`, {sim['changed']} of their paths differing from the commit.", "",
        "The replies are compared too: the scanner's `fetch` is wrapped (`node --import`) so that every request "
        "and reply it makes is kept, and each reply through the gateway is set against the engine's reply to the "
        f"same request, member by member and, for a stream, event by event; ids ({', '.join(sorted(VOLATILE))}) "
        "and headers of the connection are left out of it.", "",
        "## Verdicts", "", *table, "",
        *reading(data), "",
    ]
    for k in kinds:
        lines += engine_section(k, data["engines"][k])
    return "\n".join(lines).rstrip() + "\n"


# -- the run -------------------------------------------------------------------------------------
def sim_sources() -> dict:
    """A digest of the simulator's sources and how many of its paths differ from the commit: which simulator
    the run met, while its code changes between runs."""
    digest = hashlib.sha256()
    for path in sorted((kit.ROOT / "gateway" / "sim").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(kit.ROOT)).encode() + b"\0" + path.read_bytes())
    return {"sha256": digest.hexdigest()[:12], "changed": len(kit.changed_paths("gateway/sim"))}


def measure(args: argparse.Namespace) -> dict:
    scanner = install_scanner()
    conditions = {**kit.provenance(), "simulator": sim_sources()}
    engines = {}
    with tempfile.TemporaryDirectory() as d:
        for kind in args.engines:
            engines[kind] = run_kind(kind, scanner, args.timeout, Path(d))
    conditions.update(load_after=os.getloadavg(), command=kit.command("benchmarks.compat"))
    scanner.pop("argv")
    return {"conditions": conditions, "scanner": scanner, "model": MODEL, "engines": engines}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES),
                   help="simulated engine kinds to scan (default: all three)")
    p.add_argument("--timeout", type=float, default=30.0, help="the scanner's timeout per request, s (default 30)")
    p.add_argument("--out", default=str(OUT), help="results/compat: writes OUT.json and OUT.md")
    p.add_argument("--render", action="store_true", help="only write OUT.md again from OUT.json")
    args = p.parse_args()
    out = Path(args.out)
    if args.render:
        data = json.loads(out.with_suffix(".json").read_text())
        print(kit.render_again(out, markdown))
    else:
        data = measure(args)
        text = markdown(data)
        kit.write_result(out, data, text)
        print(text)
    return 1 if any(x["lost"] for x in verdicts(data).values()) else 0


if __name__ == "__main__":
    sys.exit(main())
