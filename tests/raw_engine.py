"""A raw engine for hostile-engine tests: replies written byte by byte, every connection and request recorded."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Awaitable, Callable
from urllib.parse import urlsplit

import httptools
import openai
import orjson

from tests.gateway_harness import USER_KEY
from tests.kit import until

MSG = [{"role": "user", "content": "hi"}]
CONTENT = "hello world"
MiB = 1 << 20
GiB = 1 << 30

# -- what an engine says: the good reply, and the bytes that make up the bad ones -----------------------

JSON_BODY = orjson.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": CONTENT}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})


def _event(delta: dict, finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"


SSE_EVENTS = [_event({"role": "assistant", "content": ""}), _event({"content": CONTENT}), _event({}, "stop"),
              b"data: [DONE]\n\n"]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def body_of(stream: bool) -> bytes:
    return b"".join(SSE_EVENTS) if stream else JSON_BODY


def head(stream: bool, *fields: bytes, status: bytes = b"200 OK") -> bytes:
    ctype = b"text/event-stream" if stream else b"application/json"
    lines = [b"HTTP/1.1 " + status, b"Content-Type: " + ctype, *fields]
    return b"".join(line + b"\r\n" for line in lines) + b"\r\n"


def cl_reply(stream: bool, *fields: bytes, status: bytes = b"200 OK") -> bytes:
    """A whole reply framed by Content-Length, with extra header lines."""
    body = body_of(stream)
    return head(stream, *fields, b"Content-Length: %d" % len(body), status=status) + body


def good(stream: bool) -> bytes:
    """What a well-behaved engine sends: a stream is chunked, one event a chunk; a JSON reply has a length."""
    if not stream:
        return cl_reply(False)
    return head(True, b"Transfer-Encoding: chunked") + b"".join(chunk(e) for e in SSE_EVENTS) + b"0\r\n\r\n"


def bad_chunk(size_line: bytes) -> Callable[[bool], bytes]:
    """A chunked reply whose first chunk-size line is `size_line` (the body follows as if it were right)."""
    return lambda s: head(s, b"Transfer-Encoding: chunked") + size_line + b"\r\n" + body_of(s) + b"\r\n0\r\n\r\n"


def with_fields(*fields: bytes) -> Callable[[bool], bytes]:
    return lambda s: cl_reply(s, *fields)


Writer = Callable[[asyncio.StreamWriter, bool, "RawEngine"], Awaitable[None]]
Reply = Callable[[bool], bytes] | Writer


async def empty_then_close(w: asyncio.StreamWriter, stream: bool, engine: "RawEngine") -> None:
    w.close()


async def huge_chunk_size_then_close(w: asyncio.StreamWriter, stream: bool, engine: "RawEngine") -> None:
    w.write(head(stream, b"Transfer-Encoding: chunked") + b"f" * 15 + b"\r\n")  # 2**60 bytes announced, none sent
    await w.drain()
    w.close()


async def head_trickled_forever(w: asyncio.StreamWriter, stream: bool, engine: "RawEngine") -> None:
    # One header value growing a byte every 10 ms: far under the 64 KiB head limit when the gateway's
    # first-byte deadline (1 s here) runs out, so only that deadline can end it.
    w.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    for _ in range(3000):
        w.write(b"a")
        await w.drain()
        await asyncio.sleep(0.01)


async def head_over_limit_in_pieces(w: asyncio.StreamWriter, stream: bool, engine: "RawEngine") -> None:
    # 100 KB of head in 4 KiB pieces, each its own read on the gateway's side.
    w.write(b"HTTP/1.1 200 OK\r\nX-Big: ")
    for _ in range(25):
        w.write(b"a" * 4096)
        await w.drain()
        await asyncio.sleep(0.002)
    w.write(b"\r\n" + cl_reply(stream).split(b"\r\n", 1)[1])
    await w.drain()


async def good_then_late_reply(w: asyncio.StreamWriter, stream: bool, engine: "RawEngine") -> None:
    # A second, unasked-for reply after the first, while the gateway holds the connection idle: were it
    # reused, a later request could be answered with bytes meant for no one.
    w.write(good(stream))
    await w.drain()
    await asyncio.sleep(0.05)
    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nSTALE")
    await w.drain()


async def first_event_then_bad_chunk(w: asyncio.StreamWriter, stream: bool, engine: "RawEngine") -> None:
    """Output first, then (in a later read) broken framing: a stream has been committed to the client by then."""
    first = SSE_EVENTS[0] + SSE_EVENTS[1] if stream else JSON_BODY[:60]
    w.write(head(stream, b"Transfer-Encoding: chunked") + chunk(first))
    await w.drain()
    await asyncio.sleep(0.05)
    w.write(b"-6\r\nxxxxxx\r\n")
    await w.drain()


# -- a raw engine, and a raw client -----------------------------------------------------------------------

PROBE_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


@dataclass
class EngineConn:
    answers: list[str] = field(default_factory=list)  # what each POST on it got: "good" or "hostile"
    closed: asyncio.Event = field(default_factory=asyncio.Event)


def stream_asked(body: bytes) -> bool:
    """Whether a request body asks for a stream (a form or an empty body asks for none)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and data.get("stream") is True


class RawEngine:
    """An "openai" engine on a bare socket: every GET (the probes) gets an empty 200, every POST exactly
    the bytes of `reply` (or whatever its writer sends); it counts the connections it accepted."""

    def __init__(self) -> None:
        self.reply: Reply = good
        self.hostile = False
        self.conns: list[EngineConn] = []
        self.sent = 0  # body bytes a writer got out (the flood writers count theirs)
        self.busy = 0  # POSTs being answered
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> "RawEngine":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def set(self, reply: Reply, hostile: bool = True) -> None:
        self.reply, self.hostile = reply, hostile

    def post_conns(self, answer: str) -> list[EngineConn]:
        return [c for c in self.conns if answer in c.answers]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = EngineConn()
        self.conns.append(conn)
        self._tasks.add(asyncio.current_task())
        self._writers.add(writer)
        try:
            while True:
                line = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for h in line.split(b"\r\n"):
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":")[1])
                body = await reader.readexactly(length)
                if line.startswith(b"GET "):
                    writer.write(PROBE_OK)
                    await writer.drain()
                    continue
                stream = stream_asked(body)
                reply = self.reply
                conn.answers.append("hostile" if self.hostile else "good")
                self.busy += 1
                try:
                    if inspect.iscoroutinefunction(reply):
                        await reply(writer, stream, self)
                    else:
                        writer.write(reply(stream))
                        await writer.drain()
                finally:
                    self.busy -= 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the gateway dropped the connection (or the row closed it)
        except asyncio.CancelledError:
            pass  # stop() gave up waiting; ending quietly spares asyncio's "exception never retrieved" noise
        finally:
            conn.closed.set()
            writer.transport.abort()
            self._writers.discard(writer)
            self._tasks.discard(asyncio.current_task())

    async def settled(self) -> None:
        """Until every answer is written and has had time to reach the gateway: a late reply must not be
        taken for the answer to the test's next request (HTTP/1.1 cannot tell them apart)."""
        await until(lambda: self.busy == 0, "every answer written")
        await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self.server.close()
        for w in list(self._writers):
            w.transport.abort()
        # An aborted connection ends each handler at its next read or drain.
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=2)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending)
        await self.server.wait_closed()


@dataclass
class Answer:
    status: int
    head: bytes  # the reply head exactly as the gateway wrote it
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict:
        err = orjson.loads(self.body)["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"] and err["type"], err
        return err


class _Collect:
    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.done = True


async def exchange(url: str, request: bytes, timeout: float = 15.0) -> Answer:
    """One request on its own connection; the reply read with a strict parser, bounded in time (no hang)."""
    u = urlsplit(url)
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        try:
            writer.write(request)
            c = _Collect()
            p = httptools.HttpResponseParser(c)
            raw = b""
            while not c.done:
                data = await reader.read(65536)
                assert data, "the gateway closed the connection before the reply was complete"
                if b"\r\n\r\n" not in raw:
                    raw += data
                p.feed_data(data)
            return Answer(p.get_status_code(), raw.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n", c.headers,
                          b"".join(c.body))
        finally:
            writer.transport.abort()


async def raw_chat(url: str, stream: bool, timeout: float = 15.0) -> Answer:
    body = orjson.dumps({"model": "m", "messages": MSG, "stream": stream})
    return await exchange(url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer %s\r\n"
                               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                          % (USER_KEY.encode(), len(body), body), timeout)


def oai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=USER_KEY, max_retries=0, timeout=15.0)


async def chat_ok(client: openai.AsyncOpenAI, stream: bool) -> str:
    """A request that must work: the generated text."""
    if not stream:
        r = await client.chat.completions.create(model="m", messages=MSG)
        return r.choices[0].message.content
    parts = []
    async for ev in await client.chat.completions.create(model="m", messages=MSG, stream=True):
        if ev.choices and ev.choices[0].delta.content:
            parts.append(ev.choices[0].delta.content)
    return "".join(parts)


def assert_clean_head(head: bytes) -> None:
    """Every CR and LF of the client's reply head is a line end, and nothing an engine injected is in it."""
    assert head.count(b"\r") == head.count(b"\n") == head.count(b"\r\n"), head
    assert b"\x00" not in head and b"x-injected" not in head.lower() and b"x-engine" not in head.lower(), head


def error_event(body: bytes) -> dict:
    """The OpenAI error a stream ended with."""
    ev = next(e for e in body.split(b"\n\n") if e.startswith(b'data: {"error"'))
    err = orjson.loads(ev[5:])["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"] and err["type"], err
    return err


def stream_ending(body: bytes) -> str:
    if not body.endswith(b"data: [DONE]\n\n"):
        return "truncated"
    return "error" if b'data: {"error"' in body else "done"

