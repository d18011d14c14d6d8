"""GET /admin/probe: the support probe of every configured backend, run from this process, as JSON."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from aiohttp import web

from gateway.fleet.probe import probe_fleet, report
from gateway.http.inner import INNER_TIMEOUT_S
from gateway.runtime import GATEWAY, Gateway

# The whole probe ends this long before the front stops waiting for the route's reply: checks not started by
# then are reported as not tried, and the report still arrives.
MARGIN_S = 10.0
BUDGET_S = INNER_TIMEOUT_S - MARGIN_S


class ProbeRunner:
    """One probe at a time per process: a request that comes while one runs gets that run's report, and a client
    that leaves does not stop it for the others."""

    def __init__(self) -> None:
        self.running: asyncio.Task[dict[str, Any]] | None = None

    async def report(self, g: Gateway) -> dict[str, Any]:
        task = self.running
        if task is None or task.done():
            task = self.running = asyncio.create_task(self._probe(g), name="admin-probe")
        return await asyncio.shield(task)

    @staticmethod
    async def _probe(g: Gateway) -> dict[str, Any]:
        cfg = g.cfg.probe
        timeout = min(cfg.timeout_s, BUDGET_S)
        deadline = asyncio.get_running_loop().time() + BUDGET_S
        configured = [b for b in g.pool.all() if g.pool.get(b.id) is b]  # not those draining after a reload
        rows = await probe_fleet(configured, timeout, cfg.concurrency, deadline)
        out = report(rows, cfg.require, timeout)
        out["budget_s"] = BUDGET_S
        return out

    async def stop(self) -> None:
        task, self.running = self.running, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


PROBE_RUNNER: web.AppKey[ProbeRunner] = web.AppKey("probe_runner", ProbeRunner)


async def probe_report(request: web.Request) -> web.Response:
    """The caller's key or cookie is checked by the route (as for /stats)."""
    data = await request.app[PROBE_RUNNER].report(request.app[GATEWAY])
    return web.Response(body=orjson.dumps(data), content_type="application/json")


async def stop_probe(app: web.Application) -> None:
    await app[PROBE_RUNNER].stop()
