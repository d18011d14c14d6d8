"""What the front's connections share: the owner's settings and hooks, the handlers, and who holds a connection."""

from __future__ import annotations

import asyncio
import resource
from typing import Awaitable, Callable, Protocol

from gateway.apis.api import Api
from gateway.http.exchange import FrontExchange
from gateway.http.hooks import Limits, Owner
from gateway.http.inner import InnerRoutes
from gateway.http.wire import HttpDate

# The handler of an API request (a path of gateway/apis/registry.py, with a method its route allows): the
# application's pipeline, handed to the server. It answers through the exchange however the request ends; what it
# returns is not used.
ApiHandler = Callable[[FrontExchange, Api], Awaitable[object]]


class Held(Protocol):
    """A client connection as the front keeps it (gateway/http/connection.py's FrontConnection)."""

    @property
    def phase(self) -> int: ...

    @property
    def deadline(self) -> float:
        """When the current wait ends (0: no limit)."""

    def expire(self) -> None:
        """The current wait ran out."""

    def evict(self) -> None:
        """Close at once to make room for another connection."""

    def close(self) -> None: ...

    def abort(self) -> None: ...


def connection_limit(configured: int) -> int:
    """Client connections this process can hold: each may need one to an engine, and some files stay spare."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(16, min(configured, (soft - 64) // 2))


class Server:
    """The front as its connections see it; gateway/http/front.py's Front adds the socket, the sweep, shutdown.

    A base class, not a Protocol: a connection's calls on it are calls on a compiled class (several a request).
    """

    def __init__(self, owner: Owner, api: ApiHandler, inner: InnerRoutes) -> None:
        self.owner = owner
        self.api = api
        self.inner = inner
        self.loop = asyncio.get_running_loop()
        self.dates = HttpDate()
        self._limits = Limits(owner.hot)
        self.conns: set[Held] = set()
        # Connections not being served (idle, or still sending a request), oldest first: the ones that make
        # room when the process holds all the connections it can.
        self._waiting: dict[Held, None] = {}
        # Connections part-way through sending a request, oldest first.
        self._reading: dict[Held, None] = {}
        # Connections closing after their last reply (gateway/http/connection.py, LINGER): the first to go.
        self._lingering: dict[Held, None] = {}
        self.max_connections = connection_limit(self._limits.max_connections)
        self.closing = False

    @property
    def cfg(self) -> Limits:
        """The settings now: read on use, so that a reload applies to the next request and the next wait."""
        hot = self.owner.hot
        limits = self._limits
        if limits.source is not hot:
            limits = self._limits = Limits(hot)
        return limits

    def request_id(self) -> str:
        return self.owner.request_ids.next()

    def reject(self, status: int) -> None:
        """Count a request the front refused itself (malformed, too large, too slow)."""
        self.owner.metrics.reject(status)

    # -- who holds a connection, and who gives one up --------------------------------------------
    def admit(self, c: Held) -> None:
        """A new connection; past max_connections one that is closing, idle or slow makes room (else this one)."""
        self.conns.add(c)
        self._waiting[c] = None
        if len(self.conns) > self.max_connections:
            next(iter(self._lingering or self._waiting)).evict()

    def reading(self, c: Held) -> None:
        """c is part-way through a request; past max_reading_connections the oldest such gets 408."""
        self._reading[c] = None
        if len(self._reading) > self.cfg.max_reading_connections:
            next(iter(self._reading)).evict()

    def served(self, c: Held) -> None:
        self._waiting.pop(c, None)
        self._reading.pop(c, None)

    def lingering(self, c: Held) -> None:
        self.served(c)
        self._lingering[c] = None

    def waiting(self, c: Held) -> None:
        self._waiting.pop(c, None)
        self._waiting[c] = None  # to the end: the most recently active

    def forget(self, c: Held) -> None:
        self.conns.discard(c)
        self.served(c)
        self._lingering.pop(c, None)
