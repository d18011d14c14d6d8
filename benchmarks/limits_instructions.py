"""What local rate limits cost a gateway per request, counted in CPU instructions (callgrind), steady on a busy machine."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import kit
from benchmarks.limits import TARGET_CPU_US, gateway_config

# Why instructions: per-request CPU time of one gateway on this machine kind moves by 5-30 % from run to run
# (a shared virtual machine), while the limiter adds a few percent; callgrind counts the instructions the
# process executes, the same for the same work whatever else the machine does. Native CPU time per request is
# measured beside it, and turns the added instructions into microseconds at this gateway's own rate.


def config(path: Path, engine: str, limits: bool) -> None:
    # Probes an hour apart: after the first (at start) none falls inside a counted window.
    gateway_config(path, engine, limits, False, "",
                   health="interval_s = 3600\nload_interval_s = 3600\nload_stale_s = 7200\n")


def send(port: int, n: int) -> None:
    """n non-streamed requests one after another on one keep-alive connection, each checked."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = kit.BODIES["nonstream"].encode()
    headers = {"Authorization": f"Bearer {kit.KEY}", "Content-Type": "application/json"}
    try:
        for _ in range(n):
            conn.request("POST", "/v1/chat/completions", body, headers)
            r = conn.getresponse()
            r.read()
            assert r.status == 200, r.status
    finally:
        conn.close()


def counted(args, tmp: Path, engine: str) -> tuple[list[dict], list[dict]]:
    """One gateway under callgrind, its [limits] switched by reloads; instructions per request of each phase."""
    cfg, port = tmp / "counted.toml", kit.free_port()
    config(cfg, engine, False)
    out_dir = tmp / "cg"
    out_dir.mkdir()
    p = subprocess.Popen([*kit.callgrind_argv(out_dir), *kit.serve_argv(cfg, port)], cwd=kit.ROOT, **kit.QUIET)
    points: list[dict] = []
    idles: list[dict] = []
    try:
        kit.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=300)
        send(port, args.warm)
        for rnd in range(args.rounds):
            # The gateway's timers (loop-lag probe, connection sweeps) run by wall time, and callgrind stretches each
            # counted window differently: their rate, counted with no request in flight, is taken out of each window.
            w = kit.window(p.pid, out_dir, lambda: time.sleep(args.idle))
            idle = {"round": rnd, "idle_s": w["wall_s"], "instructions": w["instructions"]}
            idles.append(idle)
            print(json.dumps(idle), flush=True)
            for limits in ((False, True) if rnd % 2 == 0 else (True, False)):
                config(cfg, engine, limits)
                kit.admin_reload(f"http://127.0.0.1:{port}")
                send(port, args.warm)  # the new plan, caches and buckets made before the count starts
                before = set(out_dir.glob("callgrind.out*"))
                w = kit.window(p.pid, out_dir, lambda: send(port, args.requests))
                total, wall_s = w["instructions"], w["wall_s"]
                if args.keep:  # for callgrind_annotate: where the instructions went
                    Path(args.keep).mkdir(parents=True, exist_ok=True)
                    for path in set(out_dir.glob("callgrind.out*")) - before:
                        shutil.copy(path, Path(args.keep) / f"{'on' if limits else 'off'}-{rnd}-{path.name}")
                point = {"round": rnd, "limits": limits, "instructions": total, "wall_s": wall_s,
                         "instructions_per_request": total / args.requests}
                points.append(point)
                print(json.dumps(point), flush=True)
    finally:
        kit.stop_all([p], timeout=60)
    return points, idles


def native(args, tmp: Path, engine: str) -> list[dict]:
    """CPU microseconds per request (user space, and user+system) of the same gateway without callgrind, limits
    off, the same client."""
    cfg = tmp / "native.toml"
    config(cfg, engine, False)
    procs: list[subprocess.Popen] = []
    out = []
    try:
        base, p = kit.start_gateway(cfg, procs, **kit.QUIET)
        port = int(base.rsplit(":", 1)[1])
        send(port, args.warm * 10)
        for _ in range(args.rounds):
            # user time: what the instructions callgrind counts run in (not the kernel's socket work, which
            # limits do not change)
            c0, u0 = kit.cpu_seconds(p.pid), kit.cpu_times(p.pid)[0]
            send(port, args.native_requests)
            out.append({"cpu_us": (kit.cpu_seconds(p.pid) - c0) / args.native_requests * 1e6,
                        "user_us": (kit.cpu_times(p.pid)[0] - u0) / args.native_requests * 1e6})
    finally:
        kit.stop_all(procs, timeout=30)
    return out


def markdown(res: dict) -> str:
    c = res["conditions"]
    n = c["requests"]
    idle_rates = [i["instructions"] / i["idle_s"] for i in res["idle"]]
    idle_rate = statistics.median(idle_rates)  # instructions per second of the gateway's timers, no request in flight

    def per_request(p: dict) -> float:  # the window's instructions without its timers' share
        return (p["instructions"] - idle_rate * p["wall_s"]) / n

    by = {(p["round"], p["limits"]): p for p in res["points"]}
    rounds = sorted({p["round"] for p in res["points"]})
    off = [per_request(by[(r, False)]) for r in rounds]
    on = [per_request(by[(r, True)]) for r in rounds]
    raw_added = [by[(r, True)]["instructions_per_request"] - by[(r, False)]["instructions_per_request"] for r in rounds]
    added = [b - a for a, b in zip(off, on)]
    cpu = [x["cpu_us"] for x in res["native"]]
    user = [x["user_us"] for x in res["native"]]
    ns_per_instr = statistics.median(user) * 1000 / statistics.median(off)
    added_us = [a * ns_per_instr / 1000 for a in added]
    verdict = "meets" if max(added_us) < TARGET_CPU_US else "misses"
    walls = [p["wall_s"] for p in res["points"]]
    rows = "\n".join(
        f"| {r} | {a:,.0f} | {b:,.0f} | {b - a:+,.0f} ({(b - a) / a * 100:+.1f} %) | {(b - a) * ns_per_instr / 1000:+.1f} | "
        f"{raw:+,.0f} |" for r, a, b, raw in zip(rounds, off, on, raw_added))
    return f"""# Rate limits: CPU per request, counted in instructions

`{c['command']}`

One gateway process runs under `valgrind --tool=callgrind` in front of `benchmarks/fast_engine.py` (a zero-delay
engine); its `[limits]` are switched off and on by a configuration reload (limits so high that every request is
checked and charged and none is refused; order alternating by round). In each phase, after {c['warm']} requests
to warm the new plan, callgrind's counters are zeroed, {n:,} non-streamed requests are sent one after
another on one keep-alive connection, and the instructions the gateway process executed meanwhile are read.
Instruction counts do not depend on how busy the machine is, as CPU time per request does (on this machine kind it
moves by 5-30 % between runs, more than what the limits add). What still moves them is the gateway's timer-driven
work (the loop-lag probe, connection sweeps), which runs by wall time, and callgrind stretches each window
differently ({min(walls):.1f}-{max(walls):.1f} s here): each round also counts an idle window of {c['idle_s']:g} s, and
the median idle rate ({idle_rate:,.0f} instructions/s; rounds {', '.join(f'{x:,.0f}' for x in idle_rates)}) times each
window's wall time is taken out of it. The last column shows the difference without that correction. To put the
added instructions in microseconds, the same gateway without callgrind and with limits off served
{c['native_requests']:,} requests per round from the same client, {c['rounds']} rounds, its CPU time read from /proc.

Conditions: commit {c['commit']} ({len(c['dirty_paths'])} paths changed in the work tree), {c['date']},
{c['machine']}; load average before {' / '.join(f'{x:.2f}' for x in c['load_before'])},
after {' / '.join(f'{x:.2f}' for x in c['load_after'])}.

| round | instructions / request, limits off | limits on | added | added, us at this gateway's rate | added, uncorrected |
|---|---|---|---|---|---|
{rows}

Native CPU per request, limits off: {statistics.median(cpu):.0f} us user+system (rounds: {', '.join(f'{x:.0f}' for x in cpu)}), of
which {statistics.median(user):.0f} us in user space (rounds: {', '.join(f'{x:.0f}' for x in user)}), the part callgrind counts: {ns_per_instr:.3f} ns per
instruction of this gateway. The limiter's work is all in user space, so its added instructions are priced at
that rate (the kernel's part of a request, its socket reads and writes, is the same with limits on: one more
header line or six changes no syscall).

## Against the target

Local limits, under {TARGET_CPU_US:g} us of CPU per request: {statistics.median(added_us):+.1f} us (median of the
rounds; range {min(added_us):+.1f}..{max(added_us):+.1f}), {statistics.median(added):+,.0f} instructions
({statistics.median(added) / statistics.median(off) * 100:+.1f} % of a request): it {verdict} the target
({"every round under it" if verdict == "meets" else "not every round under it"}). The price of an instruction moves
with the machine too: at the rates of the fastest and the slowest native round ({min(user) * 1000 / statistics.median(off):.3f}-{max(user) * 1000 / statistics.median(off):.3f} ns) the
median round's instructions cost {statistics.median(added) * min(user) / statistics.median(off):.1f}-{statistics.median(added) * max(user) / statistics.median(off):.1f} us.
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--native-requests", type=int, default=20000)
    ap.add_argument("--warm", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)  # a round moves by a few thousand instructions: 5, not 3
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of each round's idle window")
    ap.add_argument("--out", default=str(kit.RESULTS / "limits_instructions"))
    ap.add_argument("--keep", help="copy callgrind's dumps of the counted phases into this directory")
    ap.add_argument("--from-json", help="re-render the report from a saved result instead of measuring")
    args = ap.parse_args()
    if args.from_json:
        report = markdown(json.loads(Path(args.from_json).read_text()))
        Path(args.out).with_suffix(".md").write_text(report)
        print(report)
        return 0
    conditions = {**kit.provenance(), "command": kit.command("benchmarks.limits_instructions"),
                  "requests": args.requests, "native_requests": args.native_requests, "warm": args.warm,
                  "rounds": args.rounds, "idle_s": args.idle}
    procs: list[subprocess.Popen] = []
    try:
        engine = kit.start_engine(procs, **kit.QUIET)
        with tempfile.TemporaryDirectory() as d:
            points, idles = counted(args, Path(d), engine)
            cpu = native(args, Path(d), engine)
    finally:
        kit.stop_all(procs)
    conditions["load_after"] = os.getloadavg()
    res = {"conditions": conditions, "points": points, "idle": idles, "native": cpu}
    report = markdown(res)
    print(report)
    kit.write_result(Path(args.out), res, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
