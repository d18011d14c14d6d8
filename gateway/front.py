"""The gateway's own HTTP/1.1 server for the API routes; any other request is handed to aiohttp."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from email.utils import formatdate
from http import HTTPStatus

import orjson
from aiohttp import web

from gateway.app import serve_api
from gateway.pipeline import GATEWAY

log = logging.getLogger("shapegate")

# POST on these paths is served here. Anything else (dashboard, metrics, admin, other methods, HTTP/1.0,
# chunked request bodies, upgrades, malformed heads) goes to aiohttp together with its connection:
# aiohttp's server costs about 60 us of CPU per request on a 2-core machine, this one a fraction of it.
API_ROUTES = {b"/v1/chat/completions": "chat", b"/v1/completions": "completions", b"/v1/embeddings": "embeddings"}
MAX_HEAD = 64 * 1024  # a larger head goes to aiohttp, which refuses it properly
PIPELINED_HIGH = 1 << 20  # bytes of later requests buffered before reading pauses
INTERNAL_ERROR = orjson.dumps({"error": {"message": "The gateway failed to process the request.",
                                         "type": "server_error", "param": None, "code": "internal_error"}})


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


STATUS_LINES = {s.value: _status_line(s.value) for s in HTTPStatus}


def _head(status: int, headers: dict[str, str], extra: str) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (STATUS_LINES.get(status) or _status_line(status)) + f"{lines}{extra}\r\n".encode()


class FrontExchange:
    """One API request read by a FrontConnection; the pipeline answers through it (see pipeline.Exchange)."""

    __slots__ = ("conn", "route", "headers", "content_length", "keep_alive", "expect_continue", "consumed",
                 "done", "started", "status")

    def __init__(self, conn: FrontConnection, route: str, headers: dict[str, str], content_length: int | None,
                 keep_alive: bool, expect_continue: bool) -> None:
        self.conn = conn
        self.route = route
        self.headers = headers
        self.content_length = content_length
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.consumed = not content_length  # the body has been taken from the buffer
        self.done = False  # the whole response has been written
        self.started = False  # some of it has
        self.status = 0

    async def read(self) -> bytes:
        return await self.conn.read_body(self)

    def reply(self, status: int, headers: dict[str, str], body: bytes) -> FrontExchange:
        if not self.consumed:
            self.conn.skip_body(self)
        if "content-type" not in headers and "Content-Type" not in headers:
            headers["Content-Type"] = "application/json"
        extra = f"Content-Length: {len(body)}\r\nDate: {self.conn.front.date()}\r\n"
        if not self.keep_alive or not self.consumed:
            extra += "Connection: close\r\n"  # an unread body is not read: the connection ends instead
        self.status = status
        self.conn.send_now(_head(status, headers, extra) + body)
        self.started = self.done = True
        return self

    async def open_stream(self, headers: dict[str, str]) -> FrontStream:
        return FrontStream(self, headers)


class FrontStream:
    """A 200 event stream in chunked encoding; the head goes out with the first events in one write."""

    __slots__ = ("ex", "head", "status")

    def __init__(self, ex: FrontExchange, headers: dict[str, str]) -> None:
        self.ex = ex
        self.status = 200
        ex.status = 200
        h = {k: v for k, v in headers.items() if k.lower() != "content-type"}
        self.head = _head(200, h, f"Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                                  f"Transfer-Encoding: chunked\r\nDate: {ex.conn.front.date()}\r\n")

    def _frame(self, data: bytes, last: bool) -> bytes:
        frame = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        if last:
            frame += b"0\r\n\r\n"
        if self.head:
            frame, self.head = self.head + frame, b""
            self.ex.started = True
        return frame

    async def write(self, data: bytes) -> None:
        if data:
            await self.ex.conn.send(self._frame(data, False))

    async def write_eof(self, data: bytes = b"") -> None:
        if self.ex.done:
            return  # the body has ended already (as aiohttp's write_eof, a second call does nothing)
        self.ex.done = True
        await self.ex.conn.send(self._frame(data, True))


class FrontConnection(asyncio.Protocol):
    """One client connection: requests one at a time (pipelined ones wait in the buffer)."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.loop = front.loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()  # grows in place: a large body arrives in many reads
        self.ex: FrontExchange | None = None  # the request in progress
        self.task: asyncio.Task | None = None
        self.need = 0  # buffered bytes a waiting body read needs
        self.body_waiter: asyncio.Future | None = None
        self.drain_waiter: asyncio.Future | None = None
        self.write_paused = False
        self.read_paused = False
        self.closed = False
        self.idle_since = 0.0

    # -- transport events ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.idle_since = self.loop.time()
        self.front.conns.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.front.conns.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: the pipeline aborts the engine's request
        gone = ConnectionResetError("the client closed the connection")
        for w in (self.body_waiter, self.drain_waiter):
            if w is not None and not w.done():
                w.set_exception(gone)

    def eof_received(self) -> bool:
        # The client closed its side: taken as the client leaving (aiohttp does the same). The transport
        # closes, connection_lost cancels the request, and a stream it left stops on the engine now
        # rather than after the next writes bounce.
        return False

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        w = self.drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.ex is None:
            self._next_request()
        elif self.body_waiter is not None:
            if len(self.buf) >= self.need and not self.body_waiter.done():
                self.body_waiter.set_result(None)
        elif self.ex.consumed and len(self.buf) > PIPELINED_HIGH and not self.read_paused:
            # Only requests pipelined behind this one wait in the buffer: bounded, and read again later.
            self.read_paused = True
            self.transport.pause_reading()

    # -- requests --------------------------------------------------------------------------------
    def _next_request(self) -> None:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                self._hand_over()
            return
        ex = self._parse_head(buf, end)
        if ex is None:
            self._hand_over()
            return
        del buf[:end + 4]
        self.ex = ex
        self.task = self.loop.create_task(self._serve(ex))

    def _parse_head(self, buf: bytes, end: int) -> FrontExchange | None:
        """The request if it is an API call this server takes, else None (aiohttp will take it)."""
        first = buf.find(b"\r\n", 0, end)
        if first < 0:
            first = end
        parts = buf[:first].split(b" ")
        if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
            return None
        target = bytes(parts[1])
        q = target.find(b"?")
        route = API_ROUTES.get(target if q < 0 else target[:q])
        if route is None:
            return None
        headers: dict[str, str] = {}
        if first < end:
            for line in buf[first + 2:end].decode("latin-1").split("\r\n"):
                k, sep, v = line.partition(":")
                if not sep or not k or k[-1] in " \t":
                    return None
                name = k.lower()
                value = v.strip(" \t")
                if name in headers:
                    if name == "content-length":
                        return None
                    value = f"{headers[name]}, {value}"
                headers[name] = value
        if "transfer-encoding" in headers or "upgrade" in headers:
            return None
        length: int | None = None
        cl = headers.get("content-length")
        if cl is not None:
            if not (cl.isascii() and cl.isdigit()):
                return None
            length = int(cl)
        return FrontExchange(self, route, headers, length, "close" not in headers.get("connection", "").lower(),
                             headers.get("expect", "").lower() == "100-continue")

    async def read_body(self, ex: FrontExchange) -> bytes:
        n = ex.content_length or 0
        if len(self.buf) < n:
            if ex.expect_continue:
                ex.expect_continue = False
                self.send_now(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.need = n
            self.body_waiter = self.loop.create_future()
            try:
                await self.body_waiter
            finally:
                self.body_waiter = None
        body = bytes(self.buf[:n])
        del self.buf[:n]
        ex.consumed = True
        return body

    def skip_body(self, ex: FrontExchange) -> None:
        """Drop the body of a request answered without reading it, if it is all here (else the
        connection ends after the answer rather than read a body nobody wants)."""
        n = ex.content_length or 0
        if len(self.buf) >= n:
            del self.buf[:n]
            ex.consumed = True

    async def _serve(self, ex: FrontExchange) -> None:
        try:
            await serve_api(self.front.g, ex, ex.route)
        except (asyncio.CancelledError, ConnectionError):
            self._close()  # the client left (or the shutdown cut it)
            return
        except Exception:
            log.exception("unexpected error on %s", ex.route)
            if not ex.started and not self.closed:
                ex.keep_alive = False
                ex.reply(500, {}, INTERNAL_ERROR)
            self._close()
            return
        self._finish(ex)

    def _finish(self, ex: FrontExchange) -> None:
        self.ex = self.task = None
        if not ex.done or not ex.keep_alive or not ex.consumed or self.front.closing:
            self._close()
            return
        self.idle_since = self.loop.time()
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        if self.buf:
            self._next_request()

    def _hand_over(self) -> None:
        """From now on aiohttp serves this connection, starting with the bytes already received."""
        self.front.conns.discard(self)
        handler = self.front.aiohttp_factory()
        transport = self.transport
        transport.set_protocol(handler)
        handler.connection_made(transport)
        data = bytes(self.buf)
        self.buf.clear()
        if data:
            handler.data_received(data)

    # -- writing ---------------------------------------------------------------------------------
    def send_now(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def send(self, data: bytes) -> None:
        """Write, then wait while the client reads slower than the engine writes."""
        self.send_now(data)
        if self.write_paused:
            self.drain_waiter = self.loop.create_future()
            try:
                await self.drain_waiter
            finally:
                self.drain_waiter = None

    def _close(self) -> None:
        if not self.closed:
            self.transport.close()  # what was written still goes out first


class Front:
    """The listening socket: a FrontConnection per client, aiohttp's server behind it for the rest."""

    def __init__(self, runner: web.AppRunner) -> None:
        self.runner = runner
        self.g = runner.app[GATEWAY]
        self.loop = asyncio.get_running_loop()
        self.aiohttp_factory = runner.server  # makes one aiohttp protocol per handed-over connection
        self.conns: set[FrontConnection] = set()
        self.closing = False
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self._date = ("", -1)

    async def start(self, host: str, port: int, reuse_port: bool = False, backlog: int = 1024) -> None:
        self._server = await self.loop.create_server(lambda: FrontConnection(self), host, port,
                                                     reuse_address=True, reuse_port=reuse_port or None,
                                                     backlog=backlog)
        self._sweeper = asyncio.create_task(self._sweep(), name="keepalive-sweep")

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    def date(self) -> str:
        """The Date header, formatted once a second."""
        now = int(time.time())
        if self._date[1] != now:
            self._date = (formatdate(now, usegmt=True), now)
        return self._date[0]

    async def _sweep(self) -> None:
        """Close keep-alive connections idle for longer than [server] keepalive_s (a head that never
        completes counts as idle, so a client trickling one in is closed too)."""
        while True:
            keepalive_s = self.g.cfg.server.keepalive_s
            await asyncio.sleep(min(max(keepalive_s / 5, 0.05), 15.0))
            cutoff = self.loop.time() - keepalive_s
            for c in [c for c in self.conns if c.ex is None and c.idle_since < cutoff]:
                c._close()

    async def close(self, timeout: float) -> None:
        """Stop accepting, close idle keep-alive connections, let requests in flight finish (within
        `timeout`), then stop aiohttp's side and the application (its cleanup closes the upstream pools)."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        deadline = self.loop.time() + timeout
        while True:
            for c in [c for c in self.conns if c.ex is None]:
                c._close()
            if not self.conns or self.loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            if c.transport is not None:
                c.transport.abort()
        await self.runner.cleanup()


async def start_serving(app: web.Application, host: str, port: int, *, reuse_port: bool = False,
                        shutdown_timeout: float = 60.0) -> Front:
    """Serve `app` on host:port; `await front.close(timeout)` stops it."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout,
                           keepalive_timeout=app[GATEWAY].cfg.server.keepalive_s)
    await runner.setup()
    front = Front(runner)
    try:
        await front.start(host, port, reuse_port=reuse_port)
    except BaseException:
        await runner.cleanup()
        raise
    return front
