"""What per-key rate limits cost: CPU per request and added latency with limits off, local and in Redis, one run."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from benchmarks import kit

REDIS_URL = "redis://127.0.0.1:6379/0"
# Limits no request of the run comes near: every request is checked and charged, none is refused.
LIMITS = "[limits]\nrpm = 1000000000\ntpm = 1000000000000\n"
# name -> (limits on, state in Redis). redis_off isolates what Redis state costs without limits (stats sharing);
# control is a second process exactly like `off`: how far two identical processes differ on this machine.
TARGETS = {"off": (False, False), "local": (True, False), "redis_off": (False, True), "redis": (True, True),
           "control": (False, False)}
BASE = {"local": "off", "redis": "redis_off", "control": "off", "switch:local": "switch:off"}
SWITCH = ("switch:off", "switch:local")  # one more process, its [limits] switched by reloads between runs
TARGET_CPU_US, TARGET_P50_MS = 10.0, 0.3


def gateway_config(path: Path, engine: str, limits: bool, redis: bool, prefix: str, health: str = "") -> Path:
    """The admin key (reloads), no access log, no [stats] section; limits and state in Redis as asked."""
    state = f'[state]\nbackend = "redis"\nredis_url = "{REDIS_URL}"\nkey_prefix = "{prefix}"\n' if redis else ""
    return kit.gateway_config(path, engine, access_log=False, stats=None, admin=True, health=health,
                              sections=(LIMITS if limits else "") + state)


def drive(args, tmp: Path, prefix: str) -> list[dict]:
    procs: list[subprocess.Popen] = []
    script = kit.wrk_script(tmp)
    try:
        engine = kit.start_engine(procs, **kit.QUIET)
        gws = {}
        for name, (limits, redis) in TARGETS.items():
            cfg = gateway_config(tmp / f"{name}.toml", engine, limits, redis, prefix)
            base, p = kit.start_gateway(cfg, procs, **kit.QUIET)
            gws[name] = (p.pid, base + "/v1/chat/completions")
        for _, url in gws.values():  # imports, connections, caches: warm every gateway before measuring any
            kit.run_wrk(url, kit.BODIES["nonstream"], 4, 1.0, script)
        points = []
        names = list(TARGETS)
        for conc in args.concurrency:
            for rnd in range(args.rounds):
                for i in range(len(names)):
                    name = names[(i + rnd) % len(names)]  # the order rotates: no target always goes first
                    pid, url = gws[name]
                    c0 = kit.cpu_seconds(pid)
                    r = kit.run_wrk(url, kit.BODIES["nonstream"], conc, args.seconds, script)
                    r.update(target=name, conc=conc, round=rnd,
                             cpu_per_req_us=(kit.cpu_seconds(pid) - c0) / max(r["requests"], 1) * 1e6)
                    points.append(r)
                    print(json.dumps(r), flush=True)
        points += same_process(args, tmp, engine, script, procs)
        return points
    finally:
        kit.stop_all(procs)


def same_process(args, tmp: Path, engine: str, script: str, procs: list) -> list[dict]:
    """One more gateway whose [limits] are switched on and off by a configuration reload between runs: the
    comparison without the difference two processes have anyway (placement, memory layout)."""
    cfg = gateway_config(tmp / "switch.toml", engine, False, False, "")
    base, gw = kit.start_gateway(cfg, procs, **kit.QUIET)
    pid = gw.pid
    kit.run_wrk(base + "/v1/chat/completions", kit.BODIES["nonstream"], 4, 1.0, script)
    points = []
    for conc in args.concurrency:
        for rnd in range(args.rounds):
            for limits in ((False, True) if rnd % 2 == 0 else (True, False)):
                gateway_config(cfg, engine, limits, False, "")
                kit.admin_reload(base)
                c0 = kit.cpu_seconds(pid)
                r = kit.run_wrk(base + "/v1/chat/completions", kit.BODIES["nonstream"], conc, args.seconds, script)
                r.update(target="switch:local" if limits else "switch:off", conc=conc, round=rnd,
                         cpu_per_req_us=(kit.cpu_seconds(pid) - c0) / max(r["requests"], 1) * 1e6)
                points.append(r)
                print(json.dumps(r), flush=True)
    return points


async def in_process(n: int, repeats: int, prefix: str) -> dict:
    """Microseconds per request of the limiter alone (plan, reserve, headers, settle), best of `repeats` runs of
    `n`: local buckets, and the Redis script over the loopback at one request at a time (a round trip each)."""
    from gateway.config import LimitsConfig, StateConfig
    from gateway.keys.principal import Principal
    from gateway.limits.limiter import Limiter
    from gateway.limits.redis_buckets import SharedBuckets
    from gateway.observe.metrics import Metrics
    from gateway.routing.request import RequestState

    cfg = LimitsConfig(rpm=10**9, tpm=10**12)
    who = Principal("bench", admin=False)
    shared = SharedBuckets(StateConfig(backend="redis", redis_url=REDIS_URL, key_prefix=prefix), Metrics(list))
    out: dict = {}
    async with shared.running():
        for name, lim in (("local", Limiter(Metrics(list), lambda: 1)),
                          ("redis", Limiter(Metrics(list), lambda: 1, shared))):
            best_wall, best_cpu = float("inf"), float("inf")
            for _ in range(repeats):
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(n):
                    st = RequestState("r", None, "chat")  # type: ignore[arg-type]
                    st.principal = who
                    plan = lim.plan(who, "bench", cfg)
                    assert plan is not None
                    if lim.shared is None:  # as the request path does: memory state decides at once
                        held = lim.take(plan, 40, time.monotonic())
                    else:
                        held = await lim.reserve(plan, 40, cfg)
                    st.limit, st.limit_lines = held, held.lines  # kept on the request, as the pipeline does
                    assert st.limit_lines  # the reply head's x-ratelimit lines
                    st.limit.settle(st.outcome)
                best_wall = min(best_wall, (time.perf_counter() - w0) / n * 1e6)
                best_cpu = min(best_cpu, (time.process_time() - c0) / n * 1e6)
            out[name] = {"wall_us": best_wall, "cpu_us": best_cpu}
        unlimited, none = Limiter(Metrics(list), lambda: 1), LimitsConfig()
        t0 = time.perf_counter()
        for _ in range(n):
            unlimited.plan(who, "bench", none)
        out["off"] = {"wall_us": (time.perf_counter() - t0) / n * 1e6}
    return out


def table(points: list[dict]) -> tuple[str, dict]:
    """The markdown table, and per (concurrency, target) the added p50 and CPU against its base: medians of the
    per-round differences and their ranges."""
    lines = ["| conc | target | p50 us | p99 us | p50 added, us | CPU/req us | CPU added, us | req/s |",
             "|---|---|---|---|---|---|---|---|"]
    added: dict = {}
    for conc in sorted({p["conc"] for p in points}):
        by = {(p["target"], p["round"]): p for p in points if p["conc"] == conc}
        rounds = sorted({r for _, r in by})
        for i, name in enumerate((*TARGETS, *SWITCH)):
            rows = [by[(name, r)] for r in rounds]
            d_p50, d_cpu, cols = [0.0], [0.0], ("-", "-")
            if name in BASE:
                base = BASE[name]
                d_p50 = [by[(name, r)]["p50"] - by[(base, r)]["p50"] for r in rounds]
                d_cpu = [by[(name, r)]["cpu_per_req_us"] - by[(base, r)]["cpu_per_req_us"] for r in rounds]
                cols = (f"{kit.span(d_p50, '+.0f', '..')} vs {base}", f"{kit.span(d_cpu, '+.1f', '..')} vs {base}")
            added[(conc, name)] = (statistics.median(d_p50), statistics.median(d_cpu),
                                   f"{min(d_p50):+.0f}..{max(d_p50):+.0f}", f"{min(d_cpu):+.1f}..{max(d_cpu):+.1f}",
                                   max(d_cpu) - min(d_cpu))
            p50 = kit.pm(kit.median_spread([p["p50"] for p in rows]))
            cpu = kit.pm(kit.median_spread([p["cpu_per_req_us"] for p in rows]), ".0f")
            rps = kit.pm(kit.median_spread([p["requests"] / (p["duration_us"] / 1e6) for p in rows]))
            p99 = statistics.median([p["p99"] for p in rows])
            lines.append(f"| {conc if i == 0 else ''} | {name} | {p50} | {p99:,.0f} | {cols[0]} | {cpu} | {cols[1]} | "
                         f"{rps} |")
    return "\n".join(lines), added


def markdown(res: dict) -> str:
    c = res["conditions"]
    tab, added = table(res["points"])
    ip = res["in_process"]
    local_cpu = ip["local"]["cpu_us"]
    p50_redis = [v[0] for (conc, name), v in added.items() if name == "redis" and conc == 1]
    switched = [v[1] for (conc, name), v in added.items() if name == "switch:local"]
    span = max(v[4] for (conc, name), v in added.items() if name == "switch:local")
    # Rounds that disagree by more than the target cannot say which side of it the difference is on.
    verdict_cpu = (f"cannot be judged against the target from this run (its rounds span up to {span:.1f} us, more "
                   f"than the target)" if span > TARGET_CPU_US else
                   "meets the target there" if max(switched) < TARGET_CPU_US else "misses the target there")
    verdict_p50 = ("meets" if p50_redis and p50_redis[0] / 1000 < TARGET_P50_MS else "misses") if p50_redis else "-"

    def ranges(name: str, col: int) -> str:
        return ", ".join(f"{added[(conc, name)][col]:+.1f} us ({added[(conc, name)][col + 2]}) at c={conc}"
                         for conc in c['concurrency'])
    return f"""# Rate limits: what they cost

`{c['command']}`

Five gateway processes in front of one `benchmarks/fast_engine.py` (a zero-delay engine): limits off, local
limits (memory state), Redis state without limits (`redis_off`: what Redis state costs by itself, its stats
sharing), Redis limits (`redis`, measured against `redis_off`) and `control`, a second process set up exactly as
`off`: its difference from `off` is what two identical processes differ by here, the floor under which a
difference means nothing. `switch:off` and `switch:local` are one more process, run with its `[limits]` switched
off and on by a configuration reload between runs (the order alternating by round), which leaves out the
difference between processes altogether. The limits are so high that every request
is checked and charged and none is refused. `wrk` drives one gateway at a time with non-streamed requests,
{c['seconds']:g} s per run, {c['rounds']} rounds, the order of the gateways rotating each round. CPU per request
is the gateway process's user+system time from /proc over the requests wrk completed. Medians of the rounds,
spread = (max-min)/median; "added" is the median of the per-round differences, its range in brackets.

Conditions: commit {c['commit']} ({len(c['dirty_paths'])} paths changed in the work tree), {c['date']},
{c['machine']}, Redis {c['redis']} on the loopback. One machine runs wrk, the gateways, the engine and Redis,
and other jobs were running on it too: load average before {' / '.join(f'{x:.2f}' for x in c['load_before'])},
after {' / '.join(f'{x:.2f}' for x in c['load_after'])}.

{tab}

## The limiter alone, in process

Best of {c['repeats_in_process']} runs of {c['n_in_process']:,} requests (plan, reserve, headers, settle), one at a
time, on uvloop; a hot loop keeps code and data in cache, so read these as a lower bound of the cost inside a busy
server. The Redis line is mostly the kernel's: a send and a receive on the loopback for each request.

| | wall us / request | CPU us / request |
|---|---|---|
| key without limits (the plan lookup that says so) | {ip['off']['wall_us']:.2f} | - |
| local buckets | {ip['local']['wall_us']:.1f} | {ip['local']['cpu_us']:.1f} |
| Redis script (one loopback round trip) | {ip['redis']['wall_us']:.1f} | {ip['redis']['cpu_us']:.1f} |

## Against the targets

- Local limits, under {TARGET_CPU_US:g} us of CPU per request: end to end, in the one process whose limits a reload
  switches between runs (median of the per-round differences, range): {ranges('switch:local', 1)}: it
  {verdict_cpu}. The limiter alone in a hot loop takes {local_cpu:.1f} us (a lower bound: a busy
  server runs it with cold caches, and pays for writing six more header lines and for collecting what it
  allocates). Between separate processes: {ranges('local', 1)} against `off`, where the control process differs from
  `off` by {ranges('control', 1)}. Added p50 in the switched process: {ranges('switch:local', 0)}. CPU time per
  request is only as steady as the machine: `limits_instructions.md` counts the same difference in instructions.
- Redis limits, under {TARGET_P50_MS:g} ms added p50 (against `redis_off`): {', '.join(f"{added[(conc, 'redis')][0] / 1000:+.3f} ms at c={conc}" for conc in c['concurrency'])}
  ({verdict_p50} it at c=1); CPU added {ranges('redis', 1)}.
- At c={c['concurrency'][-1]} wrk, five gateways, the engine and Redis share 2 cores with other work, so every
  extra microsecond of CPU (the gateway's above, plus Redis's own) queues: the p50 there measures the machine's
  saturation as much as the round trip.
"""


def redis_version() -> str:
    try:
        out = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", "6379", "INFO", "server"], check=False,
                             capture_output=True,
                             text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("redis_version")),
                "unknown")


def clean(prefix: str) -> None:
    keys = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", "6379", "--scan", "--pattern", prefix + "*"],
                          capture_output=True, text=True, check=False).stdout.split()
    if keys:
        subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", "6379", "DEL", *keys], capture_output=True, check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--out", default=str(kit.RESULTS / "limits"))
    ap.add_argument("--render", action="store_true", help="only write OUT.md again from OUT.json")
    args = ap.parse_args()
    if args.render:
        kit.render_again(Path(args.out), markdown)
        return 0
    prefix = f"shapegate-bench:{secrets.token_hex(4)}:"
    conditions = {**kit.provenance(), "command": kit.command("benchmarks.limits"),
                  "seconds": args.seconds, "rounds": args.rounds, "concurrency": args.concurrency,
                  "redis": redis_version(), "n_in_process": 20_000, "repeats_in_process": 5}
    try:
        with tempfile.TemporaryDirectory() as d:
            points = drive(args, Path(d), prefix)
        # On uvloop, as the gateway runs.
        in_proc = uvloop.run(in_process(conditions["n_in_process"], conditions["repeats_in_process"], prefix))
    finally:
        clean(prefix)
    conditions["load_after"] = os.getloadavg()
    res = {"conditions": conditions, "points": points, "in_process": in_proc}
    report = markdown(res)
    print(report)
    kit.write_result(Path(args.out), res, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
