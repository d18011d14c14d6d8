"""One upstream response of the lean HTTP/1.1 client (backends/http1.py), its body handed over as it arrives, and
the connection as the response sees it."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import AsyncIterator, Callable, Final, cast

from gateway.contracts import ReplyTooLarge

# Pause reading from an engine when this much is buffered for a slow client.
HIGH_WATER: Final = 256 * 1024


class Carrier(asyncio.Protocol):
    """An upstream connection as its Response sees it; backends/http1.py's Connection is the one.

    A base class, not a Protocol: a response's calls on its connection (a few a token) stay calls on a compiled
    class.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_timeout: float) -> None:
        self.loop = loop
        self.idle_timeout = idle_timeout  # its pool's: how long a reader waits for the engine's next bytes
        # Set by connection_made, which the event loop calls before the connection is handed out.
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)

    def abandon(self) -> None:
        """Stop using this connection mid-exchange: the engine sees it close."""
        raise NotImplementedError

    def release(self, resp: Response) -> None:
        """The response is done with: a complete one frees the connection, an unfinished one aborts it."""
        raise NotImplementedError


class Response:
    """One upstream response; body chunks are handed over as they arrive, in arrival order.

    `headers` has lower-case names (repeated fields joined with ", "); `header_list` keeps every field.
    """

    __slots__ = ("status", "headers", "_lines", "_conn", "_chunks", "_buffered", "_waiter", "_done",
                 "_error", "_paused", "_idle_by", "_idle_timer", "_sink")

    def __init__(self, conn: Carrier, status: int, headers: dict[str, str], lines: list[str]) -> None:
        self.status = status
        self.headers = headers
        self._lines = lines  # the header lines as received
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._done = False
        self._error: Exception | None = None
        self._paused = False
        self._idle_by = 0.0  # when the wait in progress has waited the pool's idle_timeout (loop time)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._sink: Callable[[bytes], bool] | None = None

    # -- called by the protocol ----------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None and not self._chunks:  # (nothing queued before it: the order holds)
            try:
                taken = sink(data)
            except Exception as e:  # the consumer's own failure: it meets it at its next wait, as if it were its own
                self._sink = None
                self._finish(e)
                self._conn.abandon()
                return
            if taken:
                # The engine sent something: the consumer's wait in progress starts its idle time again.
                self._idle_by = self._conn.loop.time() + self._conn.idle_timeout
                return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self, error: Exception | None = None) -> None:
        if self._done:
            return
        self._done = True
        self._error = error
        self._wake()

    def _idle_check(self) -> None:
        """Fail the wait in progress once it has waited idle_timeout. One timer serves all of a stream's waits (one
        per token): a wait only notes its deadline, and the timer moves on to it when it fires early, or lapses
        when nothing waits (a timer made and cancelled per token was 7 % of a stream's instructions)."""
        self._idle_timer = None
        w = self._waiter
        if w is None or w.done():
            return  # nothing waits: the next wait sets the timer again
        loop = self._conn.loop
        if loop.time() < self._idle_by:
            self._idle_timer = loop.call_at(self._idle_by, self._idle_check)
            return
        w.set_exception(TimeoutError("the engine sent nothing for too long"))
        self._conn.abandon()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- called by the consumer ----------------------------------------------------------------
    def hand_to(self, sink: Callable[[bytes], bool] | None) -> None:
        """Offer each later piece of the body to `sink` as it is read, in the connection's read callback, before
        queueing it for next_chunk: True means taken (a stream's relay takes a token there, with no wake-up of
        the consumer's task). The consumer still waits in next_chunk for what the sink leaves and for the end."""
        self._sink = sink

    async def next_chunk(self, by: float = 0.0) -> bytes | None:
        """The next piece of the body, None at its end; TimeoutError after idle_timeout without one, or at `by`
        (loop time) when that comes sooner."""
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                return None
            loop = self._conn.loop
            self._waiter = w = loop.create_future()
            idle_by = loop.time() + self._conn.idle_timeout
            if by and by < idle_by:
                idle_by = by
                if self._idle_timer is not None:  # (set for a later time by an earlier wait)
                    self._idle_timer.cancel()
                    self._idle_timer = None
            self._idle_by = idle_by
            if self._idle_timer is None:
                self._idle_timer = loop.call_at(self._idle_by, self._idle_check)
            try:
                await w
            finally:
                self._waiter = None
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered < HIGH_WATER // 4:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    @property
    def header_list(self) -> list[tuple[str, str]]:
        """Every header field, in order, repeated ones apart (made on demand: few callers need it)."""
        return [(k, v.strip(" \t")) for k, _, v in (line.partition(":") for line in self._lines)]

    @property
    def streaming(self) -> bool:
        return self.headers.get("content-type", "").startswith("text/event-stream")

    @property
    def broken(self) -> bool:
        return self._done and self._error is not None

    def iter_chunks(self) -> AsyncIterator[bytes]:
        return _Chunks(self)

    async def read(self, limit: int, *, truncate: bool = False) -> bytes:
        """The whole body, up to `limit` bytes. Past it: ReplyTooLarge, or with truncate=True the first
        `limit` bytes; either way the rest is never read and the connection is dropped."""
        parts: list[bytes] = []
        total = 0
        while True:
            data = await self.next_chunk()
            if data is None:
                break
            total += len(data)
            parts.append(data)
            if total > limit:
                self._conn.abandon()
                if not truncate:
                    raise ReplyTooLarge(f"the reply is larger than {limit} bytes")
                return b"".join(parts)[:limit]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Done with the response: a complete one frees the connection, an unfinished one is aborted."""
        self._sink = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._conn.release(self)


class _Chunks:
    """A body's pieces for `async for` (a class, not an async generator: those cannot be compiled ahead of time)."""

    __slots__ = ("_resp",)

    def __init__(self, resp: Response) -> None:
        self._resp = resp

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        data = await self._resp.next_chunk()
        if data is None:
            raise StopAsyncIteration
        return data
