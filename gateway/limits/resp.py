"""A pipelined Redis connection for the request path: commands written back to back on one socket, replies
matched in order, no connection pool and no handshake beyond AUTH and SELECT.

The request path's own, while the modules off it use redis-py: a rate-limit check waits at most [limits]
redis_timeout_s (50 ms), and redis-py drops its connection when a wait for a reply is cancelled (each late
reply would cost a reconnect), where here the reply is still read and the connection kept. redis-py also takes a
pooled connection per command in flight; here the checks of concurrent requests share one socket, their commands
sent together at the end of the loop turn."""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import Any, Final

from redis.asyncio.connection import parse_url

INCOMPLETE = object()
MAX_LINE = 64 * 1024  # no reply of ours has a longer line: more means the stream is not Redis


class RespError(Exception):
    """An error reply from Redis (-ERR, -NOSCRIPT, ...)."""


class ProtocolError(ConnectionError):
    """Bytes that are not a Redis reply: the connection is dropped."""


def encode(args: tuple[Any, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%b\r\n" % (len(b), b))
    return b"".join(parts)


def parse(buf: bytearray, pos: int) -> tuple[Any, int]:
    """One RESP2 reply at `pos`: (value, position after it), or (INCOMPLETE, pos) until all of it is there."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        if len(buf) - pos > MAX_LINE:
            raise ProtocolError("a reply line longer than any Redis sends here")
        return INCOMPLETE, pos
    kind, line, after = buf[pos], bytes(buf[pos + 1:end]), end + 2
    try:
        if kind == 0x2B:  # +
            return line.decode(), after
        if kind == 0x2D:  # -
            return RespError(line.decode(errors="replace")), after
        if kind == 0x3A:  # :
            return int(line), after
        if kind == 0x24:  # $
            n = int(line)
            if n < 0:
                return None, after
            if len(buf) < after + n + 2:
                return INCOMPLETE, pos
            return bytes(buf[after:after + n]), after + n + 2
        if kind == 0x2A:  # *
            n = int(line)
            items = []
            for _ in range(max(n, 0)):
                item, after = parse(buf, after)
                if item is INCOMPLETE:
                    return INCOMPLETE, pos
                items.append(item)
            return (items if n >= 0 else None), after
    except ValueError:
        pass
    raise ProtocolError("not a Redis reply")


CERT_REQS: Final = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def tls_context(opts: dict[str, Any]) -> ssl.SSLContext:
    """The TLS context a rediss:// URL asks for, read from the same ssl_* query options redis-py takes, so that the
    limiter's connection trusts exactly what the other Redis clients of the gateway trust."""
    ctx = ssl.create_default_context(cafile=opts.get("ssl_ca_certs"), capath=opts.get("ssl_ca_path"))
    if opts.get("ssl_certfile"):
        ctx.load_cert_chain(opts["ssl_certfile"], opts.get("ssl_keyfile"))
    reqs = opts.get("ssl_cert_reqs", "required")
    reqs = CERT_REQS.get(str(reqs).lower(), ssl.CERT_REQUIRED) if not isinstance(reqs, ssl.VerifyMode) else reqs
    check = opts.get("ssl_check_hostname")
    ctx.check_hostname = reqs != ssl.CERT_NONE and (check is None or str(check).lower() not in ("false", "0", "no"))
    ctx.verify_mode = reqs
    return ctx


class RespConnection(asyncio.Protocol):
    """One connection; call() writes a command at once and returns the future of its reply. A future cancelled
    by its caller's timeout still takes its reply when it comes, so the ones after it get theirs."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._waiting: deque[asyncio.Future] = deque()
        self._transport: asyncio.Transport | None = None
        self._out: list[bytes] = []  # commands of this turn of the loop, sent together at its end

    @classmethod
    async def open(cls, url: str) -> RespConnection:
        """Connect to a redis://, rediss:// or unix:// URL, then AUTH and SELECT as it says."""
        opts = parse_url(url)
        loop = asyncio.get_running_loop()
        conn = cls()
        if "path" in opts:
            await loop.create_unix_connection(lambda: conn, opts["path"])
        else:
            host, port = opts.get("host", "127.0.0.1"), int(opts.get("port", 6379))
            tls = tls_context(opts) if url.startswith("rediss://") else None
            await loop.create_connection(lambda: conn, host, port, ssl=tls)
        try:
            if opts.get("password"):
                user = opts.get("username")
                await conn.call(*(("AUTH", user) if user else ("AUTH",)), opts["password"])
            if int(opts.get("db", 0)):
                await conn.call("SELECT", int(opts["db"]))
        except BaseException:
            conn.close()
            raise
        return conn

    @property
    def is_open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def call(self, *args: Any) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if not self.is_open:
            fut.set_exception(ConnectionError("no connection to Redis"))
            return fut
        self._waiting.append(fut)
        if not self._out:
            # Requests that arrive together (one read of several connections) share one write, one syscall.
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(encode(args))
        return fut

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self._transport is not None and out:
            self._transport.write(b"".join(out) if len(out) > 1 else out[0])

    def close(self) -> None:
        if self._transport is not None:
            self._transport.abort()  # what was sent and not answered fails now (connection_lost)

    # -- asyncio.Protocol --------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buf += data
        pos = 0
        try:
            while self._waiting:
                value, nxt = parse(self._buf, pos)
                if value is INCOMPLETE:
                    break
                pos = nxt
                fut = self._waiting.popleft()
                if not fut.done():
                    if isinstance(value, RespError):
                        fut.set_exception(value)
                    else:
                        fut.set_result(value)
        except ProtocolError:
            self.close()
            return
        del self._buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(ConnectionError("the connection to Redis was lost"))
