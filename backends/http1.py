"""A lean keep-alive HTTP/1.1 client on asyncio protocols: the upstream seam, without a general client's cost."""

from __future__ import annotations

import asyncio
import socket
import ssl as ssl_mod
from collections import deque
from typing import AsyncIterator, Mapping
from urllib.parse import urlsplit

from gateway.contracts import UpstreamConnectError, UpstreamDisconnected

_HEAD, _FIXED, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)
# Pause reading from an engine when this much is buffered for a slow client.
HIGH_WATER = 256 * 1024
MAX_HEAD = 64 * 1024


class Response:
    """One upstream response; body chunks are handed over as they arrive, in arrival order."""

    __slots__ = ("status", "headers", "_conn", "_chunks", "_buffered", "_waiter", "_done", "_error", "_paused")

    def __init__(self, conn: "Connection", status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._done = False
        self._error: Exception | None = None
        self._paused = False

    # -- called by the protocol ----------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self, error: Exception | None = None) -> None:
        self._done = True
        self._error = error
        self._wake()

    def _idle_expired(self, w: asyncio.Future) -> None:
        if not w.done():
            w.set_exception(TimeoutError("the engine sent nothing for too long"))
            self._conn.abandon()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- called by the consumer ----------------------------------------------------------------
    async def _next(self) -> bytes | None:
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                return None
            loop = self._conn.loop
            self._waiter = w = loop.create_future()
            timer = loop.call_later(self._conn.pool.idle_timeout, self._idle_expired, w)
            try:
                await w
            finally:
                timer.cancel()
                self._waiter = None
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered < HIGH_WATER // 4:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while True:
            data = await self._next()
            if data is None:
                return
            yield data

    async def read(self) -> bytes:
        parts = []
        while True:
            data = await self._next()
            if data is None:
                return b"".join(parts)
            parts.append(data)

    def close(self) -> None:
        """Done with the response: a complete one frees the connection, an unfinished one is aborted."""
        self._conn.release(self)


class Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, pool: "HostPool") -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = 0
        self.idle_since = 0.0
        self._buf = b""
        self._state = _DONE
        self._remaining = 0
        self._resp: Response | None = None
        self._head_waiter: asyncio.Future | None = None
        self._keep_alive = True
        self._last_data = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._state == _UNTIL_CLOSE and self._resp is not None:
            self._state = _DONE
            self._resp._finish()
            return
        err = UpstreamDisconnected("the engine closed the connection" + (f": {exc}" if exc else ""))
        if self._head_waiter is not None and not self._head_waiter.done():
            self._head_waiter.set_exception(err)
        elif self._resp is not None and self._state != _DONE:
            self._resp._finish(err)

    def send(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> asyncio.Future:
        self.used += 1
        self._state = _HEAD
        self._buf = b""
        self._resp = None
        self._head_waiter = fut = self.loop.create_future()
        lines = [f"{method} {path} HTTP/1.1\r\nHost: {self.pool.host_header}\r\nContent-Length: {len(body)}\r\n"]
        for k, v in headers.items():
            lines.append(f"{k}: {v}\r\n")
        lines.append("\r\n")
        self.transport.write("".join(lines).encode("latin-1") + body)
        self._last_data = self.loop.time()
        return fut

    def data_received(self, data: bytes) -> None:
        self._last_data = self.loop.time()
        if self._state == _FIXED:  # the common case: body bytes of a Content-Length response
            self._fixed(data)
            return
        self._buf += data
        self._parse()

    def _fixed(self, data: bytes) -> None:
        n = len(data)
        if n < self._remaining:
            self._remaining -= n
            self._resp._feed(data)
            return
        self._resp._feed(data[:self._remaining])
        self._remaining = 0
        self._state = _DONE
        self._resp._finish()

    def _parse(self) -> None:
        """Advance the response state machine over the buffer with an offset (no quadratic re-slicing);
        all body bytes found in one read go to the consumer as one piece."""
        buf, pos, out = self._buf, 0, []
        n = len(buf)
        while pos < n:
            st = self._state
            if st == _CHUNK_DATA:
                take = min(self._remaining, n - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._remaining -= take
                if self._remaining:
                    break
                self._state = _CHUNK_CRLF
            elif st == _CHUNK_CRLF:
                if n - pos < 2:
                    break
                pos += 2
                self._state = _CHUNK_SIZE
            elif st == _CHUNK_SIZE:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    break
                try:
                    size = int(buf[pos:nl].split(b";", 1)[0], 16)
                except ValueError:
                    self._fail(UpstreamDisconnected("bad chunk size from the engine"))
                    return
                pos = nl + 2
                self._remaining = size
                self._state = _CHUNK_DATA if size else _TRAILER
            elif st == _HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if n - pos > MAX_HEAD:
                        self._fail(UpstreamDisconnected("response head too large"))
                        return
                    break
                head = buf[pos:end].decode("latin-1")
                pos = end + 4
                if not self._start_response(head):
                    return
            elif st == _FIXED:
                take = min(self._remaining, n - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._state = _DONE
            elif st == _TRAILER:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                line_empty = end == pos
                pos = end + 2
                if line_empty:
                    self._state = _DONE
            elif st == _UNTIL_CLOSE:
                out.append(buf[pos:])
                pos = n
            else:  # _DONE: bytes after a complete response are a protocol error; drop the connection later
                self._keep_alive = False
                pos = n
        self._buf = buf[pos:] if pos < n else b""
        resp = self._resp
        if resp is not None:
            if out:
                resp._feed(out[0] if len(out) == 1 else b"".join(out))
            if self._state == _DONE and not resp._done:
                resp._finish()

    def _start_response(self, head: str) -> bool:
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        try:
            status = int(parts[1])
        except (IndexError, ValueError):
            self._fail(UpstreamDisconnected("malformed status line from the engine"))
            return False
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if status == 100:  # interim response: the real head follows
            return True
        self._keep_alive = headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
        resp = self._resp = Response(self, status, headers)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            self._remaining = int(headers["content-length"])
            self._state = _FIXED if self._remaining else _DONE
        elif status in (204, 304):
            self._state = _DONE
        else:
            self._state = _UNTIL_CLOSE
            self._keep_alive = False
        w, self._head_waiter = self._head_waiter, None
        if w is not None and not w.done():
            w.set_result(resp)
        return True

    def abandon(self) -> None:
        """Stop using this connection mid-exchange: the engine sees it close."""
        self._keep_alive = False
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, err: Exception) -> None:
        self._keep_alive = False
        if self._head_waiter is not None and not self._head_waiter.done():
            self._head_waiter.set_exception(err)
        elif self._resp is not None:
            self._resp._finish(err)
        self.transport.abort()

    def release(self, resp: Response) -> None:
        if resp is not self._resp:
            return
        self._resp = None
        if self._state == _DONE and self._keep_alive and not self.closed:
            self.idle_since = self.loop.time()
            self.pool.put_idle(self)
        else:
            self.closed = True
            self.transport.abort()  # unfinished: the engine sees the disconnect and aborts the request
        self.pool.sem.release()


def _expire(head: asyncio.Future) -> None:
    if not head.done():
        head.set_exception(TimeoutError("no response head in time"))


class HostPool:
    """Idle keep-alive connections to one backend, bounded in number."""

    def __init__(self, url: str, limit: int, connect_timeout: float, keepalive_s: float,
                 idle_timeout: float) -> None:
        u = urlsplit(url)
        self.loop = asyncio.get_running_loop()
        self.scheme = u.scheme
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.host_header = u.netloc
        self.base_path = u.path.rstrip("/")
        self.ssl = ssl_mod.create_default_context() if u.scheme == "https" else None
        self.sem = asyncio.Semaphore(limit)
        self.idle: deque[Connection] = deque()
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self.idle_timeout = idle_timeout

    def put_idle(self, conn: Connection) -> None:
        self.idle.append(conn)

    async def _connect(self, deadline: float) -> Connection:
        try:
            async with asyncio.timeout_at(min(deadline, self.loop.time() + self.connect_timeout)):
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

    async def request(self, method: str, path: str, headers: Mapping[str, str], body: bytes,
                      timeout: float) -> Response:
        """Send a request; returns when the response head arrived. A stale reused connection is retried once.

        One deadline covers waiting for a slot, connecting, sending and the response head. The common
        case (a free slot, an idle connection) arms one timer instead of a task-level timeout.
        """
        conn = None
        acquired = False
        deadline = self.loop.time() + timeout
        try:
            if self.sem.locked():
                # Waiting for a free slot counts against the deadline: a hung engine holding every
                # connection must not queue new requests without bound.
                async with asyncio.timeout_at(deadline):
                    await self.sem.acquire()
            else:
                await self.sem.acquire()  # returns at once
            acquired = True
            path = self.base_path + path
            conn = self._take_idle()
            if conn is not None:
                try:
                    return await self._head(conn.send(method, path, headers, body), deadline)
                except UpstreamDisconnected:
                    # An engine may close a keep-alive connection between requests; nothing was
                    # processed, so the request goes again on a fresh connection.
                    conn.abandon()
            conn = await self._connect(deadline)
            return await self._head(conn.send(method, path, headers, body), deadline)
        except BaseException:
            if conn is not None:
                conn.abandon()  # a timed-out or cancelled exchange must not be reused
            if acquired:
                self.sem.release()
            raise

    async def _head(self, head: asyncio.Future, deadline: float) -> Response:
        timer = self.loop.call_at(deadline, _expire, head)
        try:
            return await head
        finally:
            timer.cancel()

    def close(self) -> None:
        while self.idle:
            self.idle.pop().transport.abort()

