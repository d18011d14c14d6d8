"""The gateway's HTTP/1.1 server: the listening socket, connection caps, the sweep of timed waits, shutdown.

Every client byte is framed by llhttp in strict mode (gateway/http/connection.py); the API routes go to the handler
the application hands over (its pipeline), and every other request reaches aiohttp's routes over socket pairs
inside the process (gateway/http/inner.py). The server knows nothing of routing: what it needs of the application
is in gateway/http/hooks.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gateway.http.connection import IDLE, LINGER, FrontConnection
from gateway.http.hooks import Owner
from gateway.http.inner import InnerRoutes
from gateway.http.server import ApiHandler, Server

__all__ = ["ApiHandler", "Front", "FrontConnection", "Owner", "start_serving"]


class Front(Server):
    """The listening socket: a FrontConnection per client; connection caps, timeouts and shutdown."""

    def __init__(self, runner: web.AppRunner, owner: Owner, api: ApiHandler) -> None:
        super().__init__(owner, api, InnerRoutes(runner))
        self.runner = runner
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None

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
                c.close()
            if not self.conns or self.loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            c.abort()
        self.inner.close()
        await self.runner.cleanup()


async def start_serving(app: web.Application, host: str, port: int, *, owner: Owner, api: ApiHandler,
                        reuse_port: bool = False, shutdown_timeout: float = 60.0) -> Front:
    """Serve `app` on host:port, API requests by `api` (the application's pipeline), with `owner`'s settings,
    request ids and refusal count; `await front.close(timeout)` stops it."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout,
                           keepalive_timeout=owner.hot.keepalive_s)
    await runner.setup()
    front = Front(runner, owner, api)
    try:
        await front.start(host, port, reuse_port=reuse_port)
    except BaseException:
        await runner.cleanup()
        raise
    return front
