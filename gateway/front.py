"""The gateway's HTTP/1.1 server: every client byte is framed by llhttp (strict), every buffer bounded, every wait timed."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
from email.utils import formatdate

import httptools
from aiohttp import web

from gateway.app import serve_api
from gateway.errors import GatewayError, bad_request
from gateway.exchange import INTERNAL_ERROR, FrontExchange, error_reply, too_large
from gateway.headers import valid_request_id
from gateway.inner import InnerRoutes
from gateway.pipeline import GATEWAY

log = logging.getLogger("shapegate")

# POST on these paths runs the pipeline; every other request is served by aiohttp's routes (gateway/inner.py).
API_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
PIPELINED_HIGH = 1 << 20  # bytes of later requests buffered before reading pauses
# Fields a request may carry once: two Host headers, or two credentials, have no one meaning.
SINGLE = frozenset({"host", "authorization", "x-api-key", "content-length"})
# What a connection is doing. IDLE: waiting for a request's first byte; HEAD, BODY: reading one; SERVING: the
# request is read and its reply under way (later requests wait in the buffer); DRAIN: the reply is written
# but the client has not taken it yet; LINGER: the last reply is written and the connection is closing.
IDLE, HEAD, BODY, SERVING, DRAIN, LINGER = range(6)
# After a reply that ends a connection while the client may still be sending (a refused or unread body),
# what it sends is read and dropped this long, so that closing does not reset the connection (and the
# reply with it) before the client has read it.
LINGER_S = 2.0


class _StopParsing(Exception):
    """Raised in a parser callback to stop llhttp at once; carries the reply the client gets."""

    def __init__(self, error: GatewayError | None = None) -> None:
        super().__init__()
        self.error = error


def refusal(status: int, message: str, code: str) -> GatewayError:
    return GatewayError(status, message, code=code)


class FrontConnection(asyncio.Protocol):
    """One client connection: requests one at a time, read by llhttp; pipelined ones wait unparsed in the buffer.

    The parser is fed exactly one message at a time (a head ends at the first CRLFCRLF, which strict llhttp
    guarantees; a body's length is known once its head is read), so the bytes of the next request are never
    parsed before the current one is answered. Chunked bodies are the exception: bytes after one end the
    connection once the request is answered.
    """

    def __init__(self, front: Front) -> None:
        self.front = front
        self.loop = front.loop
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.parser = httptools.HttpRequestParser(self)
        self.buf = bytearray()  # received bytes not yet fed to the parser (a head: not yet complete)
        self.fed = 0  # bytes of a head in progress already fed
        self.phase = IDLE
        self.deadline = 0.0  # when the current wait ends (0: no limit)
        self.since = 0.0
        self.ex: FrontExchange | None = None
        self.task: asyncio.Task | None = None
        self.body_left = 0  # bytes of a Content-Length body still to feed
        self.body_waiter: asyncio.Future | None = None
        self.drain_waiter: asyncio.Future | None = None
        self.write_paused = False
        self.read_paused = False
        self.closed = False
        # The message being parsed (reset for each request).
        self.url = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.msg_done = False
        self.upgrade = False

    # -- transport events ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.since = now = self.loop.time()
        self.deadline = now + self.front.cfg.head_timeout_s  # a new connection owes a request head
        self.front.admit(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.front.forget(self)
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
        if self.phase == DRAIN:
            self._idle()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.phase >= SERVING:
            if self.phase == LINGER:
                return  # dropped: the connection is closing
            self.buf += data
            if len(self.buf) > PIPELINED_HIGH and not self.read_paused:
                # Only requests pipelined behind this one wait in the buffer: bounded, and read again later.
                self.read_paused = True
                self.transport.pause_reading()
            return
        self.buf += data
        try:
            self._advance()
        except Exception as e:  # never a traceback from here: it could quote what the client sent
            log.error("the front failed on a request: %s at %s", type(e).__name__, _where(e))
            self._refuse(refusal(500, "The gateway failed to read the request.", "internal_error"))

    # -- llhttp callbacks (a request's parts; no work beyond collecting them) -------------------------
    def on_message_begin(self) -> None:
        if self.msg_done:
            raise _StopParsing()  # a request after a chunked body in the same read: not parsed

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            return  # a trailer field after a chunked body: not used
        self.fields.append((name, value))
        if len(self.fields) > self.front.cfg.max_headers:
            raise _StopParsing(refusal(431, "The request has too many header fields.", "too_many_headers"))

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.ex.add_body(body)

    def on_message_complete(self) -> None:
        self.msg_done = True

    # -- reading requests ------------------------------------------------------------------------
    def _advance(self) -> None:
        """Feed the parser what the current phase may take of the buffer; start a request once its head is read."""
        while not self.closed:
            if self.phase == IDLE:
                while self.buf[:2] == b"\r\n":
                    del self.buf[:2]  # an empty line before a request is ignored (RFC 9112, 2.2)
                if not self.buf:
                    return
                self._begin_head()
            if self.phase == HEAD:
                if not self._read_head():
                    return
            elif self.phase == BODY:
                if not self.buf or not self._read_body():
                    return
            else:
                return

    def _begin_head(self) -> None:
        self.phase = HEAD
        self.url, self.fields = b"", []
        self.head_done = self.msg_done = self.upgrade = False
        self.fed = 0
        self.deadline = self.loop.time() + self.front.cfg.head_timeout_s
        self.front.reading(self)

    def _feed(self, start: int, stop: int) -> bool:
        """Feed buf[start:stop] to llhttp; a malformed request is answered here and the connection ends."""
        view = memoryview(self.buf)[start:stop]
        error: httptools.HttpParserError | None = None
        try:
            self.parser.feed_data(view)
        except httptools.HttpParserUpgrade:
            self.upgrade = True  # the head is read; llhttp leaves what follows unparsed
        except httptools.HttpParserError as e:
            error = e
        finally:
            view.release()  # before the buffer changes size
        if error is None:
            return True
        stop_ = error.__context__ if isinstance(error.__context__, _StopParsing) else None
        if stop_ is not None and stop_.error is None:
            if self.ex is not None:
                self.ex.keep_alive = False  # bytes after a chunked body: answered, then the connection ends
            return True
        # llhttp's reasons are fixed texts: nothing of the request is quoted back.
        self._refuse(stop_.error if stop_ is not None else
                     refusal(400, f"Malformed HTTP request: {error}.", "bad_http_request"))
        return False

    def _read_head(self) -> bool:
        buf = self.buf
        limit = self.front.cfg.max_head_bytes
        end = buf.find(b"\r\n\r\n", max(0, self.fed - 3))
        if end < 0 or end + 4 > limit:
            if len(buf) > limit or end >= 0:
                self._refuse(refusal(431, f"The request head exceeds {limit} bytes.", "request_head_too_large"))
                return False
            # Incomplete: fed now all the same, so that a malformed head is refused at once, not at the timeout.
            if self._feed(self.fed, len(buf)):
                self.fed = len(buf)
            return False
        if not self._feed(self.fed, end + 4):
            return False
        del buf[:end + 4]
        if not self.head_done:
            self._refuse(refusal(400, "Malformed HTTP request head.", "bad_http_request"))
            return False
        return self._start_request()

    def _read_body(self) -> bool:
        ex = self.ex
        n = len(self.buf) if ex.chunked else min(self.body_left, len(self.buf))
        if not self._feed(0, n):
            return False
        if ex.chunked and not ex.keep_alive and self.msg_done:
            self.buf.clear()  # bytes after a chunked body: dropped with the connection
        else:
            del self.buf[:n]
            self.body_left -= n
        if self.msg_done:
            self._request_read()
            return True
        if ex.error is not None:
            self._wake_body()  # too large: the reader answers 413 now
        return False

    def _wake_body(self) -> None:
        w = self.body_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _request_read(self) -> None:
        """The whole request is in: the reply may start, the body's reader wakes."""
        self.ex.complete = True
        self.phase = SERVING
        self.deadline = 0.0
        self.front.served(self)
        self._wake_body()

    def _start_request(self) -> bool:
        """The head is read: check it as a whole, make the exchange, start its task. False when refused."""
        p = self.parser
        version = p.get_http_version()
        if version not in ("1.1", "1.0"):
            self._refuse(refusal(505, f"HTTP/{version} is not supported.", "http_version_not_supported"))
            return False
        headers: dict[str, str] = {}
        for k, v in self.fields:
            name = k.decode("latin-1").lower()
            value = v.decode("latin-1").strip(" \t")
            if name in headers:
                if name in SINGLE:
                    self._refuse(refusal(400, f"The request has more than one {name} header.", "duplicate_header"))
                    return False
                value = f"{headers[name]}{'; ' if name == 'cookie' else ', '}{value}"
            headers[name] = value
        error = self._check_head(version, headers)
        if error is not None:
            self._refuse(error)
            return False
        method = p.get_method().decode("ascii")
        target = self.url.decode("latin-1")
        path = target.partition("?")[0]
        te = headers.get("transfer-encoding")
        cl = headers.get("content-length")
        ex = self.ex = FrontExchange(
            self, method, API_ROUTES.get(path), target, headers, int(cl) if cl is not None else None, te is not None,
            p.should_keep_alive() and not self.upgrade and not self.front.closing, version == "1.0",
            headers.get("expect", "").lower() == "100-continue", self.front.cfg.max_body_bytes)
        if ex.content_length is not None and ex.content_length > ex.limit:
            # Refused before any of it is read (serve_api answers 413); what arrives meanwhile is dropped.
            ex.error = too_large(ex.limit, ex.content_length)
        self.body_left = ex.content_length or 0
        if self.msg_done:
            self._request_read()
        else:
            self.phase = BODY
            self.deadline = self.loop.time() + self.front.cfg.body_timeout_s
        self.task = self.loop.create_task(self._serve(ex))
        return True

    def _check_head(self, version: str, headers: dict[str, str]) -> GatewayError | None:
        if version == "1.1" and "host" not in headers:
            return refusal(400, "The request has no Host header.", "missing_host")
        te = headers.get("transfer-encoding")
        if te is not None and version == "1.0":
            return refusal(400, "HTTP/1.0 has no transfer codings.", "bad_http_request")
        if te is not None and te.lower() != "chunked":
            return refusal(501, "Only the chunked transfer coding is supported.", "unsupported_transfer_encoding")
        expect = headers.get("expect")
        if expect is not None and expect.lower() != "100-continue":
            return refusal(417, "Only 'Expect: 100-continue' is supported.", "expectation_failed")
        if self.upgrade:
            if self.parser.get_method() == b"CONNECT":
                return refusal(405, "CONNECT is not supported.", "method_not_allowed")
            if te is not None or headers.get("content-length", "0") != "0":
                return refusal(400, "A protocol upgrade with a request body is not supported.", "bad_http_request")
        return None

    async def read_body(self, ex: FrontExchange) -> None:
        """Wait until the whole body is in (within body_timeout_s); raises the body's error (413, 408)."""
        if ex.error is None and not ex.complete:
            if ex.expect_continue:
                ex.expect_continue = False
                self.send_now(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.body_waiter = self.loop.create_future()
            try:
                await self.body_waiter
            finally:
                self.body_waiter = None
        if ex.error is not None:
            raise ex.error

    # -- serving ---------------------------------------------------------------------------------
    async def _serve(self, ex: FrontExchange) -> None:
        g = self.front.g
        try:
            if ex.route is not None and ex.method == "POST":
                await serve_api(g, ex, ex.route)
            elif ex.route is not None:
                err = GatewayError(405, f"Method {ex.method} is not allowed on this route.",
                                   code="method_not_allowed", headers={"Allow": "POST"})
                rid = valid_request_id(ex.headers.get("x-request-id")) or g.request_ids.next()
                ex.reply(405, {"x-request-id": rid, **err.headers}, err.body())
            else:
                await self.front.inner.serve(ex, valid_request_id(ex.headers.get("x-request-id"))
                                             or g.request_ids.next())
        except (asyncio.CancelledError, ConnectionError):
            if self.phase != LINGER:  # (refused by the front itself: closing already)
                self._close()  # the client left (or the shutdown cut it)
            return
        except Exception:
            log.exception("unexpected error on %s", ex.route or "an inner route")
            if not ex.started and not self.closed:
                ex.keep_alive = False
                ex.reply(500, {}, INTERNAL_ERROR)
            self._close()
            return
        self._finish(ex)

    def _finish(self, ex: FrontExchange) -> None:
        self.ex = self.task = None
        if not ex.complete:
            self._linger()  # the client may still be sending the body nobody read
            return
        if not ex.done or not ex.keep_alive or self.front.closing:
            self._close()
            return
        if self.write_paused:
            # The client has not taken this reply yet: the next request waits, for write_timeout_s at most.
            self.phase = DRAIN
            self.deadline = self.loop.time() + self.front.cfg.write_timeout_s
            return
        self._idle()

    def _idle(self) -> None:
        self.phase = IDLE
        self.since = now = self.loop.time()
        self.deadline = now + self.front.cfg.keepalive_s
        self.front.waiting(self)
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        if self.buf:
            self._advance()

    def _refuse(self, err: GatewayError) -> None:
        """Answer a request the front cannot take (malformed, too large, too slow) and end the connection."""
        ex = self.ex
        if ex is not None and ex.started:
            self._close()
            return
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if not self.closed:
            self.transport.write(error_reply(err, close=True))
        self._linger()

    def _linger(self) -> None:
        """End the connection after its last reply: no more writes, what the client still sends is dropped
        for LINGER_S at most, then it closes (at the client's end of input, or the sweep's)."""
        if self.closed or self.phase == LINGER:
            return
        self.phase = LINGER
        self.deadline = self.loop.time() + LINGER_S
        self.buf.clear()
        self.front.served(self)
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self._close()

    def expire(self) -> None:
        """The current wait ran out (called by the front's sweep)."""
        phase = self.phase
        if phase == IDLE:
            self._close()
        elif phase == HEAD:
            self._refuse(refusal(408, "The request head did not arrive in time.", "request_timeout"))
        elif phase == BODY:
            err = refusal(408, "The request body did not arrive in time.", "request_timeout")
            if self.body_waiter is not None and self.ex.error is None:
                self.ex.error = err  # the request's own task answers 408 (and logs it), then the connection ends
                self._wake_body()
                self.phase = SERVING
                self.deadline = self.loop.time() + 1.0  # closed then all the same
            else:
                self._refuse(err)
        elif phase == LINGER:
            self._close()
        else:  # SERVING or DRAIN with a write pending: the client takes none of its reply
            self.transport.abort()

    def evict(self) -> None:
        """Make room for another connection: an idle one closes, one still sending a request gets 408."""
        if self.phase == IDLE:
            self._close()
        elif self.phase in (HEAD, BODY):
            self._refuse(refusal(408, "The request did not arrive in time.", "request_timeout"))

    # -- writing ---------------------------------------------------------------------------------
    def send_now(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def send(self, data: bytes) -> None:
        """Write, then wait while the client reads slower than the engine writes (write_timeout_s at most)."""
        self.send_now(data)
        if self.write_paused:
            self.deadline = self.loop.time() + self.front.cfg.write_timeout_s
            self.drain_waiter = self.loop.create_future()
            try:
                await self.drain_waiter
            finally:
                self.drain_waiter = None
                self.deadline = 0.0

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.front.forget(self)
            self.transport.close()  # what was written still goes out first


def _where(e: BaseException) -> str:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"


def connection_limit(configured: int) -> int:
    """Client connections this process can hold: each may need one to an engine, and some files stay spare."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(16, min(configured, (soft - 64) // 2))


class Front:
    """The listening socket: a FrontConnection per client; connection caps, timeouts and shutdown."""

    def __init__(self, runner: web.AppRunner) -> None:
        self.runner = runner
        self.g = runner.app[GATEWAY]
        self.loop = asyncio.get_running_loop()
        self.inner = InnerRoutes(runner)
        self.conns: set[FrontConnection] = set()
        # Connections not being served (idle, or still sending a request), oldest first: the ones that make
        # room when the process holds all the connections it can.
        self._waiting: dict[FrontConnection, None] = {}
        # Connections part-way through sending a request, oldest first.
        self._reading: dict[FrontConnection, None] = {}
        self.max_connections = connection_limit(self.cfg.max_connections)
        self.closing = False
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self._date = ("", -1)

    @property
    def cfg(self):
        return self.g.cfg.server  # read on use: a reload applies to the next wait

    async def start(self, host: str, port: int, reuse_port: bool = False, backlog: int = 1024) -> None:
        self._server = await self.loop.create_server(lambda: FrontConnection(self), host, port,
                                                     reuse_address=True, reuse_port=reuse_port or None,
                                                     backlog=backlog)
        self._sweeper = asyncio.create_task(self._sweep(), name="front-sweep")

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    def date(self) -> str:
        """The Date header, formatted once a second."""
        now = int(time.time())
        if self._date[1] != now:
            self._date = (formatdate(now, usegmt=True), now)
        return self._date[0]

    # -- who holds a connection, and who gives one up --------------------------------------------
    def admit(self, c: FrontConnection) -> None:
        self.conns.add(c)
        self._waiting[c] = None
        if len(self.conns) > self.max_connections:
            oldest = next(iter(self._waiting))
            (oldest if oldest is not c else c).evict()

    def reading(self, c: FrontConnection) -> None:
        self._reading[c] = None
        if len(self._reading) > self.cfg.max_reading_connections:
            oldest = next(iter(self._reading))
            if oldest is not c:
                oldest.evict()

    def served(self, c: FrontConnection) -> None:
        self._waiting.pop(c, None)
        self._reading.pop(c, None)

    def waiting(self, c: FrontConnection) -> None:
        self._waiting.pop(c, None)
        self._waiting[c] = None  # to the end: the most recently active

    def forget(self, c: FrontConnection) -> None:
        self.conns.discard(c)
        self.served(c)

    async def _sweep(self) -> None:
        """End every wait that ran out: idle keep-alive, a slow head or body, a client that takes no reply."""
        while True:
            cfg = self.cfg
            shortest = min(cfg.head_timeout_s, cfg.body_timeout_s, cfg.write_timeout_s, cfg.keepalive_s)
            await asyncio.sleep(min(max(shortest / 4, 0.05), 1.0))
            now = self.loop.time()
            for c in [c for c in self.conns if 0.0 < c.deadline < now]:
                c.expire()

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
            for c in [c for c in self.conns if c.phase in (IDLE, LINGER)]:
                c._close()
            if not self.conns or self.loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            if c.transport is not None:
                c.transport.abort()
        self.inner.close()
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
