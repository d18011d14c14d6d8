"""Engines that send 1 GiB: the gateway's memory stays bounded, its CPU small, /healthz answers throughout."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass

import pytest

from tests.gateway_harness import gateway_config
from tests.procs import gateway_proc, to_toml
from tests.raw_engine import (CONTENT, chat_ok, error_event, exchange, GiB, good, MiB, oai, raw_chat,
                              RawEngine, stream_ending, Writer)


# -- memory and liveness: the gateway as a process, 1 GiB from the engine ---------------------------------

PIECE = b"x" * MiB


def flood(first: bytes, *, chunked: bool, total: int = GiB) -> Writer:
    """Head-and-body writer: `first` (a head and the body's start) then 1 MiB pieces, drained one by one,
    until `total` bytes of body or until the gateway closes the connection."""

    async def write(w: asyncio.StreamWriter, stream: bool, engine: RawEngine) -> None:
        w.write(first)
        sent = 0
        while sent < total:
            if chunked:
                w.write(b"%x\r\n" % len(PIECE))
                w.write(PIECE)
                w.write(b"\r\n")
            else:
                w.write(PIECE)
            await w.drain()  # raises once the gateway has closed its end
            sent += len(PIECE)
            engine.sent = sent

    return write


ERROR_START = b'{"error":{"message":"'  # then 1 GiB of message


@dataclass(frozen=True)
class Flood:
    id: str
    stream: bool
    writer: Writer
    status: tuple[int, ...]
    ending: str  # "json": an OpenAI error body; "error": a 200 stream ending with an error event and [DONE]
    says: bytes  # in the client's answer


FLOODS = [
    Flood("a-1gib-content-length", False, flood(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                                b"Content-Length: %d\r\n\r\n" % GiB, chunked=False), (502,), "json",
          b"larger than the gateway's limit"),
    Flood("b-1gib-error-body", False, flood(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                                            b'Content-Length: %d\r\n\r\n%s' % (GiB + len(ERROR_START), ERROR_START),
                                            chunked=False),
          (500, 502), "json", b"upstream returned HTTP 500"),  # the first 64 KiB are no JSON
    Flood("c-1gib-until-close", False, flood(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n",
                                             chunked=False), (502,), "json", b"larger than the gateway's limit"),
    Flood("d-endless-sse-event", True, flood(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                             b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n", chunked=True),
          (200,), "error", b"an event larger than"),
    Flood("e-chunk-size-minus-6", False, flood(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                               b"Transfer-Encoding: chunked\r\n\r\n-6\r\n", chunked=False),
          (502,), "json", b"upstream_error"),
]

MAX_RSS = 200 * MiB


def rss(pid: int, field: str = "VmRSS") -> int:
    """VmRSS: resident now; VmHWM: the most the process ever had resident (catches a peak between samples)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def sample_rss(pid: int, out: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        out.append(rss(pid))
        await asyncio.sleep(0.05)


async def poll_healthz(url: str, out: list[float], stop: asyncio.Event) -> None:
    """GET /healthz on a fresh connection each time; each one's latency, connect included."""
    while not stop.is_set():
        t = time.perf_counter()
        a = await exchange(url, b"GET /healthz HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n", 5.0)
        out.append(time.perf_counter() - t)
        assert a.status == 200
        await asyncio.sleep(0.01)


# /healthz on a fresh connection, while an engine floods the gateway. On a quiet 2-core machine every one
# answered within 34 ms (p50 ~1.5 ms); with other jobs on those cores single answers took up to 0.9 s while
# the gateway used 0.13 s of CPU in all, so the maximum alone is the machine's, not the gateway's: the 95th
# percentile is held to 50 ms, the maximum to 250 ms, and a run the machine starved is retried.
HEALTHZ_P95_S = 0.050
HEALTHZ_MAX_S = 0.250
# The gateway stops reading after 64 MiB at most; measured: <= 0.1 s of CPU (10 ms ticks), 0.00 s for the
# endless event. Relaying the whole GiB would cost seconds (the old relay: 19 s for 250 MB).
CPU_BUDGET_S = 0.5


@pytest.mark.flaky(reruns=2)  # only the latency bounds depend on machine load; memory and CPU do not
@pytest.mark.parametrize("case", FLOODS, ids=[f.id for f in FLOODS])
async def test_flood_bounded_memory_and_live_healthz(tmp_path, case: Flood):
    engine = await RawEngine().start()
    path = tmp_path / "gw.toml"
    path.write_text(to_toml(gateway_config([{"id": "raw", "engine": "openai", "url": engine.url, "models": ["m"]}],
                                           health={"interval_s": 0.5})))
    gw = await gateway_proc(path, log=tmp_path / "gw.log").start()
    try:
        pid = gw.proc.pid
        rss0 = rss(pid)
        stop = asyncio.Event()
        rss_seen: list[int] = []
        lat: list[float] = []
        tasks = [asyncio.create_task(sample_rss(pid, rss_seen, stop)),
                 asyncio.create_task(poll_healthz(gw.url, lat, stop))]
        await asyncio.sleep(0.2)  # the pollers have a baseline before the flood
        engine.set(case.writer)
        cpu0 = cpu_s(pid)
        t0 = time.perf_counter()
        a = await raw_chat(gw.url, case.stream, timeout=30.0)
        took = time.perf_counter() - t0
        await asyncio.sleep(0.3)  # the engine's writer stops, the pollers see the gateway after the flood
        cpu = cpu_s(pid) - cpu0
        stop.set()
        await asyncio.gather(*tasks)
        peak = rss(pid, "VmHWM")
        engine.set(good, hostile=False)
        async with oai(gw.url) as client:
            assert await chat_ok(client, case.stream) == CONTENT, "the backend works again for the next request"
        p95 = statistics.quantiles(lat, n=20)[18]
        figures = (f"{case.id}: status {a.status} in {took:.2f} s, engine sent {engine.sent / MiB:.0f} MiB, rss "
                   f"{rss0 / MiB:.0f} -> max {max(rss_seen) / MiB:.0f} MiB (VmHWM {peak / MiB:.0f}), cpu {cpu:.2f} s, "
                   f"healthz n={len(lat)} p50 {statistics.median(lat) * 1e3:.1f} p95 {p95 * 1e3:.1f} "
                   f"max {max(lat) * 1e3:.1f} ms")
        print(figures)
        assert a.status in case.status, (figures, a.body[:300])
        if case.ending == "json":
            a.error()
        else:
            assert stream_ending(a.body) == "error", a.body[-300:]
            error_event(a.body)
        assert case.says in a.body, a.body[-300:]
        assert max(rss_seen) < MAX_RSS and peak < MAX_RSS, figures
        assert engine.sent < 256 * MiB, ("the gateway stopped reading long before 1 GiB", figures)
        assert p95 < HEALTHZ_P95_S and max(lat) < HEALTHZ_MAX_S, figures
        assert cpu < CPU_BUDGET_S, figures
    finally:
        await gw.stop()
        await engine.stop()
