"""A lean keep-alive HTTP/1.1 client on asyncio protocols, replies framed by llhttp: the upstream seam."""

from __future__ import annotations

import asyncio
import socket
import ssl as ssl_mod
from collections import deque
from typing import Awaitable, Callable, Final, Iterable
from urllib.parse import urlsplit

import httptools

from backends.http1_response import Carrier, Response
from backends.slots import Slots
from gateway.contracts import UpstreamConnectError, UpstreamDisconnected, UpstreamError, UpstreamProtocolError

# An engine's reply head: larger, or with more header lines, is a protocol error.
MAX_HEAD: Final = 64 * 1024
FIRST_PART: Final = 4096  # of a large first read, parsed before the rest (Connection.data_received)
MAX_HEADERS: Final = 100
MAX_INTERIM: Final = 8  # 1xx replies before the real one

Headers = dict[str, str] | Iterable[tuple[str, str]]


def _joined(lines: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        k, _, v = line.partition(":")
        k, v = k.lower(), v.strip(" \t")
        headers[k] = f"{headers[k]}, {v}" if k in headers else v
    return headers


class Connection(Carrier):
    """One keep-alive connection carrying one request at a time; llhttp (strict) frames each reply."""

    def __init__(self, pool: HostPool) -> None:
        super().__init__(pool.loop, pool.idle_timeout)
        self.pool = pool
        self.closed = False
        self.used = 0
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        # The raw bytes of a reply head being read (None once read): its fields are taken from them, not from
        # a callback per field, so that nothing accumulates fields (a trailer that never ends costs nothing).
        self._head: bytes | bytearray | None = None
        self._interims = 0
        self._body: list[bytes] = []  # body bytes of the read being parsed
        self._done_now = False  # the reply ended in the read being parsed
        self._interim = False
        self._resp: Response | None = None
        self._head_waiter: asyncio.Future | None = None
        self._head_by = 0.0  # when the reply head awaited is due (loop time)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_timer_at = 0.0
        self._complete = True  # no reply outstanding
        self._until_close = False
        self._keep_alive = True
        self._later: bytes | None = None  # the rest of a read whose first part went first (FIRST_PART)

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        if self._later is not None:
            self._parse_later()  # the end of the connection comes after the bytes read before it
        self.closed = True
        if self._complete:
            return
        if self._until_close and self._resp is not None:
            self._complete = True  # a body delimited by the end of the connection has ended
            self._resp._finish()
            return
        self._fail(UpstreamDisconnected("the engine closed the connection" + (f": {exc}" if exc else "")))

    def send(self, method: str, path: str, headers: Headers, body: bytes, deadline: float) -> asyncio.Future:
        """Write a request; the returned future gets the reply's Response once its head is read, or TimeoutError
        at `deadline` (loop time)."""
        lines = [f"{k}: {v}" for k, v in (headers.items() if isinstance(headers, dict) else headers)]
        fields = "\n".join(lines)
        # No CR or NUL, and every LF one of the joins: a value carrying a line end would start a header, or
        # a whole request, of its own on the engine's side (a few scans in C, not a check per field).
        if "\r" in fields or "\x00" in fields or fields.count("\n") != max(len(lines) - 1, 0) \
                or "\n" in path or "\r" in path:
            raise ValueError("refusing to send a header field with CR, LF or NUL in it")
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.pool.host_header}\r\nContent-Length: {len(body)}\r\n"
                + fields.replace("\n", "\r\n") + ("\r\n\r\n" if fields else "\r\n")).encode("latin-1")
        self.used += 1
        self._complete = self._until_close = self._interim = False
        self._head, self._resp, self._interims = b"", None, 0
        self._head_waiter = fut = self.loop.create_future()
        self._head_by = deadline
        if self._head_timer is None or deadline < self._head_timer_at:
            self._arm_head_timer(deadline)
        self.transport.write(head + body)
        return fut

    def _arm_head_timer(self, at: float) -> None:
        self._stop_head_timer()
        self._head_timer_at = at
        self._head_timer = self.loop.call_at(at, self._head_check)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_check(self) -> None:
        """Fail the awaited reply head once its deadline has passed. One timer serves the requests one after another
        on a keep-alive connection: a request only notes its deadline, and the timer moves on to it when it fires
        early, or lapses when no head is awaited (uvloop's call_at and cancel cost about 3 us a request)."""
        self._head_timer = None
        w = self._head_waiter
        if w is None or w.done():
            return  # no head awaited: the next request sets the timer again
        if self.loop.time() < self._head_by:
            self._arm_head_timer(self._head_by)
            return
        w.set_exception(TimeoutError("no response head in time"))

    def data_received(self, data: bytes) -> None:
        if self._later is not None:
            # More bytes before the rest of the earlier read was parsed (several reads in one loop turn): all of
            # it now, in order, so that what waits unparsed is never more than one read.
            later, self._later = self._later, None
            data = later + data
        # (A local, not a test of self._resp in the `if`: that would narrow self._resp to None past the parse
        # that sets it, and the compiled build checks a narrowed type when it reads the attribute again.)
        head_next = self._resp is None and not self._complete
        if head_next and len(data) > FIRST_PART:
            # A reply's head and the start of its body in one large read (a fast engine's whole stream): its
            # first events reach the client before the rest is parsed, one loop turn later.
            self._parse(data[:FIRST_PART])
            if self.closed:
                return
            resp = self._resp
            if resp is not None and resp.streaming and not self._complete:
                self._later = data[FIRST_PART:]
                self.loop.call_soon(self._parse_later)
                return
            data = data[FIRST_PART:]
        self._parse(data)

    def _parse_later(self) -> None:
        later, self._later = self._later, None
        if later is not None and not self.closed:
            self._parse(later)

    def _parse(self, data: bytes) -> None:
        if self._complete:
            # Bytes nobody asked for (an idle connection, or after a whole reply): were it reused, they would
            # pass for the next request's reply.
            self.abandon()
            return
        error: Exception | None = None
        if self._head is not None:  # (bytes: no copy for a head that comes in one read)
            self._head = data if not self._head else bytearray(self._head) + data
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            error = UpstreamProtocolError("the engine switched protocols")
        except httptools.HttpParserError as e:
            cause = e.__context__
            error = cause if isinstance(cause, UpstreamError) else \
                UpstreamProtocolError(f"malformed reply from the engine ({e})")
        # All the body bytes of one read go to the consumer as one piece (a stream's events arrive as
        # many small chunks; one piece each would cost a wake-up and a client write each).
        body = self._body
        resp = self._resp
        if body:
            if resp is not None:
                resp._feed(body[0] if len(body) == 1 else b"".join(body))
            body.clear()
        if self._done_now:
            self._done_now = False
            if resp is not None:
                resp._finish()
            if error is not None:
                self._keep_alive = False  # bytes after the end of the reply: the reply stands, the connection goes
            return
        if error is not None:
            self._fail(error)
            return
        if self._head is not None and len(self._head) > MAX_HEAD:  # still in the head, and too much of it
            self._fail(UpstreamProtocolError("reply head too large"))

    # -- llhttp callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._complete:
            raise UpstreamProtocolError("bytes after the end of the reply")

    def on_headers_complete(self) -> None:
        # Strict llhttp allows no bare CR or LF in a head, so it ends at the first CRLFCRLF of its bytes, and
        # every line in it is `name ":" OWS value OWS`.
        raw = self._head
        assert raw is not None  # (set when the request was sent, cleared only here)
        end = raw.find(b"\r\n\r\n")
        if end + 4 > MAX_HEAD:
            raise UpstreamProtocolError("reply head too large")
        status = self._parser.get_status_code()
        if status < 200:
            if status == 101:
                raise UpstreamProtocolError("the engine switched protocols")
            self._interims += 1
            if self._interims > MAX_INTERIM:
                raise UpstreamProtocolError("too many interim replies")
            self._head, self._interim = raw[end + 4:], True  # 100 Continue, 103 Early Hints: the real head follows
            return
        if status > 599:
            raise UpstreamProtocolError(f"reply status {status}")
        lines = raw[:end].decode("latin-1").split("\r\n")
        del lines[0]  # the status line
        if len(lines) > MAX_HEADERS:
            raise UpstreamProtocolError("too many header fields in the reply")
        self._head = None
        headers: dict[str, str] = {}
        for line in lines:
            k, _, v = line.partition(":")
            headers[k.lower()] = v.strip(" \t")
        if len(headers) != len(lines):
            headers = _joined(lines)  # a repeated field
        te = headers.get("transfer-encoding")
        if te is not None and te.lower() != "chunked":
            raise UpstreamProtocolError("unsupported transfer coding in the reply")
        self._until_close = te is None and "content-length" not in headers and status not in (204, 304)
        resp = self._resp = Response(self, status, headers, lines)
        if resp.streaming:
            # A stream holds this connection for as long as it lasts: its head timer (about 550 bytes while armed)
            # goes now instead of living on to the deadline; one cancel a stream is nothing beside its tokens.
            self._stop_head_timer()
        w, self._head_waiter = self._head_waiter, None
        if w is not None and not w.done():
            w.set_result(resp)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._complete = self._done_now = True
        self._keep_alive = self._keep_alive and self._parser.should_keep_alive() and not self._until_close

    # -- ending --------------------------------------------------------------------------------
    def abandon(self) -> None:
        """Stop using this connection mid-exchange: the engine sees it close."""
        self._stop_head_timer()
        self._keep_alive = False
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, err: Exception) -> None:
        self._keep_alive = False
        self._complete = True
        if self._head_waiter is not None and not self._head_waiter.done():
            self._head_waiter.set_exception(err)
        elif self._resp is not None:
            self._resp._finish(err)
        self.abandon()

    def release(self, resp: Response) -> None:
        if resp is not self._resp:
            return
        self._resp = None
        if self._complete and resp._error is None and self._keep_alive and not self.closed:
            self.idle_since = self.loop.time()
            self.pool.put_idle(self)
        else:
            self.abandon()  # unfinished: the engine sees the disconnect and aborts the request
        self.pool.give_back()


Opener = Callable[[Callable[[], Connection]], Awaitable[Connection]]


class HostPool:
    """Idle keep-alive connections to one backend, bounded in number, and within `shared` (a bound on the
    connections of every backend's pool together) when one is given.

    `opener`, when given, makes a connection in place of a TCP connect (the gateway's in-process
    hop to its own aiohttp routes uses a socket pair).
    """

    def __init__(self, url: str, limit: int, connect_timeout: float, keepalive_s: float,
                 idle_timeout: float, opener: Opener | None = None, shared: Slots | None = None) -> None:
        u = urlsplit(url)
        self.loop = asyncio.get_running_loop()
        self.scheme = u.scheme
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.host_header = u.netloc.rpartition("@")[2]  # never the URL's credentials
        self.base_path = u.path.rstrip("/")
        self.ssl = ssl_mod.create_default_context() if u.scheme == "https" else None
        self.sem = Slots(limit)
        self.shared = shared
        self.in_use = 0  # requests holding a slot: sent, or their reply not yet read to the end
        self.idle: deque[Connection] = deque()
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self.idle_timeout = idle_timeout
        self._opener = opener

    def put_idle(self, conn: Connection) -> None:
        self.idle.append(conn)

    async def _connect(self, deadline: float) -> Connection:
        try:
            async with asyncio.timeout_at(min(deadline, self.loop.time() + self.connect_timeout)):
                if self._opener is not None:
                    return await self._opener(lambda: Connection(self))
                _, conn = await self.loop.create_connection(lambda: Connection(self), self.host, self.port,
                                                            ssl=self.ssl)
        except (OSError, TimeoutError) as e:
            raise UpstreamConnectError(f"cannot connect: {type(e).__name__}") from None
        return conn

    def _take_idle(self) -> Connection | None:
        now = self.loop.time()
        while self.idle:
            conn = self.idle.pop()  # most recently used first: least likely to have been closed
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.transport.abort()
        return None

    async def request(self, method: str, path: str, headers: Headers, body: bytes, timeout: float) -> Response:
        """Send a request; returns when the response head arrived. A stale reused connection is retried once.

        One deadline covers waiting for a slot, connecting, sending and the response head. The common
        case (a free slot, an idle connection) arms no timer: the connection's own serves it (Connection.send).
        """
        conn = None
        acquired = False
        deadline = self.loop.time() + timeout
        try:
            await self._take_slot(deadline)
            acquired = True
            path = self.base_path + path
            conn = self._take_idle()
            if conn is not None:
                try:
                    return await conn.send(method, path, headers, body, deadline)
                except UpstreamDisconnected:
                    # An engine may close a keep-alive connection between requests; nothing was
                    # processed, so the request goes again on a fresh connection.
                    conn.abandon()
            conn = await self._connect(deadline)
            return await conn.send(method, path, headers, body, deadline)
        except BaseException:
            if conn is not None:
                conn.abandon()  # a timed-out or cancelled exchange must not be reused
            if acquired:
                self.give_back()
            raise

    async def _take_slot(self, deadline: float) -> None:
        """A slot of this pool and, with a shared bound, one of all pools; waiting for either counts against
        the deadline: a hung engine holding every connection must not queue new requests without bound."""
        if not self.sem.try_take():
            await self.sem.take(deadline)
        shared = self.shared
        if shared is not None and not shared.try_take():
            try:
                await shared.take(deadline)
            except BaseException:
                self.sem.release()
                raise
        self.in_use += 1

    def give_back(self) -> None:
        self.in_use -= 1
        self.sem.release()
        if self.shared is not None:
            self.shared.release()

    def close(self) -> None:
        while self.idle:
            self.idle.pop().transport.abort()
