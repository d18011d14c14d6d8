"""Where the c=64 tail comes from: the same wrk load through two gateways, start-up heap frozen or not, in one run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks import kit

TARGETS = ("frozen", "unfrozen")


def delta(after: dict, before: dict) -> dict:
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    lag_n = d.get("shapegate_event_loop_lag_seconds_count", 0.0)
    over_10ms = lag_n - d.get('shapegate_event_loop_lag_seconds_bucket{le="0.01"}', 0.0)
    return {"gen2_collections": d.get('shapegate_gc_pause_seconds_count{generation="2"}', 0.0),
            "gen2_pause_ms": 1000 * d.get('shapegate_gc_pause_seconds_sum{generation="2"}', 0.0),
            "gc_pause_ms": 1000 * sum(v for k, v in d.items() if k.startswith("shapegate_gc_pause_seconds_sum")),
            "lag_samples": lag_n, "lag_over_10ms": over_10ms,
            "lag_mean_ms": 1000 * d.get("shapegate_event_loop_lag_seconds_sum", 0.0) / lag_n if lag_n else None}


def measure(args) -> dict:
    cond = {**kit.provenance(), "command": kit.command("benchmarks.loop_tail"),
            "seconds": args.seconds, "repeats": args.repeats, "concurrency": 64}
    points = []
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        script = kit.wrk_script(tmp)
        try:
            engine = kit.start_engine(procs)
            gateways = {}
            for name in TARGETS:
                cfg = kit.gateway_config(tmp / f"{name}.toml", engine,
                                         server=f"gc_freeze = {str(name == 'frozen').lower()}")
                base, p = kit.start_gateway(cfg, procs, **kit.QUIET)
                gateways[name] = (base, p.pid)
            for name, (base, _) in gateways.items():  # warm-up: imports, connections, caches
                kit.run_wrk(base + "/v1/chat/completions", kit.BODIES["nonstream"], 4, 1.0, script)
            for kind in args.kinds:
                for rep in range(args.repeats):
                    order = TARGETS if rep % 2 == 0 else TARGETS[::-1]
                    for name in order:
                        base, pid = gateways[name]
                        f0, c0 = kit.loop_figures(base), kit.cpu_seconds(pid)
                        r = kit.run_wrk(base + "/v1/chat/completions", kit.BODIES[kind], 64, args.seconds, script)
                        cpu = kit.cpu_seconds(pid) - c0
                        r.update(delta(kit.loop_figures(base), f0), target=name, kind=kind, rep=rep,
                                 rps=r["requests"] / (r["duration_us"] / 1e6),
                                 cpu_per_req_us=cpu / r["requests"] * 1e6 if r["requests"] else None)
                        points.append(r)
                        print(json.dumps(r), flush=True)
        finally:
            kit.stop_all(procs)
    cond["load_after"] = os.getloadavg()
    return {"conditions": cond, "points": points}


def markdown(data: dict) -> str:
    c = data["conditions"]
    lines = ["# Where the c=64 tail comes from: the start-up heap in garbage collection", "",
             kit.run_line(c) + ".", "",
             f"wrk at c=64 for {c['seconds']:g} s per point, {c['repeats']} rounds, the two gateways' order "
             "alternating, against `benchmarks/fast_engine.py` (zero delay). Both gateways run this tree with "
             "the same config but for `[server] gc_freeze`. GC pauses and loop lag are the gateway's own "
             "`shapegate_gc_pause_seconds` and `shapegate_event_loop_lag_seconds` over the point. Medians of the "
             "rounds, ± = (max-min)/median.", "",
             "| kind | target | p50 us | p99 us | req/s | CPU/req us | full collections | their pause ms | "
             "all GC pause ms | loop lag > 10 ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    by: dict[tuple[str, str], list[dict]] = {}
    for p in data["points"]:
        by.setdefault((p["kind"], p["target"]), []).append(p)
    reading = []
    for kind in dict.fromkeys(p["kind"] for p in data["points"]):
        row = {}
        for name in TARGETS:
            ps = by.get((kind, name), [])
            if not ps:
                continue
            f = {k: kit.median_spread([p[k] for p in ps])
                 for k in ("p50", "p99", "rps", "cpu_per_req_us", "gen2_collections", "gen2_pause_ms", "gc_pause_ms",
                           "lag_over_10ms")}
            row[name] = f
            lines.append(f"| {kind} | {name} | {kit.pm(f['p50'])} | {kit.pm(f['p99'])} | {kit.pm(f['rps'])} | "
                         f"{f['cpu_per_req_us'][0]:,.0f} | {f['gen2_collections'][0]:.0f} | "
                         f"{f['gen2_pause_ms'][0]:,.1f} | {f['gc_pause_ms'][0]:,.1f} | {f['lag_over_10ms'][0]:.0f} |")
        if len(row) == 2:
            fr, un = row["frozen"], row["unfrozen"]
            pairs = [(p_f, p_u) for p_f in by[(kind, "frozen")] for p_u in by[(kind, "unfrozen")]
                     if p_f["rep"] == p_u["rep"]]
            ratios = sorted(a["p99"] / b["p99"] for a, b in pairs if b["p99"])
            per_collection = (un["gen2_pause_ms"][0] / un["gen2_collections"][0]
                              if un["gen2_collections"][0] else None)
            per_frozen = fr["gen2_pause_ms"][0] / fr["gen2_collections"][0] if fr["gen2_collections"][0] else None
            reading.append(
                f"- {kind}: p99 {un['p99'][0]:,.0f} us unfrozen, {fr['p99'][0]:,.0f} us frozen (frozen/unfrozen per "
                f"round {', '.join(f'{x:.2f}' for x in ratios)}); a full collection held the loop "
                + (f"{per_collection:.1f} ms" if per_collection is not None else "(none ran)") + " unfrozen, "
                + (f"{per_frozen:.2f} ms" if per_frozen is not None else "(none ran)") + " frozen; req/s "
                f"{un['rps'][0]:,.0f} unfrozen, {fr['rps'][0]:,.0f} frozen.")
    return "\n".join(lines + ["", "## Reading", "", *reading, ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=["nonstream", "stream"], choices=sorted(kit.BODIES))
    ap.add_argument("--render", action="store_true", help="re-render the .md from the saved .json")
    args = ap.parse_args()
    kit.save_and_render("loop_tail", None if args.render else measure(args), markdown)


if __name__ == "__main__":
    main()
