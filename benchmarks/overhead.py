"""What the gateway adds: the same wrk load direct to an engine, through the gateway (and a baseline's), in one run."""

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
from benchmarks.overhead_report import markdown


def start_gateway(src: Path, cfg: Path, log: Path, procs: list) -> tuple[str, int]:
    """A gateway that imports only from the source tree src (PYTHONPATH), started the same way for either tree; one
    that does not get ready stops the run with the end of its log."""
    with log.open("wb") as err:
        try:
            base, gw = kit.start_gateway(cfg, procs, tree=src, stdout=subprocess.DEVNULL, stderr=err)
        except TimeoutError:
            raise SystemExit(f"the gateway from {src} did not get ready (exit code {procs[-1].poll()}):\n"
                             f"{log.read_text()[-3000:]}") from None
    return base, gw.pid


def start_stack(tmp: Path, baseline: Path | None, procs: list) -> dict:
    """Engine, one gateway per source tree (same config file) and the floor proxy; target -> (url, pid)."""
    engine = kit.start_engine(procs)
    cfg = kit.gateway_config(tmp / "bench.toml", engine, access_log=True, stats=True)
    targets = {"direct": (engine, None)}
    for name, src in ({"before": baseline, "after": kit.ROOT} if baseline else {"gateway": kit.ROOT}).items():
        targets[name] = start_gateway(src, cfg, tmp / f"{name}.log", procs)
    floor = f"http://127.0.0.1:{kit.free_port()}"
    proc = kit.start(kit.script("floor_proxy.py", "--port", floor.rsplit(":", 1)[1], "--upstream", engine), procs,
                     floor + "/readyz", stderr=subprocess.DEVNULL)
    targets["floor"] = (floor, proc.pid)
    return targets


def drive(args, targets: dict, script: str) -> list[dict]:
    """Each (kind, conc, repeat) drives all targets in turn; the gateways' order rotates between repeats, so
    neither always runs first (right after direct, on a machine in the same state)."""
    proxies = [t for t in targets if t != "direct"]
    for t in proxies:  # the first requests pay for imports, connections and caches: warm each proxy first
        for kind in args.kinds:
            kit.run_wrk(targets[t][0] + "/v1/chat/completions", kit.BODIES[kind], 4, 1.0, script)
    gateways = [t for t in proxies if t != "floor"]
    points = []
    for kind in args.kinds:
        for conc in args.concurrency:
            for rep in range(args.repeats):
                turn = rep % len(gateways)
                for pos, target in enumerate(["direct", *gateways[turn:], *gateways[:turn], "floor"]):
                    base, pid = targets[target]
                    c0 = kit.cpu_seconds(pid) if pid else 0.0
                    r = kit.run_wrk(base + "/v1/chat/completions", kit.BODIES[kind], conc, args.seconds, script)
                    cpu = (kit.cpu_seconds(pid) - c0) if pid else 0.0
                    r.update(kind=kind, conc=conc, rep=rep, target=target, position=pos,
                             rps=r["requests"] / (r["duration_us"] / 1e6),
                             cpu_per_req_us=(cpu / r["requests"] * 1e6) if pid else None)
                    points.append(r)
                    print(json.dumps(r), flush=True)
    return points


def conditions(args) -> dict:
    """What the run depends on, taken before it starts (the run itself writes into the tree)."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "head": kit.commit(),
            "dirty_paths": len(kit.changed_paths()),
            "dirty_gateway_paths": len(kit.changed_paths("gateway", "backends", "policies")),
            "baseline_ref": args.baseline, "baseline_rev": None, "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg(), "seconds": args.seconds, "repeats": args.repeats,
            "concurrency": args.concurrency, "kinds": args.kinds, "python": sys.version.split()[0],
            "wrk": kit.wrk_version(), "engine": "benchmarks/fast_engine.py",
            "stream_chunks": 200, "warmup": "1 s of wrk per kind at c=4 per proxy"}


def measure(args) -> dict:
    results: dict = {"conditions": conditions(args), "points": []}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        script = kit.wrk_script(tmp)
        try:
            baseline = None
            if args.baseline:
                baseline = tmp / "baseline"
                results["conditions"]["baseline_rev"] = kit.export_revision(args.baseline, baseline)
            results["points"] = drive(args, start_stack(tmp, baseline, procs), script)
        finally:
            kit.stop_all(procs)
    results["conditions"]["loadavg_after"] = os.getloadavg()
    return results


def stats_gateway(tmp: Path, engine_url: str, stats: bool, procs: list) -> tuple[subprocess.Popen, str]:
    """A gateway with [stats] on or off and no access log, so the two differ in stats upkeep only."""
    cfg = kit.gateway_config(tmp / f"stats-{'on' if stats else 'off'}.toml", engine_url, access_log=False,
                             stats=stats)
    base, gw = kit.start_gateway(cfg, procs, **kit.QUIET)
    return gw, base


# Two gateway processes per setting, started on/off/off/on: a process's own placement (start order, memory,
# ports) can cost it a few percent, which shows up as the difference between the two processes of one setting.
SLOTS = (("on", 1), ("off", 1), ("off", 2), ("on", 2))


def stats_compare(args) -> dict:
    """Stats upkeep on vs off: four gateways (two each) on one engine, driven in turn, the order rotating."""
    results: dict = {"points": [], "loadavg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        script = kit.wrk_script(tmp)
        procs: list[subprocess.Popen] = []
        try:
            engine = kit.start_engine(procs)
            gws = {}
            for slot in SLOTS:
                gw, url = stats_gateway(tmp, engine, slot[0] == "on", procs)
                gws[slot] = (gw.pid, url + "/v1/chat/completions")
            for slot in SLOTS:  # warm all before measuring any
                for kind in args.kinds:
                    kit.run_wrk(gws[slot][1], kit.BODIES[kind], 4, 1.0, script)
            for kind in args.kinds:
                for conc in args.concurrency:
                    for rep in range(args.repeats):
                        for i in range(len(SLOTS)):
                            slot = SLOTS[(i + rep) % len(SLOTS)]
                            pid, url = gws[slot]
                            c0 = kit.cpu_seconds(pid)
                            r = kit.run_wrk(url, kit.BODIES[kind], conc, args.seconds, script)
                            cpu = kit.cpu_seconds(pid) - c0
                            r.update(kind=kind, conc=conc, rep=rep, stats=slot[0], proc=slot[1],
                                     rps=r["requests"] / (r["duration_us"] / 1e6),
                                     cpu_per_req_us=cpu / r["requests"] * 1e6)
                            results["points"].append(r)
                            print(json.dumps(r), flush=True)
        finally:
            kit.stop_all(procs)
    results["loadavg_after"] = os.getloadavg()
    results["record_stage"] = record_stage_cost()
    return results


def record_stage_cost(n: int = 20_000, repeats: int = 5) -> dict:
    """In process, microseconds per request of what the switch turns off: the record stage (Gateway.record)
    plus the next routing snapshot (BackendView, which re-solves the latency model after a new sample);
    with stats on, also each part alone. Minimum over `repeats` runs of `n` calls (the least disturbed)."""
    return asyncio.run(_record_stage_cost(n, repeats))


async def _record_stage_cost(n: int, repeats: int) -> dict:
    import aiohttp

    from gateway.config import parse_config
    from gateway.contracts import Outcome, RequestShape
    from gateway.runtime import Gateway, build_policy

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t) / n * 1e6)
        return best

    out: dict = {}
    for enabled in (True, False):
        cfg = parse_config({"auth": {"enabled": False}, "stats": {"enabled": enabled, "warmup_samples": 0},
                            "backends": [{"id": "e", "engine": "openai", "url": "http://127.0.0.1:9",
                                          "models": ["bench"]}]}, build_policy)
        async with aiohttp.ClientSession() as session:  # (an engine adapter is made on the client session)
            g = Gateway(cfg, session)
            b = g.make_backend(cfg.backends[0])
        g.pool.add(b)  # (nothing below sends a request)
        for kind, stream in (("nonstream", False), ("stream", True)):
            shape = RequestShape("bench", "chat", stream, 8, 200, "default")
            o = Outcome("e", shape, True, 200, ttft=0.002 if stream else None, itl=0.0001 if stream else None,
                        e2e=0.03, prompt_tokens=8, completion_tokens=200)

            def path() -> None:
                g.record(b, shape, o, 0.0, 0.0001)
                b.view(time.monotonic())

            out[f"{kind}:{'on' if enabled else 'off'}"] = timed(path)
            if enabled:
                m = g.metrics
                out[f"{kind}:learn"] = timed(lambda: b.latency.learn(o, time.monotonic(), ready_since=0.0))
                learn_and_solve = timed(lambda: (b.latency.learn(o, time.monotonic(), ready_since=0.0),
                                                 b.latency.estimate()))
                out[f"{kind}:re-solve"] = learn_and_solve - out[f"{kind}:learn"]
                out[f"{kind}:rolling samples"] = timed(lambda: b.stats.add(o, time.monotonic()))
                out[f"{kind}:histograms"] = (timed(lambda: m.observe("e", "bench", "default", 200, o.ttft, o.itl,
                                                                     0.03, 8, 200, 0.0001))
                                             - timed(lambda: m.count("e", "bench", "default", 200, 8, 200)))
    return out


def summarize_stats(results: dict) -> str:
    pts = results["points"]
    lines = ["| kind | conc | CPU/req on us | CPU/req off us | on/off (median, range) | same-setting processes "
             "(median, range) | req/s on | req/s off |", "|---|---|---|---|---|---|---|---|"]
    for kind, conc in sorted({(p["kind"], p["conc"]) for p in pts}, key=lambda k: (k[0] != "nonstream", k[1])):
        cpu = {(p["stats"], p["proc"], p["rep"]): p["cpu_per_req_us"] for p in pts
               if (p["kind"], p["conc"]) == (kind, conc)}
        reps = sorted({k[2] for k in cpu})
        both = {v: [(cpu[(v, 1, r)] + cpu[(v, 2, r)]) / 2 for r in reps] for v in ("on", "off")}
        ratios = [a / b for a, b in zip(both["on"], both["off"])]
        # The control: two processes with the same setting, on/off slots' own difference.
        control = [cpu[(v, 1, r)] / cpu[(v, 2, r)] for v in ("on", "off") for r in reps]
        rps = {v: kit.median_spread([p["rps"] for p in pts if (p["kind"], p["conc"], p["stats"]) == (kind, conc, v)])
               for v in ("on", "off")}
        lines.append(f"| {kind} | {conc} | {kit.pm(kit.median_spread(both['on']), '.0f')} | "
                     f"{kit.pm(kit.median_spread(both['off']), '.0f')} | {kit.span(ratios, '.3f')} | "
                     f"{kit.span(control, '.3f')} | {kit.pm(rps['on'])} | {kit.pm(rps['off'])} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--kinds", nargs="+", default=["nonstream", "stream"])
    p.add_argument("--out", default=str(kit.RESULTS / "overhead"))
    p.add_argument("--baseline", metavar="REF", help="a git revision whose gateway runs beside the work tree's "
                   "(before / after); bc28cc9 or later, older config models lack [stats] enabled")
    p.add_argument("--stats-compare", action="store_true",
                   help="stats upkeep on vs off, side by side; writes results/stats_overhead.{md,json}")
    p.add_argument("--render", action="store_true", help="only write OUT.md again from OUT.json")
    args = p.parse_args()
    if args.stats_compare:
        return write_stats_compare(args)
    out = Path(args.out)
    if args.render:
        kit.render_again(out, markdown)
        return 0
    results = measure(args)
    report = markdown(results)
    print(report)
    kit.write_result(out, results, report)
    return 0


def write_stats_compare(args) -> int:
    results = stats_compare(args)
    results["conditions"] = {"seconds": args.seconds, "repeats": args.repeats, "cpus": os.cpu_count(),
                             "concurrency": args.concurrency, "kinds": args.kinds,
                             "date": time.strftime("%Y-%m-%d %H:%M")}
    table = summarize_stats(results)
    rec = results["record_stage"]
    parts = ["| per request, in process (us) | nonstream | stream |", "|---|---|---|"]
    for name in ("off", "on", "learn", "re-solve", "rolling samples", "histograms"):
        label = {"off": "record + next routing snapshot, stats off", "on": "same, stats on",
                 "learn": "of which: latency-model learn", "re-solve": "of which: latency-model re-solve",
                 "rolling samples": "of which: rolling samples (/stats)",
                 "histograms": "of which: latency histograms (/metrics)"}[name]
        parts.append(f"| {label} | {rec['nonstream:' + name]:.1f} | {rec['stream:' + name]:.1f} |")
    pts = results["points"]
    for kind in ("nonstream", "stream"):
        off = [p["cpu_per_req_us"] for p in pts if p["kind"] == kind and p["stats"] == "off"]
        if not off:
            continue
        base = statistics.median(off)
        added = rec[f"{kind}:on"] - rec[f"{kind}:off"]
        model = rec[f"{kind}:learn"] + rec[f"{kind}:re-solve"]
        parts.append(f"\n{kind}: stats upkeep {added:.1f} us per request = {added / base * 100:.1f} % of the "
                     f"gateway's {base:.0f} us CPU per request (median, stats off, all concurrencies); the latency "
                     f"model's learn + re-solve is {model:.1f} us of it ({model / base * 100:.1f} %), rolling "
                     f"samples + histograms {added - model:.1f} us ({(added - model) / base * 100:.1f} %).")
    print(table + "\n\n" + "\n".join(parts))
    kit.write_result(kit.RESULTS / "stats_overhead", results, STATS_MD.format(
        repeats=args.repeats, seconds=args.seconds, cpus=os.cpu_count(), table=table, parts="\n".join(parts),
        reading=reading(table),
        before=" / ".join(f"{x:.2f}" for x in results["loadavg_before"]),
        after=" / ".join(f"{x:.2f}" for x in results["loadavg_after"]), date=results["conditions"]["date"]))
    return 0


def reading(table: str) -> str:
    """One sentence on what the end-to-end table can resolve, from its own numbers."""
    rows = [r.split("|") for r in table.splitlines()[2:]]
    ratio = [float(r[5].split()[0]) for r in rows]
    control = [float(x) for r in rows for x in r[6].split("(")[1].rstrip(") ").split("-")]
    return (f"Reading: the on/off medians lie between {min(ratio):.3f} and {max(ratio):.3f}; two processes with the "
            f"same setting differ by {min(control):.3f} to {max(control):.3f} in single runs. A difference smaller "
            f"than that spread is not resolved end to end on this machine; the in-process figures below are.")


STATS_MD = """# Stats upkeep overhead

What `[stats] enabled = true` costs per request: latency-model learning (and the re-solve it triggers at the
next routing decision), rolling samples for /stats and the dashboard, and the TTFT/ITL/e2e/overhead histograms
(request and token counters stay on in both).

## End to end

Four gateway processes, two with stats on and two off (started on, off, off, on), all without access log,
in front of one `benchmarks/fast_engine.py`; `wrk` drives them one at a time, the order rotating per repeat.
CPU per request is the gateway process's user+system time from /proc over the requests wrk completed,
averaged over the two processes of a setting. Medians of {repeats} runs of {seconds:g} s; spread =
(max-min)/median; on/off is the median of the per-repeat ratios and their range. The control column is
the same ratio between the two processes of one setting: what placement and noise alone produce, the
floor below which an on/off difference means nothing.

Conditions: {date}, {cpus} cores shared by wrk, the four gateways and the engine, on a machine other jobs
were using at the same time (load average before / after: {before} → {after}).

{table}

{reading}

## Where it goes

The same switch timed in process, on one backend, best of 5 x 20,000 calls (so scheduling noise is left out).
A hot loop keeps code and data in cache; inside a busy server the same work costs more (the caches are shared
with wrk, the engine and the other gateways), so read these as a lower bound.

{parts}
"""


if __name__ == "__main__":
    sys.exit(main())
