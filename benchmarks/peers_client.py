"""The peers benchmark's load client: keep-alive raw-socket workers timing each request, its first token, its chunks."""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools
import orjson
import uvloop

BODIES = {
    "nonstream": {"model": "bench", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16},
    "stream": {"model": "bench", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 200,
               "stream": True, "stream_options": {"include_usage": True}},
}
TIMEOUT_S = 30.0  # one request that takes longer counts as an error, so a stuck target cannot hang a run
# With --rate, a request sent this much after its slot counts as late: every worker was still busy (the loop's
# timers have a resolution of 1 ms, so a start up to that late is on time).
LATE_S = 0.002


def has_content(event: bytes) -> bool:
    """Whether an SSE data event carries generated text (the role event's empty content does not count)."""
    i = event.find(b'"content":')
    if i < 0:
        return False
    rest = event[i + 10:].lstrip(b" ")
    return rest[:1] == b'"' and rest[1:2] != b'"'


@dataclass
class Done:
    """One finished request: when it started and ended, its first token, the events and tokens it carried."""
    start: float
    end: float
    ok: bool
    ttft: float | None = None
    events: int = 0
    tokens: int = 0
    error: str = ""


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time; responses parsed by llhttp."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Done] | None = None
        self.closed = False
        self.stream, self.sse, self.done_seen = False, b"", False
        self.rec = Done(0.0, 0.0, False)
        self.status, self.keep_alive = 0, True

    # -- asyncio ----------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._finish(False, f"malformed reply: {e}")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._finish(False, "connection closed mid-reply")

    # -- one request ------------------------------------------------------------------------------
    def request(self, payload: bytes, stream: bool) -> asyncio.Future[Done]:
        self.stream, self.sse, self.done_seen = stream, b"", False
        self.rec = Done(time.perf_counter(), 0.0, False)
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(payload)
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _finish(self, ok: bool, error: str = "") -> None:
        if self.waiter is None or self.waiter.done():
            return
        self.rec.end, self.rec.ok, self.rec.error = time.perf_counter(), ok, error
        self.waiter.set_result(self.rec)

    # -- llhttp callbacks -------------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if not self.stream:
            return
        buf = self.sse + body
        if b"\n\n" not in buf:
            self.sse = buf
            return
        *events, self.sse = buf.split(b"\n\n")
        rec = self.rec
        for ev in events:
            if not ev.startswith(b"data:"):
                continue
            if ev.startswith(b"data: [DONE]"):
                self.done_seen = True
                continue
            rec.events += 1
            if has_content(ev):
                rec.tokens += 1
                if rec.ttft is None:
                    rec.ttft = time.perf_counter() - rec.start

    def on_message_complete(self) -> None:
        if self.status != 200:
            self._finish(False, f"HTTP {self.status}")
        elif self.stream and not (self.done_seen and self.rec.tokens):
            self._finish(False, "stream without tokens or [DONE]")
        else:
            self._finish(True)
        if not self.keep_alive:
            self.close()


@dataclass
class Run:
    """What the workers share: the request, the measured window and what finished in it."""
    host: str
    port: int
    payload: bytes
    stream: bool
    measure_from: float
    stop_at: float
    rate: float = 0.0  # requests a second over all workers, at even intervals (0: each worker as fast as it can)
    start: float = 0.0  # when the schedule begins (the start of the warm-up)
    slot: int = 0  # the next request's place in that schedule
    late: int = 0  # requests of the window sent more than LATE_S after their slot
    done: list[Done] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    async def wait_turn(self) -> None:
        """Until the next slot of the schedule: a worker that comes late for it sends at once (and counts it)."""
        at = self.start + self.slot / self.rate
        self.slot += 1
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        elif delay < -LATE_S and self.measure_from <= at <= self.stop_at:
            self.late += 1

    def note(self, rec: Done) -> None:
        if not self.measure_from <= rec.end <= self.stop_at:
            return  # warm-up, or finished after the window closed
        if rec.ok:
            self.done.append(rec)
        else:
            self.errors[rec.error] = self.errors.get(rec.error, 0) + 1


async def worker(run: Run) -> None:
    loop = asyncio.get_running_loop()
    conn: Connection | None = None
    while time.perf_counter() < run.stop_at:
        if conn is None or conn.closed:
            try:
                _, conn = await loop.create_connection(Connection, run.host, run.port)
            except OSError as e:
                now = time.perf_counter()
                run.note(Done(now, now, False, error=f"connect: {e.strerror or e}"))
                conn = None
                await asyncio.sleep(0.01)  # a refused connect would otherwise spin
                continue
        if run.rate:
            await run.wait_turn()
            if time.perf_counter() >= run.stop_at:
                break
        try:
            rec = await asyncio.wait_for(conn.request(run.payload, run.stream), TIMEOUT_S)
        except TimeoutError:
            now = time.perf_counter()
            rec = Done(now - TIMEOUT_S, now, False, error="timeout")
            conn.close()
        run.note(rec)
    if conn is not None:
        conn.close()


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list, None when it is empty."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, max(0, int(q / 100 * len(sorted_values) + 0.5) - 1))]


def summary(run: Run, window_s: float, client_cpu_s: float) -> dict:
    lat = sorted((d.end - d.start) * 1e6 for d in run.done)
    ttft = sorted(d.ttft * 1e6 for d in run.done if d.ttft is not None)
    tokens = [d.tokens for d in run.done]
    return {"requests": len(run.done), "errors": sum(run.errors.values()), "error_kinds": run.errors,
            "window_s": window_s, "rps": len(run.done) / window_s,
            "p50_us": percentile(lat, 50), "p99_us": percentile(lat, 99),
            "ttft_p50_us": percentile(ttft, 50), "ttft_p99_us": percentile(ttft, 99),
            "tokens": sum(tokens), "tokens_per_s": sum(tokens) / window_s,
            "tokens_min": min(tokens, default=0), "tokens_max": max(tokens, default=0),
            "events": sum(d.events for d in run.done), "client_cpu_s": client_cpu_s,
            "rate": run.rate, "late_starts": run.late}


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def mark(word: str) -> None:
    """A line on stdout at a window edge: the orchestrator reads the target's CPU time when it sees it."""
    sys.stdout.write(word + "\n")
    sys.stdout.flush()


async def drive(url: str, kind: str, conc: int, seconds: float, warmup: float, key: str, rate: float = 0.0) -> dict:
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    body = orjson.dumps(BODIES[kind])
    payload = (f"POST {u.path or '/v1/chat/completions'} HTTP/1.1\r\nHost: {host}:{port}\r\n"
               f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    run = Run(host, port, payload, kind == "stream", start + warmup, start + warmup + seconds, rate, start=start)
    cpu: dict[str, float] = {}

    def edge(word: str) -> None:
        cpu[word] = own_cpu()
        mark(word)

    loop.call_later(warmup, edge, "measure")
    loop.call_later(warmup + seconds, edge, "stop")
    await asyncio.gather(*(worker(run) for _ in range(conc)))
    return summary(run, seconds, cpu.get("stop", own_cpu()) - cpu.get("measure", 0.0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8080/v1/chat/completions")
    p.add_argument("--kind", choices=sorted(BODIES), required=True)
    p.add_argument("--conc", type=int, required=True, help="workers, one keep-alive connection each")
    p.add_argument("--seconds", type=float, default=5.0, help="the measured window")
    p.add_argument("--warmup", type=float, default=1.0, help="load before the window, not counted")
    p.add_argument("--key", default="sk-bench-key")
    p.add_argument("--rate", type=float, default=0.0, help="requests a second over all workers, evenly spaced "
                   "(default: none, each worker sends its next request when the last one ends)")
    a = p.parse_args()
    result = uvloop.run(drive(a.url, a.kind, a.conc, a.seconds, a.warmup, a.key, a.rate))
    sys.stdout.write("RESULT " + orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
