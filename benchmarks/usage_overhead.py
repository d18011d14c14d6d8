"""What the usage ledger costs: CPU per request of the gateway as it was before it (a git revision) beside the work
tree's with the ledger on and traces off, both on Redis state, driven by wrk in one run, the order alternating.

Two gateway processes per side (started before, after, after, before), each on its own key prefix of one
redis-server started for the run, in front of one benchmarks/fast_engine.py. Each (kind, concurrency, round) drives
the four in turn, the order rotating by one each round; CPU per request is a gateway process's user + system time
from /proc over the requests wrk completed, averaged over the two processes of a side. Then instructions per
non-streamed request of each side under callgrind (steady where CPU time on a shared machine is not), and a request's
end with the ledger on and off timed in process. Writes results/usage_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import kit
from benchmarks import path_instructions as pi
from benchmarks.loopback import free_port

SLOTS = (("before", 1), ("after", 1), ("after", 2), ("before", 2))


def baseline_ref() -> str:
    """Today's gateway: where this branch left main (the commit before the ledger)."""
    return kit.git("merge-base", "HEAD", "main").strip() or "main"


def start_redis(procs: list[subprocess.Popen]) -> str:
    port = free_port()
    procs.append(subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                                  **kit.QUIET))
    deadline = time.monotonic() + 10
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() != b"PONG":
        if time.monotonic() > deadline:
            raise SystemExit("redis-server did not start")
        time.sleep(0.05)
    return f"redis://127.0.0.1:{port}/0"


def start_stack(tmp: Path, before: Path, procs: list) -> dict:
    engine = kit.start_engine(procs)
    redis_url = start_redis(procs)
    gws = {}
    for side, n in SLOTS:
        # One file per process, only the key prefix differs: the same [state] for both sides, no [usage] section
        # (the ledger's defaults: on, flushed every second), traces off (their default), no access log.
        state = f'[state]\nbackend = "redis"\nredis_url = "{redis_url}"\nkey_prefix = "bench-{side}-{n}:"\n'
        cfg = kit.gateway_config(tmp / f"{side}-{n}.toml", engine, access_log=False, stats=True, sections=state)
        base, proc = kit.start_gateway(cfg, procs, tree=before if side == "before" else None, timeout=30.0,
                                       **kit.QUIET)
        gws[(side, n)] = (proc.pid, base + "/v1/chat/completions")
    return gws


def drive(args, gws: dict, script: str) -> list[dict]:
    for slot in SLOTS:  # warm every process before measuring any
        for kind in args.kinds:
            kit.run_wrk(gws[slot][1], kit.BODIES[kind], 4, 1.0, script)
    points = []
    for kind in args.kinds:
        for conc in args.concurrency:
            for rnd in range(args.rounds):
                for pos in range(len(SLOTS)):
                    slot = SLOTS[(pos + rnd) % len(SLOTS)]
                    pid, url = gws[slot]
                    c0 = kit.cpu_seconds(pid)
                    r = kit.run_wrk(url, kit.BODIES[kind], conc, args.seconds, script)
                    cpu = kit.cpu_seconds(pid) - c0
                    r.update(kind=kind, conc=conc, round=rnd, side=slot[0], proc=slot[1], position=pos,
                             rps=r["requests"] / (r["duration_us"] / 1e6), cpu_per_req_us=cpu / r["requests"] * 1e6)
                    points.append(r)
                    print(json.dumps(r), flush=True)
    return points


def in_process(n: int = 100_000, repeats: int = 5) -> dict:
    """Microseconds per request, best of `repeats` runs of `n` calls (the least disturbed): a request's end
    (Gateway.finish, access log off) with the ledger on and off, the ledger's own count (Ledger.served), and a
    flush to the memory store per row."""
    return asyncio.run(_in_process(n, repeats))


async def _in_process(n: int, repeats: int) -> dict:
    from gateway.config import parse_config
    from gateway.contracts import Outcome, RequestShape
    from gateway.routing.request import RequestState
    from gateway.runtime import Gateway, build_policy
    from gateway.stats.ledger import Ledger
    from gateway.stats.ledger_store import Flusher, MemoryStore

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t) / n * 1e6)
        return best

    class Exchange:  # what finish() reads of the request's exchange
        headers: dict = {}
        method = "POST"

    class Caller:
        id, admin = "bench", False

    shape = RequestShape("bench", "chat", False, 8, 16, "default", "bench")
    o = Outcome("engine", shape, True, 200, prompt_tokens=8, completion_tokens=16)
    out: dict = {}
    for on in (True, False):
        cfg = parse_config({"auth": {"enabled": False}, "server": {"access_log": False}, "usage": {"enabled": on},
                            "backends": [{"id": "engine", "engine": "openai", "url": "http://127.0.0.1:9",
                                          "models": ["bench"]}]}, build_policy)
        g = Gateway(cfg)
        st = RequestState("r", Exchange(), "chat")
        st.principal, st.shape, st.outcome, st.backend, st.reason = Caller(), shape, o, "engine", "shape ttft"
        out[f"finish_{'on' if on else 'off'}_us"] = timed(lambda: g.finish(st, 200))
    ledger = Ledger()
    out["served_us"] = timed(lambda: ledger.served("bench", "bench", "chat", o))
    flusher = Flusher(ledger, MemoryStore())
    rows = 1000
    for i in range(rows):
        ledger.served(f"k{i}", "bench", "chat", o)
    t = time.perf_counter()
    await flusher.flush(90)
    out["flush_per_row_us"] = (time.perf_counter() - t) / rows * 1e6
    return out


def instructions(before: Path, tmp: Path, rounds: int, requests: int = 1500) -> dict[str, list[float]]:
    """Instructions per non-streamed request (callgrind, user space, one request at a time) of a gateway of each
    side, as benchmarks/path_instructions.py counts them: steady where CPU time on a shared machine is not."""
    procs: list[subprocess.Popen] = []
    out: dict[str, list[float]] = {"before": [], "after": []}
    try:
        engine = pi.start_engine("nonstream", procs)
        running = {}
        for side, src in (("before", before), ("after", kit.ROOT)):
            state = f'[state]\nbackend = "redis"\nredis_url = "{start_redis(procs)}"\n'
            cfg = kit.gateway_config(tmp / f"cg-{side}.toml", engine, access_log=False, stats=True,
                                     health=pi.QUIET_HEALTH, stats_lines=pi.QUIET_REFIT, sections=state)
            running[side] = (*pi.start_counted(src, cfg, tmp / f"cg-{side}", procs), tmp / f"cg-{side}")
        for port, _, _ in running.values():
            kit.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=600)
            pi.send(port, "nonstream", 100)
        for rnd in range(rounds):
            for side in (("before", "after") if rnd % 2 == 0 else ("after", "before")):
                port, pid, out_dir = running[side]
                idle = kit.window(pid, out_dir, lambda: time.sleep(2.0))
                busy = kit.window(pid, out_dir, lambda p=port: pi.send(p, "nonstream", requests))
                out[side].append(pi.per_request({"idle": idle, "busy": busy, "requests": requests}))
                print(json.dumps({"instructions": side, "round": rnd, "per_request": out[side][-1]}), flush=True)
    finally:
        kit.stop_all(procs)
    return out


def table(points: list[dict]) -> tuple[str, list[float], list[float]]:
    lines = ["| kind | conc | CPU/req before us | CPU/req after us | after/before (median, range) | "
             "same-side processes (median, range) | req/s before | req/s after |", "|---|---|---|---|---|---|---|---|"]
    ratios_all, controls_all = [], []
    for kind, conc in sorted({(p["kind"], p["conc"]) for p in points}, key=lambda k: (k[0] != "nonstream", k[1])):
        cpu = {(p["side"], p["proc"], p["round"]): p["cpu_per_req_us"] for p in points
               if (p["kind"], p["conc"]) == (kind, conc)}
        rounds = sorted({k[2] for k in cpu})
        side = {s: [(cpu[(s, 1, r)] + cpu[(s, 2, r)]) / 2 for r in rounds] for s in ("before", "after")}
        ratios = [a / b for a, b in zip(side["after"], side["before"])]
        ratios_all += ratios
        control = [cpu[(s, 1, r)] / cpu[(s, 2, r)] for s in ("before", "after") for r in rounds]
        controls_all += control
        rps = {s: kit.median_spread([p["rps"] for p in points if (p["kind"], p["conc"], p["side"]) == (kind, conc, s)])
               for s in ("before", "after")}
        lines.append(f"| {kind} | {conc} | {kit.pm(kit.median_spread(side['before']), '.0f')} | "
                     f"{kit.pm(kit.median_spread(side['after']), '.0f')} | {kit.span(ratios, '.3f')} | "
                     f"{kit.span(control, '.3f')} | {kit.pm(rps['before'])} | {kit.pm(rps['after'])} |")
    return "\n".join(lines), ratios_all, controls_all


REPORT = """# Usage ledger overhead

CPU per request of the gateway before the usage ledger (`{before}`, today's) and with it (the work tree at
`{commit}`: the ledger on, flushed to Redis every second; traces off), side by side in one run.

{run_line}. Before it started, others kept {busy} cores busy (waited {waited:g} s for a quieter machine).

Setup: one `benchmarks/fast_engine.py`, one redis-server started for the run, and four gateway processes, two per
side (started before, after, after, before), all with `[state] backend = "redis"` (a key prefix each), the
access log off and stats on; `wrk` drives one at a time for {seconds:g} s, {rounds} rounds per kind and
concurrency, the order rotating by one each round. CPU per request: the gateway process's user + system time from
/proc over the requests wrk completed, averaged over the two processes of a side; medians of the rounds with
their spread ((max-min)/median); after/before is the median of the per-round ratios and their range. The control
column is the ratio between the two processes of one side: what placement and noise alone produce.

{table}

Over every kind and concurrency the after/before ratios have a median of {median:.3f} (range {low:.3f}-{high:.3f});
two processes of the same code differ by {c_low:.3f} to {c_high:.3f} in single runs, the noise floor of one run here.

Instructions per non-streamed request, counted by callgrind in one gateway of each side (user space, one request
at a time on one connection, {rounds} rounds of 1,500 requests, the order alternating; benchmarks/path_instructions.py's
method, Redis state, access log off): before {i_before}, after {i_after}; after/before {i_ratio}
(median and range of the rounds). A side's count moved by up to {i_spread} between rounds: the timer-driven work of
Redis state (stats sharing, affinity sync, the ledger's flush), taken out at an idle window's rate, varies with how
long callgrind stretches each window; the per-round ratio is the steadier figure.

In process (best of 5 x 100,000 calls, plain sources as above): a request's end (`Gateway.finish`, access log
off) takes {finish_on:.2f} us with the ledger and {finish_off:.2f} us without: {added:.2f} us more, {share:.1f} % of
the {base:.0f} us CPU per non-streamed request measured above for "before" (median, both concurrencies). Of it, counting
the request (`Ledger.served`) is {served:.2f} us; a flush costs {flush:.2f} us per row, off the request path (a row
is one key, model, API and backend in a second, not one request).
"""


def in_process_words(results: dict) -> dict:
    ins = results["instructions"]
    i_before, i_after = (kit.median_spread(ins[side]) for side in ("before", "after"))
    ip = results["in_process"]
    base = statistics.median([p["cpu_per_req_us"] for p in results["points"]
                              if p["side"] == "before" and p["kind"] == "nonstream"])
    added = ip["finish_on_us"] - ip["finish_off_us"]
    return {"i_before": kit.pm(i_before, spread=".1%"), "i_after": kit.pm(i_after, spread=".1%"),
            "i_spread": f"{max(i_before[1], i_after[1]):.1%}",
            "i_ratio": kit.span([a / b for a, b in zip(ins["after"], ins["before"])], ".4f"),
            "finish_on": ip["finish_on_us"], "finish_off": ip["finish_off_us"], "added": added, "base": base,
            "share": added / base * 100, "served": ip["served_us"], "flush": ip["flush_per_row_us"]}


def render(results: dict) -> str:
    """The report of a run, from its data."""
    text, ratios, controls = table(results["points"])
    c = results["conditions"]
    quiet = c["quiet"]
    return REPORT.format(before=c["before"], commit=c["commit"], run_line=kit.run_line(c), seconds=c["seconds"],
                         rounds=c["rounds"], busy=quiet["busy_cores"], waited=quiet["waited_s"], table=text,
                         median=statistics.median(ratios), low=min(ratios), high=max(ratios), c_low=min(controls),
                         c_high=max(controls), **in_process_words(results))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--kinds", nargs="+", default=["nonstream", "stream"])
    p.add_argument("--baseline", help="the revision of today's gateway (default: where this branch left main)")
    p.add_argument("--out", default=str(kit.RESULTS / "usage_overhead"))
    p.add_argument("--render", action="store_true", help="only write OUT.md again from OUT.json")
    args = p.parse_args()
    if args.render:
        print(kit.render_again(Path(args.out), render))
        return 0
    quiet = kit.wait_quiet(120)  # other jobs on the machine: wait a while for them to leave the cores, and say so
    prov = kit.provenance()
    results: dict = {"conditions": {**prov, "seconds": args.seconds, "rounds": args.rounds, "cpus": os.cpu_count(),
                                    "concurrency": args.concurrency, "kinds": args.kinds, "wrk": kit.wrk_version(),
                                    "command": kit.command("benchmarks.usage_overhead"),
                                    "quiet": quiet}}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            before = tmp / "before"
            results["conditions"]["before"] = kit.export_revision(args.baseline or baseline_ref(), before)
            gws = start_stack(tmp, before, procs)
            results["points"] = drive(args, gws, kit.wrk_script(tmp))
        finally:
            kit.stop_all(procs)
        results["instructions"] = instructions(before, tmp, args.rounds)
    results["conditions"]["load_after"] = os.getloadavg()
    results["in_process"] = in_process()
    report = render(results)
    print(report)
    kit.write_result(Path(args.out), results, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
