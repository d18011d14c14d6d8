"""The gateway's other routes (models, health, metrics, stats, admin, dashboard): aiohttp serves them behind
the front, over socket pairs inside the process, so it only ever reads requests the front parsed and checked."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable, Collection

from aiohttp import web

from backends.http1 import Connection, HostPool
from gateway.contracts import UpstreamError
from gateway.errors import GatewayError
from gateway.http.exchange import FrontExchange

log = logging.getLogger("shapegate")

# The client's address as the front's socket saw it, for the routes that need it (the dashboard's sign-in
# throttle): set here only, a client's own field of that name is dropped.
PEER_HEADER = "x-shapegate-peer"
# Not passed on: fields about the client's connection to the front, and the ones this hop sets itself.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                        "upgrade", "content-length", "host", "expect", "x-request-id", "http2-settings",
                        PEER_HEADER})
REPLY_SKIP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"})
INNER_CONNECTIONS = 8  # these routes are light; more requests wait for a free connection
INNER_TIMEOUT_S = 60.0  # a reload or a stats page; none of them stream
INNER_REPLY_LIMIT = 64 * 1024 * 1024


def unknown_path(path: str, known: Collection[str]) -> str:
    """The message of a 404: the path that was asked for, and the known path it most likely meant (a client whose
    base URL lacks /v1, or has it twice, or a trailing slash), else where the API is."""
    shown = path if len(path) <= 200 else path[:200] + "..."
    bare = path.rstrip("/") or "/"
    for guess in (bare, "/v1" + bare, bare.removeprefix("/v1")):
        if guess != path and guess in known:
            return f"Unknown path {shown}; did you mean {guess}?"
    return f"Unknown path {shown}; the API is under /v1 (e.g. /v1/chat/completions, /v1/models)."


class InnerRoutes:
    """A small pool of in-process connections to aiohttp's server (nothing listens on a port for it)."""

    def __init__(self, runner: web.AppRunner) -> None:
        server = runner.server
        assert server is not None, "the runner is set up first"
        self._factory = server
        self._pool: HostPool | None = None

    async def _open(self, make: Callable[[], Connection]) -> Connection:
        a, b = socket.socketpair()
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(self._factory, a)
            _, conn = await loop.create_connection(make, sock=b)
        except BaseException:
            a.close()
            b.close()
            raise
        return conn

    async def serve(self, ex: FrontExchange, request_id: str) -> FrontExchange:
        """Pass one request on (HEAD as GET: the front drops the body) and relay aiohttp's whole reply."""
        if self._pool is None:
            self._pool = HostPool("http://shapegate.internal", INNER_CONNECTIONS, 5.0, 30.0, INNER_TIMEOUT_S,
                                  opener=self._open)
        try:
            body = await ex.read()
        except GatewayError as err:  # too large, or too slow
            return ex.reply(err.status, {"x-request-id": request_id, "x-shapegate-reason": err.code or "refused",
                                         **err.headers}, err.body())
        headers = [(k, v) for k, v in ex.headers.items() if k not in HOP_BY_HOP]
        headers.append(("x-request-id", request_id))
        peer = ex.conn.transport.get_extra_info("peername")
        headers.append((PEER_HEADER, str(peer[0]) if isinstance(peer, tuple) and peer else ""))
        method = "GET" if ex.method == "HEAD" else ex.method
        try:
            resp = await self._pool.request(method, ex.target, headers, body, INNER_TIMEOUT_S)
            try:
                data = await resp.read(INNER_REPLY_LIMIT)
            finally:
                resp.close()
        except (UpstreamError, TimeoutError, OSError) as e:
            log.error("an inner route failed: %s", type(e).__name__)
            failed = GatewayError(500, "The gateway failed to process the request.", code="internal_error")
            return ex.reply(500, {"x-request-id": request_id}, failed.body())
        return ex.reply(resp.status, [(k, v) for k, v in resp.header_list if k.lower() not in REPLY_SKIP], data)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
