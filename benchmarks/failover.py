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
# rotation and comes back.
#
# Usage: python benchmarks/failover.py [--requests 2000] [--concurrency 32]
# Writes benchmarks/results/failover.{json,md}.

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from failover_procs import ENGINES, Engine, Gateway, gateway_toml  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TOKEN = re.compile(rb'"content":"[^"]')
HOLD_S, SETTLE_S = 3.5, 3.0  # each fault lasts HOLD_S, then SETTLE_S of healthy running
SCHEDULE = [("kill", ("vllm-1",)), ("hang", ("sglang-0",)), ("5xx", ("llama-0",)), ("slow", ("vllm-0",)),
            ("503", ("vllm-1",)), ("kill2", ("llama-0", "vllm-0"))]
KNOBS = {"hang": {"hang_s": -1}, "5xx": {"error_rate": 1.0, "error_status": 502},
         "503": {"error_rate": 1.0, "error_status": 503, "retry_after_s": 2}, "slow": {"slow_start_s": 3.0}}


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
            "stream": True, "max_tokens": rng.randint(8, 24)}
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
        for t in targets:
            await (engines[t].kill() if kind.startswith("kill") else engines[t].set_faults(**KNOBS[kind]))
        # The fault is in force from here: the process is gone, or the engine has taken the knob.
        f = {"kind": kind, "backends": list(targets), "t_fault": time.monotonic()}
        with _suppress_timeout():
            await asyncio.wait_for(done.wait(), HOLD_S)
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


async def watch(url: str, key: str, done: asyncio.Event) -> list[tuple[float, dict[str, bool]]]:
    """When each backend is in rotation (ready, breaker not open), every 50 ms from the gateway's /stats."""
    timeline = []
    async with aiohttp.ClientSession() as s:
        while not done.is_set():
            try:
                async with s.get(url + "/stats", headers={"Authorization": f"Bearer {key}"}) as r:
                    rows = (await r.json())["backends"]
                timeline.append((time.monotonic(), {b["id"]: b["health"] == "ready" and b["breaker"] != "open"
                                                    for b in rows}))
            except (aiohttp.ClientError, TimeoutError):
                pass  # a missed poll only lowers the resolution
            await asyncio.sleep(0.05)
    return timeline


def analyze(records: list[dict], faults: list[dict], timeline) -> dict:
    for f in faults:
        outs, backs = [], []
        for b in f["backends"]:
            out = next((t for t, up in timeline if t >= f["t_fault"] and not up.get(b, True)), None)
            outs.append(None if out is None else out - f["t_fault"])
            served = [r["t0"] for r in records if r["backend"] == b and r["kind"] == "served"
                      and r["t0"] >= f["t_recover"]]
            backs.append(min(served) - f["t_recover"] if served else None)
        f["out_of_rotation_s"] = max(outs) if None not in outs else None
        f["traffic_back_s"] = max(backs) if None not in backs else None
        f["failovers"] = sum(1 for r in records if f["t_fault"] <= r["t0"] < f["t_recover"]
                             and set(f["backends"]) & set(failed_on(r["reason"])))
        f["errors"] = sum(1 for r in records if r["kind"] == "error" and f["t_fault"] <= r["t1"]
                          and r["t0"] < f["t_recover"])
    kinds = {k: sum(1 for r in records if r["kind"] == k) for k in ("served", "error", "lost")}
    # A request sent up to a TTFT deadline before a fault can still be caught by it.
    false_alarms = [r for r in records if r["failed_on"] and not any(
        f["t_fault"] - 1.0 <= r["t0"] <= f["t_recover"] + 1.0 for f in faults)]
    moved = [r["ttft"] for r in records if r["failed_on"] and "ttft" in r]
    direct = [r["ttft"] for r in records if not r["failed_on"] and "ttft" in r]
    span = max(r["t1"] for r in records) - min(r["t0"] for r in records)
    outs = [f["out_of_rotation_s"] for f in faults if f["out_of_rotation_s"] is not None]
    backs = [f["traffic_back_s"] for f in faults if f["traffic_back_s"] is not None]
    return {"requests": len(records), **kinds, "duration_s": round(span, 1),
            "errors_by_code": _count(r.get("error", "?") for r in records if r["kind"] != "served"),
            "failovers_total": sum(1 for r in records if "failover from" in r["reason"]),
            # Failovers that no fault explains (started outside every fault window): false alarms.
            "failovers_outside_faults": len(false_alarms),
            "false_alarms": [{"t": round(r["t0"] - records[0]["t0"], 2), "reason": r["reason"]}
                             for r in false_alarms],
            "not_served": [{"t": round(r["t0"] - records[0]["t0"], 2), "status": r["status"],
                            "backend": r["backend"], "error": r.get("error", "")} for r in records
                           if r["kind"] != "served"],
            "out_of_rotation_s": _dist(outs), "traffic_back_s": _dist(backs),
            "ttft_failed_over_s": _dist(moved), "ttft_direct_s": _dist(direct),
            "faults": [{k: (round(v - records[0]["t0"], 2) if k.startswith("t_") else
                            round(v, 3) if isinstance(v, float) else v) for k, v in f.items()} for f in faults]}


def _count(items) -> dict:
    out: dict = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    return {"n": len(xs), "median": round(statistics.median(xs), 3), "p99": round(xs[int(0.99 * (len(xs) - 1))], 3),
            "max": round(xs[-1], 3)}


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


def write(summary: dict, args) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "failover.json").write_text(json.dumps(summary, indent=1))
    s = summary
    rows = "\n".join(
        f"| {f['t_fault']:.1f} | {f['kind']} | {', '.join(f['backends'])} | {_s(f['out_of_rotation_s'])} | "
        f"{f['failovers']} | {f['errors']} | {_s(f['traffic_back_s'])} |" for f in s["faults"])
    md = f"""# Failover under injected faults

{s['requests']} streamed chat requests at concurrency {args.concurrency} through the gateway
(`python -m gateway.cli serve`: least_loaded, TTFT deadline 0.8 s for every class, breaker 3
failures / 1 s, probes every 0.2 s) in front of four simulated engines run as processes
(`python -m gateway.sim`, R9700 profiles: 2 vLLM, 1 SGLang, 1 llama.cpp with 4 slots), 8-24 output
tokens each. Client, gateway and engines share one {platform.machine()} machine with {os_cpus()} cores,
loopback only (Python {platform.python_version()}). Faults cycle through the whole run, each held
{HOLD_S} s and followed by {SETTLE_S} s of healthy running: {', '.join(k for k, _ in SCHEDULE)}.

| requests | served | failed with a clear error | lost or truncated silently | duration |
|---|---|---|---|---|
| {s['requests']} | {s['served']} | {s['error']} | **{s['lost']}** | {s['duration_s']} s |

- *Served*: the stream ended with a finish_reason and `[DONE]`. *Failed with a clear error*: an
  OpenAI-shaped error body, or an error event then `[DONE]`. *Lost*: anything else (a cut stream, a
  dropped connection, a `[DONE]` with neither). Every stream was checked.
- Errors by code: {', '.join(f'{k} x{v}' for k, v in sorted(s['errors_by_code'].items())) or 'none'}.
  A stream whose engine is killed after output started cannot move (the client has seen tokens):
  it ends with an error event and `[DONE]`.
- {s['failovers_total']} requests failed on one engine before their first byte and were served by another;
  {s['failovers_outside_faults']} of them started outside every fault window (false alarms, such as an engine's TTFT
  going over the deadline while the 2 cores are saturated).
- Time to first token, client-measured: requests served directly median {_s(s['ttft_direct_s'].get('median'))},
  p99 {_s(s['ttft_direct_s'].get('p99'))}; requests that failed over median
  {_s(s['ttft_failed_over_s'].get('median'))}, max {_s(s['ttft_failed_over_s'].get('max'))} (a hung or slow
  engine costs a request at most the 0.8 s deadline before it moves; a dead one costs a refused connect).
- Fault to out of rotation (the gateway's own /stats, polled every 50 ms): median
  {_s(s['out_of_rotation_s'].get('median'))}, max {_s(s['out_of_rotation_s'].get('max'))} over
  {s['out_of_rotation_s'].get('n', 0)} faults. Kills, 5xx and 503 take an engine out with the first failed
  request; a hang or slow start needs one request to reach the TTFT deadline, so its floor is that
  deadline (0.8 s here) plus the wait for the next request the policy sends there.
- Recovery to traffic back (recovery = fault lifted, or the restarted process answering its health
  route; traffic back = the first request served by that engine): median
  {_s(s['traffic_back_s'].get('median'))}, max {_s(s['traffic_back_s'].get('max'))} over
  {s['traffic_back_s'].get('n', 0)} recoveries.

| t (s) | fault | backends | out of rotation after | failovers | clear errors | traffic back after |
|---|---|---|---|---|---|---|
{rows}

Generated by `benchmarks/failover.py`; raw figures in `failover.json`.
"""
    (RESULTS / "failover.md").write_text(md)


def _s(v) -> str:
    return "-" if v is None else f"{v:.2f} s"


def os_cpus() -> int:
    import os
    return os.cpu_count() or 0


async def main(args) -> dict:
    import hashlib
    import secrets
    import tempfile

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
    records.sort(key=lambda r: r["t0"])
    for r in records:
        r["failed_on"] = failed_on(r["reason"])
    summary = analyze(records, faults, timeline)
    write(summary, args)
    return summary


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    a = p.parse_args()
    out = uvloop.run(main(a))
    print(json.dumps({k: v for k, v in out.items() if k not in ("faults", "not_served", "false_alarms")}, indent=1))
    sys.exit(1 if out["lost"] else 0)
