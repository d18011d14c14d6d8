"""One request as the front read it, and the way its reply goes back: a whole reply, or a stream of events."""

from __future__ import annotations

from http import HTTPStatus
from typing import Final, Iterable, Mapping

import orjson

from gateway.apis.api import OPENAI_ERRORS, Api, ErrorShape
from gateway.errors import GatewayError
from gateway.http.wire import Wire

Headers = dict[str, str] | Iterable[tuple[str, str]]
# Bodies larger than this go out in a write of their own rather than copied behind the head.
_JOIN_LIMIT: Final = 64 * 1024
CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


STATUS_LINES: Final = {s.value: _status_line(s.value) for s in HTTPStatus}


def head(status: int, headers: Headers, extra: str) -> bytes:
    """A reply head. Every value in it is the gateway's own or was checked where it came in (see headers.py)."""
    pairs = headers.items() if isinstance(headers, dict) else headers
    lines = "".join([f"{k}: {v}\r\n" for k, v in pairs])
    return (STATUS_LINES.get(status) or _status_line(status)) + f"{lines}{extra}\r\n".encode("latin-1")


def error_reply(err: GatewayError, request_id: str, *, head_only: bool = False,
                errors: ErrorShape | None = None) -> bytes:
    """A whole error reply for a request the front refuses before anyone serves it, in the shape of the API it was
    for (`errors`; OpenAI's when none); the connection then ends (a reply to HEAD has no body, though its length is
    given). Like every reply it says its request id, and why (no backend was tried: no x-shapegate-backend)."""
    shape = errors if errors is not None else OPENAI_ERRORS
    body = shape.body(err, request_id)
    extra = (f"Content-Type: application/json\r\nx-request-id: {request_id}\r\n"
             f"x-shapegate-reason: {err.code or 'refused'}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n")
    return head(shape.status_of(err), err.headers, extra) + (b"" if head_only else body)


def too_large(limit: int, length: int | None = None) -> GatewayError:
    size = f" ({length} bytes)" if length is not None else ""
    return GatewayError(413, f"The request body{size} exceeds the limit of {limit} bytes.", code="request_too_large")


def _has_content_type(headers: Headers) -> bool:
    if isinstance(headers, dict):
        return "content-type" in headers or "Content-Type" in headers
    return any(k.lower() == "content-type" for k, _ in headers)


class FrontExchange:
    """One request read by a FrontConnection; the API handler answers through it (the routing's Exchange).

    The body accumulates here as the parser hands it over, never more than the body limit of it.
    """

    __slots__ = ("conn", "method", "api", "target", "headers", "content_length", "chunked", "keep_alive",
                 "http10", "expect_continue", "parts", "size", "limit", "complete", "error", "done", "started",
                 "status")

    def __init__(self, conn: Wire, method: str, api: Api | None, target: str,
                 headers: dict[str, str], content_length: int | None, chunked: bool, keep_alive: bool,
                 http10: bool, expect_continue: bool, limit: int) -> None:
        self.conn = conn
        self.method = method
        self.api = api  # the API route of the path (None: another route, served by aiohttp)
        self.target = target
        self.headers = headers
        self.content_length = content_length
        self.chunked = chunked
        self.keep_alive = keep_alive
        self.http10 = http10
        self.expect_continue = expect_continue
        self.parts: list[bytes] = []
        self.size = 0
        self.limit = limit
        self.complete = False  # the whole body has been read (or there is none)
        self.error: GatewayError | None = None  # why the body cannot be had (too large, too slow)
        self.done = False  # the whole reply has been written
        self.started = False  # some of it has
        self.status = 0

    # -- the body ----------------------------------------------------------------------------------
    def add_body(self, data: bytes) -> None:
        if self.error is not None:
            return  # refused already: the rest is dropped, not kept
        self.size += len(data)
        if self.size > self.limit:
            self.parts = []
            self.error = too_large(self.limit)
            return
        self.parts.append(data)

    async def read(self) -> bytes:
        """The whole body, once it is in (within body_timeout_s); raises its error (413, 408)."""
        if self.error is None and not self.complete:
            if self.expect_continue:
                self.expect_continue = False
                self.conn.send_now(CONTINUE)
            await self.conn.body_arrives()
        if self.error is not None:
            raise self.error
        parts = self.parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # -- the reply ---------------------------------------------------------------------------------
    def reply(self, status: int, headers: Headers, body: bytes, lines: str = "") -> FrontExchange:
        """A whole reply; `lines` are header lines rendered already (`name: value\\r\\n` each)."""
        extra = lines if _has_content_type(headers) else lines + "Content-Type: application/json\r\n"
        extra += f"Content-Length: {len(body)}\r\nDate: {self.conn.dates.now()}\r\n"
        if not self.keep_alive or not self.complete:
            self.keep_alive = False
            extra += "Connection: close\r\n"  # an unread body is not read: the connection ends instead
        elif self.http10:
            extra += "Connection: keep-alive\r\n"
        self.status = status
        data = head(status, headers, extra)
        if self.method == "HEAD":
            self.conn.send_now(data)
        elif len(body) > _JOIN_LIMIT:
            self.conn.send_now(data)
            self.conn.send_now(body)
        else:
            self.conn.send_now(data + body)
        self.started = self.done = True
        return self

    async def open_stream(self, headers: Mapping[str, str], lines: str = "") -> FrontStream:
        return FrontStream(self, headers, lines)


class FrontStream:
    """A 200 event stream, chunked (HTTP/1.0: delimited by the end of the connection); the head goes out with
    the first events in one write."""

    __slots__ = ("ex", "head", "status", "chunked")

    def __init__(self, ex: FrontExchange, headers: Mapping[str, str], lines: str = "") -> None:
        self.ex = ex
        self.status = ex.status = 200
        self.chunked = not ex.http10
        h = {k: v for k, v in headers.items() if k.lower() != "content-type"}
        extra = f"{lines}Content-Type: text/event-stream\r\nCache-Control: no-cache\r\nDate: {ex.conn.dates.now()}\r\n"
        if self.chunked:
            extra += "Transfer-Encoding: chunked\r\n"
        else:
            ex.keep_alive = False
            extra += "Connection: close\r\n"
        self.head = head(200, h, extra)

    def _frame(self, data: bytes, last: bool) -> bytes:
        if self.chunked:
            frame = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
            if last:
                frame += b"0\r\n\r\n"
        else:
            frame = data
        if self.head:
            frame, self.head = self.head + frame, b""
            self.ex.started = True
        return frame

    @property
    def writable(self) -> bool:
        """Whether a write goes out now with nothing to wait for: the client is there and keeps up."""
        conn = self.ex.conn
        return not (conn.write_paused or conn.closed or self.ex.done)

    def write_now(self, data: bytes, last: bool = False) -> None:
        """write() (last: write_eof()) from a callback, when `writable`: the next wait of the stream's task is the
        one that meets a client that stopped reading."""
        if last:
            if self.ex.done:
                return
            self.ex.done = True
        elif not data:
            return
        self.ex.conn.send_now(self._frame(data, last))

    async def write(self, data: bytes) -> None:
        if data:
            conn = self.ex.conn
            conn.send_now(self._frame(data, False))
            if conn.write_paused:  # (conn.send, without a coroutine per write while the client keeps up)
                await conn.drained()

    async def write_eof(self, data: bytes = b"") -> None:
        if self.ex.done:
            return  # the body has ended already (as aiohttp's write_eof, a second call does nothing)
        self.ex.done = True
        await self.ex.conn.send(self._frame(data, True))


INTERNAL_ERROR: Final = orjson.dumps({"error": {"message": "The gateway failed to process the request.",
                                         "type": "server_error", "param": None, "code": "internal_error"}})
