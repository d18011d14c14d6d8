"""Failover under injected faults (kills, hangs, 5xx bursts, slow starts, recoveries), with no request lost."""

# Starts four simulated engines (`python -m gateway.sim`, R9700 profiles: two vLLM, one SGLang, one
# llama.cpp) and the gateway (`python -m gateway.cli serve`) as subprocesses on loopback, drives N
# streamed chat requests at concurrency C through the gateway, and injects faults throughout:
#   kill   SIGKILL an engine process (streams on it die mid-way), restart it on the same port
#   kill2  two engines at once
#   hang   the engine accepts requests and never answers (fault knob hang_s = -1)
#   5xx    every request answered 502
#   503    every request answered 503 with Retry-After: 2
#   slow   3 s before the engine's scheduler sees a request (slow TTFT)
# Every reply is classified by the client: served (200, stream ends with a finish_reason and [DONE]),
# failed with a clear error (an OpenAI-shaped error body, or an error event then [DONE]), or lost
# (anything else). An admin poller reads /stats every 50 ms to time when a faulty engine leaves
# rotation and comes back. A failover is put down to a fault when it started within the fault's window
# widened by FAULT_MARGIN_S; one that started outside every window is a false alarm, and the report says
# how much of the run the windows cover. The whole run, with fresh engines and gateway, is repeated (3
# times by default); benchmarks/failover_report.py writes the medians over the repeats with their
# min..max. Exits 1 when any repeat lost a request.
#
# Usage: python3 -m benchmarks.failover [--requests 2000] [--concurrency 32] [--repeats 3] [--from-json FILE]
# Writes benchmarks/results/failover.{json,md}.

from __future__ import annotations

import argparse
import asyncio
import bisect
import hashlib
import json
import os
import platform
import random
import re
import secrets
import statistics
import sys
import tempfile
import time
import tomllib
from collections import Counter
from pathlib import Path

import aiohttp
import uvloop

from benchmarks import failover_report, kit
from benchmarks.failover_procs import ENGINES, Engine, Gateway, gateway_toml
from gateway.sim.profiles import get_profile

TOKEN = re.compile(rb'"content":"[^"]')
HOLD_S, SETTLE_S = 3.5, 3.0  # each fault lasts HOLD_S, then SETTLE_S of healthy running
SCHEDULE = [("kill", ("vllm-1",)), ("hang", ("sglang-0",)), ("5xx", ("llama-0",)), ("slow", ("vllm-0",)),
            ("503", ("vllm-1",)), ("kill2", ("llama-0", "vllm-0"))]
KNOBS = {"hang": {"hang_s": -1}, "5xx": {"error_rate": 1.0, "error_status": 502},
         "503": {"error_rate": 1.0, "error_status": 503, "retry_after_s": 2}, "slow": {"slow_start_s": 3.0}}
TIMEOUT_KINDS = ("hang", "slow")  # faults an engine shows only by not answering in time
# A failover is put down to a fault when its request started within the fault's window widened by this much:
# a request sent up to a TTFT deadline (0.8 s) before a fault can still be caught by it.
FAULT_MARGIN_S = 1.0
NO_FAULT = "no fault on the engine left"  # the cause of a failover off an engine that had no fault around then
MAX_TOKENS = (8, 24)
POLL_S = 0.05


def classify(status: int, raw: bytes) -> str:
    if status != 200:
        return "error" if raw.startswith(b'{"error":') else "lost"
    if not raw.endswith(b"data: [DONE]\n\n") or raw.count(b"data: [DONE]") != 1:
        return "lost"  # cut, or something after the end
    if b'data: {"error"' in raw:
        return "error"
    return "served" if b'"finish_reason":"' in raw else "lost"


async def one(s, url: str, key: str, rng: random.Random) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "tell me something " * rng.randint(1, 20)}],
            "stream": True, "max_tokens": rng.randint(*MAX_TOKENS)}
    t0 = time.monotonic()
    rec = {"t0": t0, "status": 0, "backend": "", "reason": "", "kind": "lost"}
    try:
        async with s.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                          timeout=aiohttp.ClientTimeout(total=60)) as r:
            parts = []
            async for chunk in r.content.iter_any():
                if "ttft" not in rec and TOKEN.search(chunk):
                    rec["ttft"] = time.monotonic() - t0
                parts.append(chunk)
            raw = b"".join(parts)
            rec.update(status=r.status, backend=r.headers.get("x-shapegate-backend", ""),
                       reason=r.headers.get("x-shapegate-reason", ""), kind=classify(r.status, raw))
            if rec["kind"] == "error":
                m = re.search(rb'"code":"([^"]*)"', raw)
                rec["error"] = (m.group(1).decode() if m else "?") + (" (mid-stream)" if r.status == 200 else "")
    except (aiohttp.ClientError, TimeoutError) as e:
        rec["error"] = type(e).__name__  # the client saw the connection fail: lost
    rec["t1"] = time.monotonic()
    return rec


async def load(url: str, key: str, n: int, concurrency: int) -> list[dict]:
    rng = random.Random(7)
    left = iter(range(n))
    out: list[dict] = []
    conn = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker():
            for _ in left:
                out.append(await one(s, url, key, rng))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def inject(engines: dict[str, Engine], done: asyncio.Event) -> list[dict]:
    """Cycle through the schedule until the load is done; every fault is recovered before the next."""
    faults = []
    i = 0
    with _suppress_timeout():  # a few seconds of healthy running first
        await asyncio.wait_for(done.wait(), SETTLE_S)
    while not done.is_set():
        kind, targets = SCHEDULE[i % len(SCHEDULE)]
        i += 1
        # Streams on a killed engine can fail while kill() still waits for the process to exit.
        t_inject = time.monotonic()
        for t in targets:
            await (engines[t].kill() if kind.startswith("kill") else engines[t].set_faults(**KNOBS[kind]))
        # The fault is in force from here: the process is gone, or the engine has taken the knob.
        f = {"kind": kind, "backends": list(targets), "t_inject": t_inject, "t_fault": time.monotonic()}
        with _suppress_timeout():
            await asyncio.wait_for(done.wait(), HOLD_S)
        f["cut_short"] = done.is_set()  # the load ended while the fault was held
        for t in targets:
            await (engines[t].start() if kind.startswith("kill") else engines[t].set_faults(reset=True))
        f["t_recover"] = time.monotonic()  # restarted engines answer their health route by now
        faults.append(f)
        with _suppress_timeout():
            await asyncio.wait_for(done.wait(), SETTLE_S)
    return faults


class _suppress_timeout:
    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        return et is TimeoutError


async def watch(url: str, key: str, done: asyncio.Event) -> list[tuple[float, dict[str, str]]]:
    """Each backend's state every POLL_S from the gateway's /stats: its breaker's when ready, else its health."""
    timeline = []
    async with aiohttp.ClientSession() as s:
        while not done.is_set():
            try:
                async with s.get(url + "/stats", headers={"Authorization": f"Bearer {key}"}) as r:
                    rows = (await r.json())["backends"]
                timeline.append((time.monotonic(), {b["id"]: b["breaker"] if b["health"] == "ready" else b["health"]
                                                    for b in rows}))
            except (aiohttp.ClientError, TimeoutError):
                pass  # a missed poll only lowers the resolution
            await asyncio.sleep(POLL_S)
    return timeline


async def all_ready(url: str, n: int, timeout: float = 30.0) -> None:
    """Start the load only once every engine is in rotation (warm-up done), so the faults are the only cause."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(url + "/readyz") as r:
                states = (await r.json())["backends"]
            if sum(1 for v in states.values() if v == "ready") == n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"backends not ready: {states}")
            await asyncio.sleep(0.05)


def failed_on(reason: str) -> list[str]:
    """Backends a request failed on before it was served, from the x-shapegate-reason header."""
    if "failover from " not in reason:
        return []
    return reason.split("failover from ", 1)[1].split(" after", 1)[0].split(",")


def failed_after(reason: str) -> str:
    """The error code of the last failure before the request moved ('... failover from a,b after CODE')."""
    return reason.rsplit(" after ", 1)[1] if "failover from " in reason else ""


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the spans."""
    total, reach = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi > max(lo, reach):
            total += hi - max(lo, reach)
        reach = max(reach, hi)
    return total


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    return {"n": len(xs), "median": round(statistics.median(xs), 3), "p99": round(xs[int(0.99 * (len(xs) - 1))], 3),
            "min": round(xs[0], 3), "max": round(xs[-1], 3)}


def in_rotation(states: dict[str, str], backend: str) -> bool:
    """Ready and breaker not open (a half-open breaker lets one trial request through)."""
    return states.get(backend, "closed") in ("closed", "half_open")


def _fault_times(f: dict, records: list[dict], timeline) -> None:
    """When each engine of the fault left rotation (before its recovery), when it first served a request after
    it, and the clear errors that ended while it lasted."""
    outs, backs = [], []
    before = [states for t, states in timeline if t < f["t_fault"]]
    # An engine already out when the fault came (a breaker opened by an earlier failure) is timed from when it
    # was next seen in rotation: only then can the fault be what takes it out.
    f["already_out"] = [b for b in f["backends"] if before and not in_rotation(before[-1], b)]
    for b in f["backends"]:
        seen_in, out = b not in f["already_out"], None
        for t, states in timeline:
            if f["t_fault"] <= t <= f["t_recover"]:
                if seen_in and not in_rotation(states, b):
                    out = t
                    break
                seen_in = seen_in or in_rotation(states, b)
        outs.append(None if out is None else out - f["t_fault"])
        served = [r["t0"] for r in records if r["backend"] == b and r["kind"] == "served" and r["t0"] >= f["t_recover"]]
        backs.append(min(served) - f["t_recover"] if served else None)
    f["out_of_rotation_s"] = max(outs) if None not in outs else None
    f["traffic_back_s"] = max(backs) if None not in backs else None
    f["run_left_s"] = max(r["t1"] for r in records) - f["t_recover"]  # load time left after the recovery
    f["errors"] = sum(1 for r in records if r["kind"] == "error" and f["t_inject"] <= r["t1"]
                      and r["t0"] < f["t_recover"])


def analyze(records: list[dict], faults: list[dict], timeline, engine_ids: list[str], deadline_s: float) -> dict:
    """One repeat's figures from the client's records, the injected faults and the /stats timeline."""
    records.sort(key=lambda r: r["t0"])
    start, end = records[0]["t0"], max(r["t1"] for r in records)
    span = end - start
    for f in faults:
        _fault_times(f, records, timeline)
        f["window"] = (max(start, f["t_fault"] - FAULT_MARGIN_S), min(end, f["t_recover"] + FAULT_MARGIN_S))
        f["failovers"] = 0  # those it explains, counted below
    moved = [r for r in records if failed_on(r["reason"])]
    false_alarms, unexcused = [], []
    for r in moved:
        r["failed_on"], r["after"] = failed_on(r["reason"]), failed_after(r["reason"])
        near = [f for f in faults if f["window"][0] <= r["t0"] <= f["window"][1]]
        if not near:
            false_alarms.append(r)
        if any(not any(b in f["backends"] for f in near) for b in r["failed_on"]):
            unexcused.append(r)  # left an engine that had no fault of its own around then
        cause = next((f for f in near if set(f["backends"]) & set(r["failed_on"])), None)
        r["cause"] = cause["kind"] if cause else NO_FAULT
        if cause:
            cause["failovers"] += 1
    covered = _union_s([f["window"] for f in faults])
    engine_covered = [_union_s([f["window"] for f in faults if b in f["backends"]]) for b in engine_ids]
    fault_free = span - covered
    direct = [r["ttft"] for r in records if not failed_on(r["reason"]) and "ttft" in r]
    # A request that moved off a hung or slow engine waited one deadline per engine it left; what its TTFT
    # has beyond that is the gateway's own time plus the first token of the engine that served it.
    beyond = [r["ttft"] - len(r["failed_on"]) * deadline_s for r in moved
              if r["cause"] in TIMEOUT_KINDS and r["after"] == "upstream_timeout" and "ttft" in r]
    errors = [r for r in records if r["kind"] == "error"]
    cut = {id(r) for r in errors if r["status"] == 200 and any(
        f["kind"].startswith("kill") and r["backend"] in f["backends"] and f["t_inject"] <= r["t1"]
        and r["t0"] < f["t_fault"] for f in faults)}
    polls = [t for t, _ in timeline]

    def states_at(t: float) -> str:
        """How many engines were in each state at the last /stats poll before t."""
        i = bisect.bisect_right(polls, t) - 1
        counts = Counter(timeline[i][1].values()) if i >= 0 else Counter(unpolled=len(engine_ids))
        return " + ".join(f"{n} {state}" for state, n in sorted(counts.items()))

    refused = [r for r in errors if r["error"] == "no_backend_available"]
    starts = [r["t0"] for r in refused]  # sorted, as the records are
    others: dict[str, list[float]] = {}
    for r in errors:
        if id(r) not in cut:
            others.setdefault(r["error"], []).append(r["t0"])
    engine_fault_free_min = sum(span - c for c in engine_covered) / 60

    def rel(t: float) -> float:
        return round(t - start, 2)  # seconds since the repeat's first request

    return {
        "requests": len(records), **{k: sum(1 for r in records if r["kind"] == k) for k in ("served", "error", "lost")},
        "duration_s": round(span, 1), "deadline_s": deadline_s,
        "errors_by_code": dict(Counter(r.get("error", "?") for r in records if r["kind"] != "served")),
        "errors_cut_by_kill": len(cut), "errors_cut_with_tokens": sum(1 for r in errors if id(r) in cut and "ttft" in r),
        "refused": len(refused), "refused_by_states": dict(Counter(states_at(r["t0"]) for r in refused)),
        "refused_most_in_1s": max((bisect.bisect_right(starts, t + 1.0) - i for i, t in enumerate(starts)), default=0),
        "other_errors": {code: {"n": len(ts), "first_t": rel(min(ts)), "last_t": rel(max(ts))}
                         for code, ts in sorted(others.items())},
        "failovers_total": len(moved), "failovers_by_cause": dict(Counter(r["cause"] for r in moved)),
        "false_alarms": len(false_alarms), "fault_windows_s": round(covered, 2),
        "fault_window_share": round(covered / span, 4), "fault_free_s": round(fault_free, 2),
        "false_alarms_per_fault_free_min": round(len(false_alarms) / (fault_free / 60), 3) if fault_free > 0 else None,
        "failovers_off_unfaulted_engine": len(unexcused),
        "off_unfaulted_per_engine_min": round(len(unexcused) / engine_fault_free_min, 3),
        "engine_window_share": round(statistics.mean(engine_covered) / span, 4),
        "unexcused_list": [{"t": rel(r["t0"]), "failed_on": r["failed_on"], "after": r["after"],
                            "outside_every_window": r in false_alarms,
                            "ttft": round(r["ttft"], 3) if "ttft" in r else None} for r in unexcused],
        "not_served": [{"t": rel(r["t0"]), "t_end": rel(r["t1"]), "status": r["status"], "backend": r["backend"],
                        "kind": r["kind"], "error": r.get("error", ""), "cut_by_kill": id(r) in cut}
                       for r in records if r["kind"] != "served"],
        "ttft_direct_s": _dist(direct), "ttft_failed_over_s": _dist([r["ttft"] for r in moved if "ttft" in r]),
        "ttft_failed_over_by_cause_s": {k: _dist([r["ttft"] for r in moved if r["cause"] == k and "ttft" in r])
                                        for k in sorted({r["cause"] for r in moved})},
        "timeout_moves_beyond_deadline_s": _dist(beyond),
        "timeout_moves_over_direct_p99": sum(1 for b in beyond if direct and b > _dist(direct)["p99"]),
        "out_of_rotation_s": _dist([f["out_of_rotation_s"] for f in faults if f["out_of_rotation_s"] is not None]),
        "traffic_back_s": _dist([f["traffic_back_s"] for f in faults if f["traffic_back_s"] is not None]),
        "faults": [{**{k: (rel(v) if k.startswith("t_") else round(v, 3) if isinstance(v, float) else v)
                       for k, v in f.items() if k != "window"}, "window": [rel(t) for t in f["window"]]}
                   for f in faults]}


def settings(toml_text: str) -> dict:
    """The gateway settings the report names, read back from the config the gateway was given."""
    cfg = tomllib.loads(toml_text)
    up, routing, health = cfg["upstream"], cfg["routing"], cfg["health"]
    return {"policy": routing["policy"], "max_attempts": routing["max_attempts"],
            "ttft_deadline_s": up["ttft_deadline_s"], "first_byte_timeout_s": up["first_byte_timeout_s"],
            "breaker_failures": health["breaker_failures"], "breaker_open_s": health["breaker_open_s"],
            "probe_interval_s": health["interval_s"], "sglang_probe_interval_s": health["sglang_interval_s"]}


async def run_once(args) -> tuple[dict, dict]:
    """One repeat with fresh engines and gateway: its analysis, and the gateway settings it ran with."""
    key, admin = "sk-" + secrets.token_hex(8), "sk-" + secrets.token_hex(8)
    engines = {i: Engine(i) for i in ENGINES}
    await asyncio.gather(*(e.start() for e in engines.values()))
    cfg = Path(tempfile.mkdtemp()) / "failover.toml"
    cfg.write_text(gateway_toml(engines, hashlib.sha256(key.encode()).hexdigest(),
                                hashlib.sha256(admin.encode()).hexdigest()))
    gw = Gateway(cfg)
    try:
        await gw.start()
        await all_ready(gw.url, len(engines))
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(gw.url, admin, done))
        injector = asyncio.create_task(inject(engines, done))
        records = await load(gw.url, key, args.requests, args.concurrency)
        done.set()
        faults, timeline = await injector, await watcher
    finally:
        await gw.stop()
        await asyncio.gather(*(e.stop() for e in engines.values()))
    gateway = settings(cfg.read_text())
    deadlines = set(gateway["ttft_deadline_s"].values())
    assert len(deadlines) == 1, "the analysis assumes one TTFT deadline for every class"
    return analyze(records, faults, timeline, list(engines), deadlines.pop()), gateway


def tree_state() -> dict:
    changed = kit.changed_paths()
    return {"commit": kit.commit(), "dirty_paths": len(changed),
            # The code under test: an uncommitted change there makes the commit alone not reproduce the run.
            "dirty_gateway_paths": sum(1 for p in changed if p.startswith(("gateway/", "backends/")))}


async def main(args) -> dict:
    started = time.monotonic()
    meta = {**tree_state(), "date": kit.utc_date(),
            "machine": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
            "load_before": os.getloadavg(), "command": kit.command("benchmarks.failover"),
            "requests": args.requests, "concurrency": args.concurrency, "repeats": args.repeats,
            "hold_s": HOLD_S, "settle_s": SETTLE_S, "schedule": SCHEDULE, "max_tokens": MAX_TOKENS,
            "poll_s": POLL_S, "fault_margin_s": FAULT_MARGIN_S, "timeout_kinds": TIMEOUT_KINDS,
            "engines": {i: {"engine": e, "profile": p, "max_running": get_profile(e, p).max_running}
                        for i, (e, p, _) in ENGINES.items()}}
    runs = []
    for rep in range(args.repeats):
        load_before = os.getloadavg()
        run, meta["gateway"] = await run_once(args)
        runs.append({**run, "load_before": load_before, "load_after": os.getloadavg()})
        print(f"repeat {rep + 1}/{args.repeats}: served {run['served']}, errors {run['error']}, lost {run['lost']}, "
              f"failovers {run['failovers_total']}, false alarms {run['false_alarms']} "
              f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    meta["load_after"] = os.getloadavg()
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    return {"meta": meta, "runs": runs}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--from-json", type=Path, help="re-render the .md of an earlier run's .json (no run)")
    a = p.parse_args()
    if a.from_json:
        result = json.loads(a.from_json.read_text())
        a.from_json.with_suffix(".md").write_text(failover_report.markdown(result))
    else:
        result = uvloop.run(main(a))
        kit.write_result(kit.RESULTS / "failover", result, failover_report.markdown(result))
    print(failover_report.markdown(result))
    sys.exit(1 if any(run["lost"] for run in result["runs"]) else 0)
