"""The gateway's HTTP/1.1 server: the listening socket, connection caps, the sweep of timed waits, shutdown.

Every client byte is framed by llhttp in strict mode (gateway/http/connection.py); the API routes run the pipeline
and every other request reaches aiohttp's routes over socket pairs inside the process (gateway/http/inner.py).
"""

from __future__ import annotations

import asyncio
import resource
import time
from email.utils import formatdate
from typing import Any

from aiohttp import web

from gateway.http.connection import API_ROUTES, IDLE, LINGER, FrontConnection
from gateway.hot_settings import HotSettings
from gateway.http.inner import InnerRoutes
from gateway.routing.request import GATEWAY

__all__ = ["API_ROUTES", "Front", "FrontConnection", "start_serving"]


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
        # Connections closing after their last reply (gateway/http/connection.py, LINGER): the first to go.
        self._lingering: dict[FrontConnection, None] = {}
        self.max_connections = connection_limit(self.cfg.max_connections)
        self.closing = False
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None
        self._date = ("", -1)

    @property
    def cfg(self) -> HotSettings:
        return self.g.hot  # read on use: a reload applies to the next wait

    async def start(self, host: str, port: int, reuse_port: bool = False, backlog: int = 1024) -> None:
        self._server = await self.loop.create_server(lambda: FrontConnection(self), host, port,
                                                     reuse_address=True, reuse_port=reuse_port or None,
                                                     backlog=backlog)
        self._sweeper = asyncio.create_task(self._sweep(), name="front-sweep")

    @property
    def port(self) -> int:
        assert self._server is not None, "the front is not started"
        server: Any = self._server  # uvloop's sockets are a list (typeshed: a tuple, which compiled code checks)
        return server.sockets[0].getsockname()[1]

    def date(self) -> str:
        """The Date header, formatted once a second."""
        now = int(time.time())
        if self._date[1] != now:
            self._date = (formatdate(now, usegmt=True), now)
        return self._date[0]

    # -- who holds a connection, and who gives one up --------------------------------------------
    def admit(self, c: FrontConnection) -> None:
        """A new connection; past max_connections one that is closing, idle or slow makes room (else this one)."""
        self.conns.add(c)
        self._waiting[c] = None
        if len(self.conns) > self.max_connections:
            next(iter(self._lingering or self._waiting)).evict()

    def reading(self, c: FrontConnection) -> None:
        """c is part-way through a request; past max_reading_connections the oldest such gets 408."""
        self._reading[c] = None
        if len(self._reading) > self.cfg.max_reading_connections:
            next(iter(self._reading)).evict()

    def served(self, c: FrontConnection) -> None:
        self._waiting.pop(c, None)
        self._reading.pop(c, None)

    def lingering(self, c: FrontConnection) -> None:
        self.served(c)
        self._lingering[c] = None

    def waiting(self, c: FrontConnection) -> None:
        self._waiting.pop(c, None)
        self._waiting[c] = None  # to the end: the most recently active

    def forget(self, c: FrontConnection) -> None:
        self.conns.discard(c)
        self.served(c)
        self._lingering.pop(c, None)

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
