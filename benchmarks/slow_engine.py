"""An engine that streams one token every `--interval` seconds to any number of streams (raw asyncio, uvloop)."""

from __future__ import annotations

import argparse
import asyncio
import random

import orjson
import uvloop

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
BASE = {"id": "chatcmpl-slow", "object": "chat.completion.chunk", "created": 1, "model": "bench"}


def chunk(obj) -> bytes:
    data = b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


TOKEN = chunk({**BASE, "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]})
ROLE = chunk({**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
# SGLang's chunks: `"usage": null` in every one but the usage chunk (vLLM leaves the field out).
TOKEN_NULL_USAGE = chunk({**BASE, "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}],
                          "usage": None})


def ending(tokens: int) -> bytes:
    return (chunk({**BASE, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            + chunk({**BASE, "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": tokens,
                                                      "total_tokens": 8 + tokens}})
            + chunk(b"[DONE]") + b"0\r\n\r\n")


class SlowStream(asyncio.Protocol):
    """Each POST gets a stream of `tokens` tokens, one per interval, the first after a random offset (so that
    thousands of streams do not tick together)."""

    def __init__(self, tokens: int, interval: float, token: bytes = TOKEN) -> None:
        self.tokens, self.interval, self.token = tokens, interval, token
        self.buf = b""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower()
        i = head.find(b"content-length:")
        length = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else len(head)]) if i >= 0 else 0
        if len(self.buf) < end + 4 + length:
            return
        self.buf = self.buf[end + 4 + length:]
        if not head.startswith(b"post"):
            self.transport.write(HEALTH)
            return
        self.transport.write(HEAD + ROLE)
        self.timer = self.loop.call_later(random.uniform(0, self.interval), self._tick, 0)

    def _tick(self, sent: int) -> None:
        if self.transport.is_closing():
            return
        if sent == self.tokens:
            self.transport.write(ending(sent))
            self.timer = None
            return
        self.transport.write(self.token)
        self.timer = self.loop.call_later(self.interval, self._tick, sent + 1)


async def serve(port: int, tokens: int, interval: float, token: bytes = TOKEN) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: SlowStream(tokens, interval, token), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=60)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--null-usage", action="store_true", help='token chunks with "usage": null, as SGLang sends them')
    a = p.parse_args()
    uvloop.run(serve(a.port, a.tokens, a.interval, TOKEN_NULL_USAGE if a.null_usage else TOKEN))


if __name__ == "__main__":
    main()
