"""The side of a client connection a request's exchange uses: writes, the waits on a slow client, the body's wait."""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate
from typing import cast

from gateway.http.hooks import Limits


class HttpDate:
    """The Date header, formatted once a second (one per front, shared by its connections)."""

    def __init__(self) -> None:
        self._text = ""
        self._second = -1

    def now(self) -> str:
        second = int(time.time())
        if self._second != second:
            self._text, self._second = formatdate(second, usegmt=True), second
        return self._text


class Wire(asyncio.Protocol):
    """A client connection as its exchanges see it; gateway/http/connection.py's FrontConnection is the one.

    A base class, not a Protocol: an exchange's writes are calls on a compiled class, as they were when the
    exchange knew the connection itself.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, cfg: Limits, dates: HttpDate) -> None:
        self.loop = loop
        self.cfg = cfg  # the settings read per request, taken afresh for each one (a reload applies)
        self.dates = dates
        # Set by connection_made, which the event loop calls before anything else.
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.closed = False
        self.write_paused = False
        self.deadline = 0.0  # when the current wait ends (0: no limit)
        self.body_waiter: asyncio.Future | None = None
        self.drain_waiter: asyncio.Future | None = None

    def send_now(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def body_arrives(self) -> None:
        """Wait until the reader wakes the body's reader: the body is in, or is too large or too slow to come."""
        self.body_waiter = self.loop.create_future()
        try:
            await self.body_waiter
        finally:
            self.body_waiter = None

    async def send(self, data: bytes) -> None:
        """Write, then wait while the client reads slower than the engine writes (write_timeout_s at most)."""
        self.send_now(data)
        if self.write_paused:
            await self.drained()

    async def drained(self) -> None:
        """Wait until the client has taken enough of its reply to write again (write_timeout_s at most)."""
        if self.write_paused:
            self.deadline = self.loop.time() + self.cfg.write_timeout_s
            self.drain_waiter = self.loop.create_future()
            try:
                await self.drain_waiter
            finally:
                self.drain_waiter = None
                self.deadline = 0.0
