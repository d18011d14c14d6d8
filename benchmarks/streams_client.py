"""Opens N streams at a steady pace and holds them to their end; prints one JSON summary (raw asyncio, uvloop)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import orjson
import uvloop

BODY = orjson.dumps({"model": "bench", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4096,
                     "stream": True})


class Stream(asyncio.Protocol):
    def __init__(self, request: bytes, done: asyncio.Future) -> None:
        self.request, self.done = request, done
        self.status: int | None = None
        self.tokens = 0
        self.tail = b""
        self.finished = False

    def connection_made(self, transport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.status is None:
            self.status = int(data[9:12]) if data.startswith(b"HTTP/1.1 ") else -1
        self.tokens += data.count(b"tok ")
        self.tail = (self.tail + data)[-64:]
        if self.tail.endswith(b"0\r\n\r\n") and b"[DONE]" in self.tail:
            self.finished = True
            if not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def run(host: str, port: int, n: int, rate: float, key: str) -> dict:
    loop = asyncio.get_running_loop()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Authorization: Bearer {key}\r\nContent-Length: {len(BODY)}\r\n\r\n").encode() + BODY
    streams: list[tuple[Stream, asyncio.Future]] = []
    connect_errors: list[str] = []
    t0 = time.monotonic()
    for i in range(n):
        done = loop.create_future()
        try:
            _, proto = await loop.create_connection(lambda: Stream(request, done), host, port)
            streams.append((proto, done))
        except OSError as e:
            connect_errors.append(type(e).__name__)
        lag = t0 + (i + 1) / rate - time.monotonic()
        if lag > 0:
            await asyncio.sleep(lag)
    print(orjson.dumps({"event": "all_open", "open": len(streams), "seconds": time.monotonic() - t0}).decode(),
          flush=True)
    await asyncio.gather(*(d for _, d in streams))
    statuses: dict[str, int] = {}
    for s, _ in streams:
        statuses[str(s.status)] = statuses.get(str(s.status), 0) + 1
    return {"event": "summary", "requested": n, "opened": len(streams), "connect_errors": len(connect_errors),
            "completed": sum(1 for s, _ in streams if s.finished), "statuses": statuses,
            "tokens": sum(s.tokens for s, _ in streams), "seconds": time.monotonic() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--streams", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=500.0, help="new streams per second")
    p.add_argument("--key", required=True)
    a = p.parse_args()
    summary = uvloop.run(run(a.host, a.port, a.streams, a.rate, a.key))
    print(orjson.dumps(summary).decode(), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
