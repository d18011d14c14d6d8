"""One client connection: requests framed by llhttp (strict), one at a time, each wait timed, each buffer bounded."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Final

import httptools

from gateway.apis.api import ErrorShape
from gateway.apis.registry import api_of
from gateway.errors import GatewayError, raised_at
from gateway.http.exchange import INTERNAL_ERROR, FrontExchange, error_reply, too_large
from gateway.http.headers import valid_request_id
from gateway.http.request_head import check_head, refusal, request_headers
from gateway.http.server import Server
from gateway.http.wire import Wire

log = logging.getLogger("shapegate")

# A request on an API route (gateway/apis/registry.py) goes to the API handler the application hands over (its
# pipeline); every other request is served by aiohttp's routes (gateway/http/inner.py).
PIPELINED_HIGH: Final = 1 << 20  # bytes of later requests buffered before reading pauses
# What a connection is doing. IDLE: waiting for a request's first byte; HEAD, BODY: reading one; SERVING: the
# request is read and its reply under way (later requests wait in the buffer); DRAIN: the reply is written
# but the client has not taken it yet; LINGER: the last reply is written and the connection is closing.
IDLE: Final = 0
HEAD: Final = 1
BODY: Final = 2
SERVING: Final = 3
DRAIN: Final = 4
LINGER: Final = 5
# After a reply that ends a connection while the client may still be sending (a refused or unread body),
# what it sends is read and dropped this long, so that closing does not reset the connection (and the
# reply with it) before the client has read it.
LINGER_S: Final = 2.0


class _StopParsing(Exception):
    """Raised in a parser callback to stop llhttp at once: a second request in the same bytes."""


class FrontConnection(Wire):
    """Requests one at a time; pipelined ones wait unparsed in the buffer until the one before is answered.

    A head ends at the first CRLFCRLF (strict llhttp allows no bare CR or LF in it), so it is measured before
    it is parsed; the head and the bytes behind it go to llhttp in one call. When those bytes hold a second
    request, parsing stops there and a fresh parser takes it up once the first is answered (its start is known
    from the first's Content-Length). After a chunked body it is not: the connection then ends after the reply.
    """

    def __init__(self, front: Server) -> None:
        super().__init__(front.loop, front.cfg, front.dates)
        self.front = front
        self.parser = httptools.HttpRequestParser(self)
        self.buf = bytearray()  # received bytes not yet parsed (a head: not yet complete)
        self.fed = 0  # bytes of an incomplete head already fed
        self.phase = IDLE
        self.ex: FrontExchange | None = None
        # One task serves the connection's requests in turn (a task per request costs more than the request's
        # routing); between requests it waits on next_waiter.
        self.task: asyncio.Task | None = None
        self.next_waiter: asyncio.Future | None = None
        self.body_left = 0  # bytes of a Content-Length body still to come
        self.read_paused = False
        # The request being parsed (reset for each one).
        self.early: list[bytes] = []  # body bytes parsed with the head, before the exchange exists
        self.head_done = self.msg_done = self.upgrade = self.overrun = False
        self.method = ""
        self.keep_alive = False
        self.errors: ErrorShape | None = None  # the error shape of the API the request being read is for

    # -- transport events ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.deadline = self.loop.time() + self.cfg.head_timeout_s  # a new connection owes a request head
        self.front.admit(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.front.forget(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: the engine's request aborts (one not yet taken up never goes)
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
            log.error("the front failed on a request: %s at %s", type(e).__name__, raised_at(e))
            self._refuse(refusal(500, "The gateway failed to read the request.", "internal_error"))
        if self.phase in (HEAD, BODY):
            self.front.reading(self)  # part of a request is still to come

    # -- llhttp callbacks (a request's parts; no work beyond collecting them) -------------------------
    def on_message_begin(self) -> None:
        if self.msg_done:
            raise _StopParsing()  # a second request in the same bytes: parsed after the first is answered

    def on_headers_complete(self) -> None:
        # Read now: llhttp resets it once the message (which may end in the same call) is complete.
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        if self.ex is not None:
            self.ex.add_body(body)
        else:
            self.early.append(body)

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
        self.cfg = cfg = self.front.cfg
        self.early, self.fed = [], 0
        self.head_done = self.msg_done = self.upgrade = self.overrun = False
        self.method = ""
        self.errors = None
        self.deadline = self.loop.time() + cfg.head_timeout_s

    def _feed(self, start: int, stop: int) -> int | None:
        """Feed buf[start:stop] to llhttp: how many bytes it took (fewer when an upgrade or a second request
        stopped it), or None when the request was malformed (then answered here, and the connection ends)."""
        whole = start == 0 and stop == len(self.buf)  # (the usual case: no view to make)
        view: bytearray | memoryview = self.buf if whole else memoryview(self.buf)[start:stop]
        error: httptools.HttpParserError | None = None
        taken = stop - start
        try:
            self.parser.feed_data(view)
        except httptools.HttpParserUpgrade as e:
            self.upgrade = True  # the head is read; llhttp leaves what follows unparsed
            taken = e.args[0]
        except httptools.HttpParserError as e:
            error = e
        finally:
            if isinstance(view, memoryview):
                view.release()  # before the buffer changes size
        if error is None:
            return taken
        if self.msg_done:
            # The request is whole; what follows it stopped the parser: a second request (_StopParsing),
            # or any byte after one that ends its connection ("Data after Connection: close").
            self.overrun = True
            return taken  # (where a second request starts is found from the first's length)
        # llhttp's reasons are fixed texts: nothing of the request is quoted back.
        self._refuse(refusal(400, f"Malformed HTTP request: {error}.", "bad_http_request"))
        return None

    def _read_head(self) -> bool:
        buf = self.buf
        limit = self.cfg.max_head_bytes
        end = buf.find(b"\r\n\r\n", max(0, self.fed - 3))
        if end < 0 or end + 4 > limit:
            if len(buf) > limit or end >= 0:
                self._refuse(refusal(431, f"The request head exceeds {limit} bytes.", "request_head_too_large"))
                return False
            # Incomplete: fed now all the same, so that a malformed head is refused at once, not at the timeout.
            if self._feed(self.fed, len(buf)) is not None:
                self.fed = len(buf)
            return False
        head_end = end + 4
        if self._feed(self.fed, len(buf)) is None:  # the head and what came with it, in one call
            return False
        if not self.head_done:
            self._refuse(refusal(400, "Malformed HTTP request head.", "bad_http_request"))
            return False
        # The request line and header lines, taken from the head llhttp accepted (strict: single spaces in
        # the request line, CRLF line ends): no callback per part, fewer calls into Python.
        lines = self.buf[:end].decode("latin-1").split("\r\n")
        if len(lines) > self.cfg.max_headers + 1:
            self._refuse(refusal(431, "The request has too many header fields.", "too_many_headers"))
            return False
        return self._start_request(head_end, lines)

    def _read_body(self) -> bool:
        ex = self.ex
        assert ex is not None  # the BODY phase begins with the exchange
        n = len(self.buf) if ex.chunked else min(self.body_left, len(self.buf))
        if self._feed(0, n) is None:
            return False
        if self.overrun:  # bytes after a chunked body: where the next request starts is not known
            ex.keep_alive = False
            self.buf.clear()
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
        assert self.ex is not None
        self.ex.complete = True
        self.phase = SERVING
        self.deadline = 0.0
        self.front.served(self)
        self._wake_body()

    def _start_request(self, head_end: int, lines: list[str]) -> bool:
        """The head is read (and what came with it parsed): check it, make the exchange, start its task."""
        parts = lines[0].split(" ")  # `method SP target SP protocol/version` (llhttp allows runs of spaces)
        if len(parts) != 3:
            parts = lines[0].split()
            if len(parts) != 3:  # (no version at all: HTTP/0.9)
                self._refuse(refusal(505, "HTTP/0.9 is not supported.", "http_version_not_supported"))
                return False
        self.method, target, proto = parts
        api = api_of(target.partition("?")[0])
        self.errors = api.errors if api is not None else None  # a refusal from here on takes the API's shape
        headers = request_headers(lines[1:])
        if isinstance(headers, GatewayError):
            self._refuse(headers)
            return False
        version = proto[5:] if proto.startswith("HTTP/") else proto  # (llhttp also takes RTSP/ and ICE/)
        error = check_head(version, self.method, headers, self.upgrade)
        if error is not None:
            self._refuse(error)
            return False
        cfg = self.cfg
        cl = headers.get("content-length")
        ex = self.ex = FrontExchange(
            self, self.method, api, target, headers,
            int(cl) if cl is not None else None, "transfer-encoding" in headers,
            self.keep_alive and not self.upgrade and not self.front.closing, version == "1.0",
            headers.get("expect", "").lower() == "100-continue", cfg.max_body_bytes)
        length = ex.content_length or 0
        if length > ex.limit:
            # Refused before any of it is read (the API handler answers 413); what arrives meanwhile is dropped.
            ex.error = too_large(ex.limit, length)
        for part in self.early:
            ex.add_body(part)
        self.early = []
        if self.upgrade or (self.overrun and ex.chunked):
            ex.keep_alive = False  # where anything after this request starts is not known: answered, then closed
            self.buf.clear()
        elif self.overrun:
            del self.buf[:head_end + length]  # the next request starts here; llhttp stopped at it
            self.parser = httptools.HttpRequestParser(self)
        else:
            self.body_left = length - (len(self.buf) - head_end)
            self.buf.clear()
        if self.msg_done:
            self._request_read()
        else:
            self.phase = BODY
            self.deadline = self.loop.time() + cfg.body_timeout_s
        if self.task is None:
            self.task = self.loop.create_task(self._serve_all())
        else:  # waiting for this request, or (a pipelined one) about to take it up once the one before is done
            self._wake_task()
        return True

    # -- serving ---------------------------------------------------------------------------------
    async def _serve_all(self) -> None:
        """Serve the connection's requests one after another, each once its head is read; end with the connection."""
        while True:
            ex = self.ex
            if ex is not None:
                if not await self._serve(ex):
                    return
            elif self.closed or self.phase == LINGER:
                return
            else:
                self.next_waiter = w = self.loop.create_future()
                try:
                    await w
                finally:
                    self.next_waiter = None

    def _wake_task(self) -> None:
        w = self.next_waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _serve(self, ex: FrontExchange) -> bool:
        """One request, answered however it ends; whether the connection then stays open for another."""
        front = self.front
        try:
            api = ex.api
            if api is not None and api.allows(ex.method):
                await front.api(ex, api)
            else:
                rid = valid_request_id(ex.headers.get("x-request-id")) or front.request_id()
                if api is not None:
                    err = GatewayError(405, f"Method {ex.method} is not allowed on this route.",
                                       code="method_not_allowed", headers={"Allow": api.allow})
                    ex.reply(api.errors.status_of(err), {"x-request-id": rid, "x-shapegate-reason": "method_not_allowed",
                                                         **err.headers}, api.errors.body(err, rid))
                else:
                    await front.inner.serve(ex, rid)
        except (asyncio.CancelledError, ConnectionError):
            if self.phase != LINGER:  # (refused by the front itself: closing already)
                self.close()  # the client left (or the shutdown cut it)
            return False
        except Exception:
            log.exception("unexpected error on %s", ex.api.name if ex.api is not None else "an inner route")
            if not ex.started and not self.closed:
                ex.keep_alive = False
                ex.reply(500, {}, INTERNAL_ERROR)
            self.close()
            return False
        self._finish(ex)
        return not self.closed and self.phase != LINGER

    def _finish(self, ex: FrontExchange) -> None:
        self.ex = None
        if not ex.complete:
            self._linger()  # the client may still be sending the body nobody read
            return
        if not ex.done or not ex.keep_alive or self.front.closing:
            self.close()
            return
        if self.write_paused:
            # The client has not taken this reply yet: the next request waits, for write_timeout_s at most.
            self.phase = DRAIN
            self.deadline = self.loop.time() + self.cfg.write_timeout_s
            return
        self._idle()

    def _idle(self) -> None:
        self.phase = IDLE
        self.deadline = self.loop.time() + self.cfg.keepalive_s
        self.front.waiting(self)
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        if self.buf:
            self._advance()
            if self.phase in (HEAD, BODY):
                self.front.reading(self)

    # -- ending ----------------------------------------------------------------------------------
    def _refuse(self, err: GatewayError) -> None:
        """Answer a request the front cannot take (malformed, too large, too slow) and end the connection."""
        ex = self.ex
        if ex is not None and ex.started:
            self.close()
            return
        if ex is not None and self.task is not None and not self.task.done():
            self.task.cancel()  # the request it is reading is answered here instead
        if not self.closed:
            self.transport.write(error_reply(err, self.front.request_id(), head_only=self.method == "HEAD",
                                             errors=self.errors))
        self.front.reject(err.status)
        self._linger()

    def _linger(self) -> None:
        """End the connection after its last reply: no more writes, what the client still sends is dropped
        for LINGER_S at most, then it closes (at the client's end of input, or the sweep's)."""
        if self.closed or self.phase == LINGER:
            return
        self.phase = LINGER
        self.deadline = self.loop.time() + LINGER_S
        self.buf.clear()
        self._wake_task()  # no request follows
        self.front.lingering(self)
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.close()

    def expire(self) -> None:
        """The current wait ran out (called by the front's sweep)."""
        phase = self.phase
        if phase == IDLE or phase == LINGER:
            self.close()
        elif phase == HEAD:
            self._refuse(refusal(408, "The request head did not arrive in time.", "request_timeout"))
        elif phase == BODY:
            err = refusal(408, "The request body did not arrive in time.", "request_timeout")
            if self.body_waiter is not None and self.ex is not None and self.ex.error is None:
                self.ex.error = err  # the request's own task answers 408 (and logs it), then the connection ends
                self._wake_body()
                self.phase = SERVING
                self.deadline = self.loop.time() + 1.0  # closed then all the same
            else:
                self._refuse(err)
        else:  # SERVING or DRAIN with a write pending: the client takes none of its reply
            self.transport.abort()

    def evict(self) -> None:
        """Close at once to make room for another connection (one still sending a request is told 408)."""
        if self.phase in (HEAD, BODY) and not (self.ex is not None and self.ex.started) and not self.closed:
            self.transport.write(error_reply(refusal(408, "The request did not arrive in time.", "request_timeout"),
                                             self.front.request_id(), head_only=self.method == "HEAD"))
            self.front.reject(408)
        self.close()

    def close(self) -> None:
        """Close: what was written still goes out first."""
        if not self.closed:
            self.closed = True
            self.front.forget(self)
            self.transport.close()

    def abort(self) -> None:
        """Close at once, dropping what the client has not taken (the shutdown's end)."""
        if self.transport is not None:
            self.transport.abort()
