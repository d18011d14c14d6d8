"""A zero-delay OpenAI-style engine on raw asyncio (uvloop): the floor the gateway is measured against."""

from __future__ import annotations

import argparse
import asyncio

import orjson
import uvloop

MODEL = "bench"


def _nonstream_reply() -> bytes:
    text = " ".join(f"tok{i}" for i in range(16))
    body = orjson.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "created": 1, "model": MODEL,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24}})
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _stream_events(n: int) -> list[bytes]:
    def ev(obj) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    events = [ev({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None}]})]
    events += [ev({**base, "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]})
               for i in range(n)]
    events.append(ev({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
    events.append(ev({**base, "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n,
                                                        "total_tokens": 8 + n}}))
    events.append(b"data: [DONE]\n\n")
    return [_chunk(e) for e in events]


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


def _json_reply(obj: dict) -> bytes:
    body = orjson.dumps(obj)
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


# GET routes that routers in front of an engine read when they add it: the OpenAI model list, and SGLang's
# /server_info and /model_info (sglang-router asks for both; it reads model_path from them to load a tokenizer,
# so none is given: there is no tokenizer here to load). Any other GET answers an empty 200, as /health does.
GET_REPLIES = {
    b"/v1/models": _json_reply({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 1,
                                                            "owned_by": "bench"}]}),
    b"/server_info": _json_reply({"served_model_name": MODEL, "version": "bench"}),
    b"/model_info": _json_reply({"is_generation": True}),
}


class EngineProtocol(asyncio.Protocol):
    """Keep-alive HTTP/1.1: reads whole requests, answers each at once."""

    def __init__(self, nonstream: bytes, stream: bytes, stream_no_usage: bytes) -> None:
        self.buf = b""
        self.nonstream = nonstream
        self.stream = stream  # a whole streamed reply: head, chunked events and the last chunk
        self.stream_no_usage = stream_no_usage

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            length = 0
            if i >= 0:
                j = head.find(b"\r\n", i)
                length = int(head[i + 15:j if j > 0 else len(head)])
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            if head.startswith(b"pri * http/2"):  # an HTTP/2 (gRPC) probe: not spoken here, refused at once
                self.transport.close()
                return
            if not head.startswith(b"post"):
                path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
                self.transport.write(GET_REPLIES.get(path, HEALTH))
            elif b'"stream":true' in body or b'"stream": true' in body:
                self.transport.write(self.stream if b'"include_usage":true' in body
                                     or b'"include_usage": true' in body else self.stream_no_usage)
            else:
                self.transport.write(self.nonstream)


async def serve(host: str, port: int, chunks: int) -> None:
    loop = asyncio.get_running_loop()
    events = _stream_events(chunks)
    # One write per reply. Written event by event (200 send calls), a client on this process's core saw 1.35 ms of
    # first-token latency added by a gateway at c=1 against 0.47 ms on the gateway's core (2 cores): the engine's
    # own sending was in the measure. With one write, 0.45-0.50 ms wherever the client ran.
    stream, no_usage = (STREAM_HEAD + b"".join(evs) + b"0\r\n\r\n" for evs in (events, events[:-2] + events[-1:]))
    server = await loop.create_server(lambda: EngineProtocol(_nonstream_reply(), stream, no_usage), host, port,
                                      backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunks", type=int, default=200)
    a = p.parse_args()
    uvloop.run(serve(a.host, a.port, a.chunks))


if __name__ == "__main__":
    main()
