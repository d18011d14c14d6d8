"""CPU per streamed request through the gateway: Responses and Messages beside chat, 200 tokens each, in one run."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from benchmarks import kit

TOKENS = 200
LIMIT = 1.2  # the requirement: a typed stream's CPU per request within this multiple of a chat stream's
_ASK = {"model": "bench", "stream": True}
# name -> (path, body): the same 200-token stream in each API's form.
KINDS = {
    "chat": ("/v1/chat/completions", kit.BODIES["stream"]),
    "responses": ("/v1/responses", json.dumps({**_ASK, "input": "hello there", "max_output_tokens": TOKENS,
                                                "store": False})),
    "messages": ("/v1/messages", json.dumps({**_ASK, "messages": [{"role": "user", "content": "hello there"}],
                                             "max_tokens": TOKENS})),
    "responses_store": ("/v1/responses", json.dumps({**_ASK, "input": "hello there", "max_output_tokens": TOKENS,
                                                      "store": True})),
}
LABEL = {"chat": "chat completions", "responses": "Responses, store false", "messages": "Messages",
         "responses_store": "Responses, store true"}
TYPED = ("responses", "messages")  # the two the requirement is about; responses_store shows what storing adds


def source_digest() -> str:
    """sha256 (12 hex) of the gateway's and the adapters' Python sources as they are on disk: which code ran."""
    h = hashlib.sha256()
    for path in sorted(p for d in ("gateway", "backends") for p in (kit.ROOT / d).rglob("*.py")):
        h.update(str(path.relative_to(kit.ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def start_stack(tmp: Path, procs: list) -> tuple[str, int]:
    """The engine and one gateway in front of it, as a vLLM backend (the adapter that serves all three APIs)."""
    engine = kit.start_engine(procs, "--chunks", str(TOKENS))
    cfg = kit.gateway_config(tmp / "bench.toml", engine, access_log=True, stats=True)
    cfg.write_text(cfg.read_text().replace('engine = "openai"', 'engine = "vllm"'))
    log = tmp / "gateway.log"
    with log.open("wb") as err:
        try:
            base, gw = kit.start_gateway(cfg, procs, stdout=subprocess.DEVNULL, stderr=err)
        except TimeoutError:
            raise SystemExit(f"the gateway did not get ready:\n{log.read_text()[-3000:]}") from None
    return base, gw.pid


def counted(base: str) -> tuple[float, float]:
    """The gateway's own count of requests and of completion tokens so far (/metrics)."""
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {kit.KEY}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    sums = {"shapegate_requests_total": 0.0, "shapegate_completion_tokens_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums["shapegate_requests_total"], sums["shapegate_completion_tokens_total"]


def wrk_cpu() -> float:
    """CPU seconds of this process's finished children so far (wrk, once it has run)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def drive(args, base: str, pid: int, engine_pid: int, script: str) -> list[dict]:
    """Each (conc, repeat) runs every kind in turn on the one gateway; the order rotates between repeats."""
    for path, body in KINDS.values():  # imports, connections, caches: warm every path first
        kit.run_wrk(base + path, body, 4, 1.0, script)
    names, points = list(KINDS), []
    for conc in args.concurrency:
        for rep in range(args.repeats):
            turn = rep % len(names)
            for pos, kind in enumerate([*names[turn:], *names[:turn]]):
                path, body = KINDS[kind]
                n0, t0 = counted(base)
                meter, w0, c0 = kit.CpuMeter([pid, engine_pid]), wrk_cpu(), kit.cpu_seconds(pid)
                r = kit.run_wrk(base + path, body, conc, args.seconds, script)
                cpu, busy, wrk = kit.cpu_seconds(pid) - c0, meter.read(), wrk_cpu() - w0
                n1, t1 = counted(base)
                secs = r["duration_us"] / 1e6
                r.update(kind=kind, conc=conc, rep=rep, position=pos, rps=r["requests"] / secs,
                         cpu_per_req_us=cpu / r["requests"] * 1e6, gateway_cores=cpu / secs,
                         others_cores=max(busy["others"] - wrk / secs, 0.0),
                         tokens_per_req=(t1 - t0) / max(n1 - n0, 1))
                points.append(r)
                print(json.dumps(r), flush=True)
    return points


def measure(args) -> dict:
    cond = {**kit.provenance(), "command": kit.command("benchmarks.apis"), "seconds": args.seconds,
            "repeats": args.repeats, "concurrency": args.concurrency, "tokens": TOKENS, "wrk": kit.wrk_version(),
            "dirty_gateway_paths": kit.changed_paths("gateway", "backends"), "source_digest": source_digest(),
            "bodies": {k: json.loads(b) for k, (_, b) in KINDS.items()}}
    if args.wait_quiet > 0:
        cond["quiet_wait"] = kit.wait_quiet(args.wait_quiet)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            base, pid = start_stack(tmp, procs)
            points = drive(args, base, pid, procs[0].pid, kit.wrk_script(tmp))
        finally:
            kit.stop_all(procs)
    cond.update(load_after=os.getloadavg(), source_digest_after=source_digest())
    return {"conditions": cond, "points": points}


# -- the report ------------------------------------------------------------------------------------
def ratios(points: list[dict], kind: str, conc: int) -> list[float]:
    """kind's CPU per request over chat's, repeat by repeat (both ran within the same repeat)."""
    by = {(p["kind"], p["rep"]): p["cpu_per_req_us"] for p in points if p["conc"] == conc}
    return [by[(kind, r)] / by[("chat", r)] for r in sorted({k[1] for k in by}) if (kind, r) in by]


def verdict(values: list[float]) -> str:
    over = sum(v > LIMIT for v in values)
    if not over:
        return f"within {LIMIT} in all {len(values)} repeats"
    return f"**above {LIMIT} in {over} of {len(values)} repeats**"


def table(points: list[dict], conc: int) -> list[str]:
    lines = [f"### c={conc}", "", "| stream | req/s | p50 us | CPU/req us | gateway cores | tokens/req (gateway's "
             "count) | CPU/req ÷ chat's (median, range) |", "|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        pts = [p for p in points if (p["kind"], p["conc"]) == (kind, conc)]
        med = {k: statistics.median(p[k] for p in pts) for k in ("p50", "gateway_cores", "tokens_per_req")}
        ratio = "-" if kind == "chat" else kit.span(ratios(points, kind, conc))
        lines.append(f"| {LABEL[kind]} | {kit.pm(kit.median_spread([p['rps'] for p in pts]))} | {med['p50']:,.0f} | "
                     f"{kit.pm(kit.median_spread([p['cpu_per_req_us'] for p in pts]))} | {med['gateway_cores']:.2f} | "
                     f"{med['tokens_per_req']:.0f} | {ratio} |")
    return lines


def reading(points: list[dict], concs: list[int]) -> list[str]:
    out, failed = [], []
    for conc in concs:
        cpu = {k: statistics.median(p["cpu_per_req_us"] for p in points if (p["kind"], p["conc"]) == (k, conc))
               for k in KINDS}
        for kind in TYPED:
            rs = ratios(points, kind, conc)
            failed += [f"{LABEL[kind]} at c={conc}"] if max(rs) > LIMIT else []
            out.append(f"- c={conc}, {LABEL[kind]}: {cpu[kind]:,.0f} us per stream against chat's {cpu['chat']:,.0f} "
                       f"us; ratio {kit.span(rs)}: {verdict(rs)}.")
        store = [a / b for a, b in zip(ratios(points, "responses_store", conc), ratios(points, "responses", conc))]
        resolved = ("the range includes 1.0: no difference resolved" if min(store) <= 1.0 <= max(store) else
                    f"{'above' if min(store) > 1.0 else 'below'} 1.0 in every repeat")
        out.append(f"- c={conc}, what `store: true` adds to a Responses stream (the gateway records the response's id "
                   f"and owner): {cpu['responses_store'] - cpu['responses']:+,.0f} us per stream; store true ÷ store "
                   f"false {kit.span(store)} per repeat, {resolved}.")
    out.insert(0, "- The requirement (a streamed Responses or Messages request within "
               f"{LIMIT}x a streamed chat request's CPU, in every repeat): "
               + ("met at every concurrency measured." if not failed else "not met for " + "; ".join(failed) + "."))
    tokens = [p["tokens_per_req"] for p in points]
    out.append(f"- Completion tokens per request as the gateway counted them, every window of every API: "
               f"{min(tokens):.1f} to {max(tokens):.1f} (a stream wrk cuts at the end of its window counts with the "
               "tokens it got so far).")
    errors = sum(p["errors"] for p in points)
    out.append("- wrk counted no errors (non-2xx, connect, read, write, timeout)." if not errors
               else f"- wrk counted {errors} errors in all: the figures include failed requests.")
    spreads = [kit.median_spread([p["cpu_per_req_us"] for p in points if (p["kind"], p["conc"]) == (k, c)])[1]
               for k in KINDS for c in concs]
    others = [p["others_cores"] for p in points]
    out.append(f"- CPU per request varied between repeats by {statistics.median(spreads):.0%} (median over the rows; "
               f"largest {max(spreads):.0%}). Other processes on the machine used {statistics.median(others):.2f} "
               f"cores during a median window (largest {max(others):.2f}) of the {os.cpu_count()}.")
    return out


def markdown(data: dict) -> str:
    c, points = data["conditions"], data["points"]
    dirty = len(c["dirty_gateway_paths"])
    code = (f"The gateway's sources (gateway/, backends/) differed from the commit in {dirty} paths (uncommitted "
            "work): the figures are of the work tree as it was when the gateway started (source digest "
            f"`{c['source_digest']}`" + ("" if c["source_digest_after"] == c["source_digest"] else
                                         f"; the sources changed during the run, `{c['source_digest_after']}` by "
                                         "its end, which the running gateway did not load") + ")."
            if dirty else f"The gateway's sources matched the commit (source digest `{c['source_digest']}`).")
    quiet = c.get("quiet_wait")
    lines = [
        "# Responses and Messages streams beside chat: the gateway's CPU per request", "",
        kit.run_line(c) + f"; {c['wrk']}. " + code
        + (f" Before starting, the run waited {quiet['waited_s']:g} s for the machine to quieten (others' use then: "
           f"{quiet['busy_cores']:.2f} cores)." if quiet else ""), "",
        f"One gateway process (this tree; API-key auth, stats upkeep and the JSON access log on, stdout to /dev/null) "
        "in front of `benchmarks/fast_engine.py`, a zero-delay engine registered as a vLLM backend (the adapter "
        f"that serves all three APIs). Every request is streamed and gets {c['tokens']} tokens, each API in its own "
        "event format: chat chunks ending in a usage chunk and `[DONE]` (the client asks for usage); Responses events "
        "(`event:` lines, `type` and `sequence_number`, response.created ... one response.output_text.delta per "
        "token ... response.completed with usage, each response a fresh `resp_` id); Messages events "
        "(message_start, content_block_start, one content_block_delta per token, content_block_stop, message_delta "
        "with usage, message_stop). The engine writes each whole reply at once. Responses requests send "
        "`store: false`, which leaves the gateway's stored-response index out of the measure; one more row sends "
        "`store: true`, for which the gateway also records each response's id, backend and owner.", "",
        f"wrk (1 thread at c=1, 2 above) drives each stream kind for {c['seconds']:g} s in turn, at "
        + ", ".join(f"c={n}" for n in c["concurrency"]) + f"; {c['repeats']} repeats, the kinds' order rotating "
        "between repeats; every path was first warmed with 1 s of wrk at c=4. CPU/req = the gateway process's "
        "user+system time (/proc) over the streams wrk completed; gateway cores = that time over the window. "
        "Figures are medians of the repeats, ± = (max-min)/median; a ratio to chat is taken within each repeat "
        "(the two ran seconds apart, on the same process), then its median and range. Tokens/req is the "
        "gateway's own /metrics count of completion tokens over its count of requests in the window. wrk, the engine "
        f"and the gateway share the machine's {os.cpu_count()} cores.", ""]
    for conc in c["concurrency"]:
        lines += table(points, conc) + [""]
    lines += ["## Reading", "", *reading(points, c["concurrency"]), ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--wait-quiet", type=float, default=60.0, metavar="S",
                   help="wait up to S seconds for other processes to leave the cores before starting (0: do not)")
    p.add_argument("--out", default=str(kit.RESULTS / "apis"))
    p.add_argument("--render", action="store_true", help="only write OUT.md again from OUT.json")
    args = p.parse_args()
    out = Path(args.out)
    if args.render:
        print(kit.render_again(out, markdown))
        return 0
    results = measure(args)
    report = markdown(results)
    print(report)
    kit.write_result(out, results, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
