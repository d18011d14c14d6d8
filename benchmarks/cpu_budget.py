"""Where a non-streamed request's CPU goes: the gateway with its defaults, with each optional feature off and with all
of them off, beside an aiohttp proxy and a proxy that passes bytes on unread, in one run, at each concurrency asked."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import kit
from deploy.compile import compiled_copy

BUILDS = {"sources": "the plain sources", "compiled": "a copy compiled by `deploy/compile.py` (what the image runs)"}
# The gateway's optional per-request features, and what switching each off means in its config.
FEATURES = {"access log": "access log off ([server] access_log = false)",
            "stats upkeep": "stats upkeep off ([stats] enabled = false: counters only)",
            "API-key auth": "auth off ([auth] enabled = false)",
            "shape routing": "round robin ([routing] policy = \"round_robin\" instead of the default shape)"}
GATEWAYS = {"defaults": (), **{f"no {f}": (f,) for f in FEATURES}, "all four off": tuple(FEATURES)}
REFERENCES = {"aiohttp proxy": "benchmarks/floor_proxy.py: aiohttp server and client, the body parsed once",
              "parsing proxy": "benchmarks/parsing_proxy.py: uvloop protocol callbacks, llhttp on both sides, the key "
                               "checked, the body's JSON parsed, a reply head of its own; no task per request",
              "parsing proxy, tasks": "the same with --tasks: a task per request, which awaits the engine's reply "
                                      "on a future and writes it",
              "bytes proxy": "benchmarks/bytes_proxy.py: uvloop protocols passing bytes on unread"}
TARGETS = (*GATEWAYS, *REFERENCES)


def gateway_config(path: Path, engine: str, off: tuple[str, ...]) -> Path:
    return kit.gateway_config(path, engine, access_log="access log" not in off, stats="stats upkeep" not in off,
                              auth="API-key auth" not in off,
                              sections='[routing]\npolicy = "round_robin"\n' if "shape routing" in off else "")


def start(tmp: Path, tree: Path, engine: str, procs: list) -> dict[str, tuple[str, int]]:
    """Every target on its own port, the gateways from `tree`: name -> (base URL, pid)."""
    out = {}
    for name in TARGETS:
        if name in GATEWAYS:
            base, p = kit.start_gateway(gateway_config(tmp / f"{len(out)}.toml", engine, GATEWAYS[name]), procs,
                                        tree=tree, **kit.QUIET)
            out[name] = (base, p.pid)
            continue
        port = str(kit.free_port())
        if name.startswith("parsing proxy"):
            argv = kit.script("parsing_proxy.py", "--port", port, "--engine", engine, "--key", kit.KEY,
                              *(["--tasks"] if name.endswith("tasks") else []))
        elif name == "aiohttp proxy":
            argv = kit.script("floor_proxy.py", "--port", port, "--upstream", engine)
        else:
            argv = kit.script("bytes_proxy.py", "--port", port, "--upstream-port", engine.rsplit(":", 1)[1])
        base = f"http://127.0.0.1:{port}"
        ready = base + ("/health" if name == "bytes proxy" else "/readyz")
        p = kit.start(argv, procs, ready, cwd=kit.ROOT, **kit.QUIET)
        out[name] = (base, p.pid)
    return out


def syscalls(pid: int, url: str, script: str, conc: int, seconds: float) -> dict:
    """Syscalls per request by name, counted by strace over a wrk run of its own (strace slows the target: its
    counts stand, its timings are not used)."""
    out = Path(script).with_suffix(f".{pid}.{conc}.strace")
    tracer = subprocess.Popen(["strace", "-f", "-c", "-q", "-p", str(pid), "-o", str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # attached to every thread before the load starts
    r = kit.run_wrk(url, kit.BODIES["nonstream"], conc, seconds, script)
    tracer.send_signal(signal.SIGINT)
    tracer.wait(30)
    calls = {}
    for line in out.read_text().splitlines():
        parts = line.split()
        if len(parts) in (5, 6) and parts[0][0].isdigit() and parts[-1] != "total":
            calls[parts[-1]] = int(parts[3]) / max(r["requests"], 1)
    return calls


def measure(args) -> dict:
    cond = {**kit.provenance(), "command": kit.command("benchmarks.cpu_budget"),
            "seconds": args.seconds, "repeats": args.repeats, "build": args.build, "concurrency": args.conc}
    cond["wrk"] = kit.wrk_version()
    points: list[dict] = []
    traced: dict[str, dict] = {}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tree = kit.ROOT
        if args.build == "compiled":
            tree = tmp / "compiled"
            cond["compile_s"] = round(compiled_copy(tree))
        script = kit.wrk_script(tmp)
        try:
            engine = kit.start_engine(procs)
            targets = start(tmp, tree, engine, procs)
            for base, _ in targets.values():  # imports, connections, caches
                kit.run_wrk(base + "/v1/chat/completions", kit.BODIES["nonstream"], 64, 1.0, script)
            for rep in range(args.repeats):
                turn = rep * 3 % len(TARGETS)
                for conc in args.conc:
                    for name in (*TARGETS[turn:], *TARGETS[:turn]):
                        base, pid = targets[name]
                        u0, s0 = kit.cpu_times(pid)
                        r = kit.run_wrk(base + "/v1/chat/completions", kit.BODIES["nonstream"], conc, args.seconds,
                                        script)
                        u1, s1 = kit.cpu_times(pid)
                        n = max(r["requests"], 1)
                        r.update(target=name, rep=rep, conc=conc, rps=r["requests"] / (r["duration_us"] / 1e6),
                                 user_us=(u1 - u0) / n * 1e6, sys_us=(s1 - s0) / n * 1e6)
                        r["cpu_us"] = r["user_us"] + r["sys_us"]
                        points.append(r)
                        print(json.dumps(r), flush=True)
            if shutil.which("strace"):
                for conc in args.conc:
                    for name, (base, pid) in targets.items():
                        traced[f"{name}@{conc}"] = syscalls(pid, base + "/v1/chat/completions", script, conc, 2.0)
        finally:
            kit.stop_all(procs)
    cond["load_after"] = os.getloadavg()
    return {"conditions": cond, "points": points, "syscalls": traced}


def _per_round(points: list[dict], a: str, b: str, key: str = "cpu_us") -> list[float]:
    """a's figure minus b's, round by round (each pair ran within the same round)."""
    by = {(p["target"], p["rep"]): p[key] for p in points}
    return sorted(by[(a, r)] - by[(b, r)] for r in sorted({p["rep"] for p in points}) if (b, r) in by and (a, r) in by)


def _syscalls_at(data: dict, conc: int) -> dict[str, dict]:
    """The strace counts per target at one concurrency (a run before `--conc` traced c=64 only, keyed by target)."""
    out = {}
    for key, calls in (data.get("syscalls") or {}).items():
        name, _, at = key.partition("@")
        if int(at or 64) == conc:
            out[name] = calls
    return out


def markdown(data: dict) -> str:
    c = data["conditions"]
    concs = c.get("concurrency", [64])  # (runs before `--conc` measured c=64 alone)
    build = c.get("build", "sources")
    sc_any = bool(data.get("syscalls"))
    threads = "2 threads, 1 at c=1" if 1 in concs else "2 threads"
    lines = ["# Where a request's CPU goes", "",
             kit.run_line(c) + f"; {c['wrk']}.", "",
             "Non-streamed requests from wrk (" + ", ".join(f"c={n}" for n in concs) + f"; {threads}), "
             f"{c['seconds']:g} s per target, concurrency and round, {c['repeats']} rounds, the targets' order "
             "rotated between rounds; one zero-delay engine (`benchmarks/fast_engine.py`, a 16-token reply); every "
             f"target and wrk share the machine's cores. The gateways run {BUILDS[build]} of this tree with "
             "`benchmarks/overhead.py`'s config (API-key auth, JSON access log to /dev/null, stats upkeep, the "
             "default shape policy), less what each row switches off. CPU per request = the process's user and "
             "system time (/proc) over the requests wrk completed. Medians of the rounds, ± = (max-min)/median."
             + (" Syscalls per request: counted by strace over 2 s more of the same load per target and "
                "concurrency, after the rounds." if sc_any else " (strace was not installed: no syscall counts.)"),
             "", "What each switches off: " + "; ".join(f"**no {k}**: {v}" for k, v in FEATURES.items())
             + ". References: " + "; ".join(f"**{k}**: {v}" for k, v in REFERENCES.items()) + ".", ""]
    for conc in concs:
        pts = [p for p in data["points"] if p.get("conc", 64) == conc]
        lines += _section(conc, pts, _syscalls_at(data, conc), len(concs) > 1)
    return "\n".join(lines)


def _section(conc: int, pts: list[dict], sc: dict[str, dict], titled: bool) -> list[str]:
    """One concurrency's table and what it says."""
    f = {t: {k: kit.median_spread([p[k] for p in pts if p["target"] == t])
             for k in ("cpu_us", "user_us", "sys_us", "rps")}
         for t in TARGETS if any(p["target"] == t for p in pts)}
    lines = [f"## c={conc}", ""] if titled else []
    lines += ["| target | CPU / request us | user us | system us | req/s | syscalls / request |",
              "|---|---|---|---|---|---|"]
    for t, v in f.items():
        calls = sc.get(t, {})
        top = ", ".join(f"{k} {n:.2f}" for k, n in sorted(calls.items(), key=lambda x: -x[1]) if n >= 0.05)
        lines.append(f"| {t} | {kit.pm(v['cpu_us'], ',.1f')} | {v['user_us'][0]:,.1f} | "
                     f"{v['sys_us'][0]:,.1f} | {kit.pm(v['rps'])} | "
                     + (f"{sum(calls.values()):.2f} ({top})" if calls else "-") + " |")
    lines.append("")
    reading = []
    if "defaults" in f:
        d = f["defaults"]["cpu_us"][0]
        for feat in FEATURES:
            saved = _per_round(pts, "defaults", f"no {feat}")
            if saved:
                reading.append(f"- {feat}: {statistics.median(saved):,.1f} us per request "
                               f"({statistics.median(saved) / d:.0%} of the defaults' {d:,.1f} us; per round "
                               f"{', '.join(f'{x:,.1f}' for x in saved)}).")
        all_off = _per_round(pts, "defaults", "all four off")
        if all_off and "all four off" in f:
            a = f["all four off"]
            reading.append(f"- All four together: {statistics.median(all_off):,.1f} us (per round "
                           f"{', '.join(f'{x:,.1f}' for x in all_off)}); with all four off the gateway spends "
                           f"{a['cpu_us'][0]:,.1f} us per request ({a['user_us'][0]:,.1f} user, "
                           f"{a['sys_us'][0]:,.1f} system).")
        if "bytes proxy" in f and "all four off" in f:
            b, a = f["bytes proxy"], f["all four off"]
            reading.append(f"- The bytes proxy spends {b['cpu_us'][0]:,.1f} us ({b['user_us'][0]:,.1f} user, "
                           f"{b['sys_us'][0]:,.1f} system): the gateway with all four off spends "
                           f"{a['cpu_us'][0] / b['cpu_us'][0]:,.1f}x that, {a['user_us'][0] - b['user_us'][0]:,.1f} us "
                           "more in user space: its request path with no optional feature (framing and checking "
                           "the client's request and the engine's reply, the request's task, picking a backend, "
                           "the upstream exchange, the reply) costs that much more than passing bytes on.")
        if "parsing proxy" in f and "all four off" in f:
            p, a = f["parsing proxy"], f["all four off"]
            reading.append(f"- The parsing proxy spends {p['cpu_us'][0]:,.1f} us ({p['user_us'][0]:,.1f} user, "
                           f"{p['sys_us'][0]:,.1f} system), with the same reads and writes: a Python process that "
                           "frames both sides with llhttp, checks the key and parses the body needs no more. The "
                           f"defaults spend {d / p['cpu_us'][0]:,.1f}x that, all four off "
                           f"{a['cpu_us'][0] / p['cpu_us'][0]:,.1f}x: the gap is the gateway's own request path, "
                           "not the language.")
        if "parsing proxy" in f and "parsing proxy, tasks" in f:
            p, k = f["parsing proxy"]["cpu_us"][0], f["parsing proxy, tasks"]["cpu_us"][0]
            diff = _per_round(pts, "parsing proxy, tasks", "parsing proxy")
            reading.append(f"- A task per request awaiting a future for the reply: {k:,.1f} us against {p:,.1f}, "
                           f"{statistics.median(diff):+,.1f} us per request (per round "
                           f"{', '.join(f'{x:+,.1f}' for x in diff)}): what the coroutine style itself costs.")
        if "aiohttp proxy" in f:
            reading.append(f"- The aiohttp proxy: {f['aiohttp proxy']['cpu_us'][0]:,.1f} us per request, the "
                           f"defaults {d / f['aiohttp proxy']['cpu_us'][0]:.2f}x that.")
    totals = {t: sum(v.values()) for t, v in sc.items() if v}
    if totals:
        lo, hi = min(totals.items(), key=lambda x: x[1]), max(totals.items(), key=lambda x: x[1])
        reading.append(f"- Syscalls per request range from {lo[1]:.2f} ({lo[0]}) to {hi[1]:.2f} ({hi[0]}).")
    return lines + [f"### Reading (c={conc})" if titled else "## Reading", "", *reading, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conc", type=int, nargs="+", default=[64, 1], help="wrk's connections, each in every round")
    ap.add_argument("--build", choices=list(BUILDS), default="compiled",
                    help="the gateways' tree: compiled as the image runs it (default), or the plain sources")
    ap.add_argument("--render", action="store_true", help="re-render the .md from the saved .json")
    args = ap.parse_args()
    kit.save_and_render("cpu_budget", None if args.render else measure(args), markdown)


if __name__ == "__main__":
    main()
