"""build_app(cfg): routes, middlewares and lifetimes (client session, probe and load loops) of the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from typing import AsyncIterator

import aiohttp
import orjson
from aiohttp import web

from gateway import pipeline
from gateway.config import GatewayConfig
from gateway.dashboard import session_principal, setup_dashboard
from gateway.errors import GatewayError
from gateway.health import load_loop, probe_loop
from gateway.pipeline import GATEWAY, PRINCIPAL, REQUEST_ID
from gateway.reload import RELOADER, Reloader, admin_reload
from gateway.runtime import Gateway, RequestIds, stats_report
from gateway.state import shared_state

log = logging.getLogger("shapegate")

# Routes that answer without an API key: liveness for orchestrators, the dashboard's own sign-in.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
OPEN_PREFIXES = ("/dashboard",)


def _error_response(err: GatewayError, request_id: str) -> web.Response:
    headers = {"x-request-id": request_id, **err.headers}
    return web.Response(body=err.body(), status=err.status, content_type="application/json", headers=headers)


@web.middleware
async def errors_and_auth(request: web.Request, handler) -> web.StreamResponse:
    """Request id, API key and body limit first; every error leaves as OpenAI-shaped JSON."""
    g: Gateway = request.app[GATEWAY]
    rid = request.headers.get("x-request-id") or request.app[REQUEST_IDS].next()
    request[REQUEST_ID] = rid
    try:
        path = request.path
        if path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES) and not (
                path == "/metrics" and not g.cfg.metrics.require_admin):
            request[PRINCIPAL] = g.auth.authenticate(request.headers)
        length = request.content_length
        if length is not None and length > g.cfg.server.max_body_bytes:
            # Refuse before reading: the body of a too-large request is never buffered.
            raise GatewayError(413, f"The request body ({length} bytes) exceeds the limit of "
                               f"{g.cfg.server.max_body_bytes} bytes.", code="request_too_large")
        resp = await handler(request)
    except GatewayError as e:
        if e.status in (503, 429):
            g.metrics.reject(e.status)
        return _error_response(e, rid)
    except web.HTTPRequestEntityTooLarge:
        return _error_response(GatewayError(413, f"The request body exceeds the limit of "
                                            f"{g.cfg.server.max_body_bytes} bytes.", code="request_too_large"), rid)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = GatewayError(e.status, e.reason or "error",
                           code={404: "not_found", 405: "method_not_allowed"}.get(e.status))
        return _error_response(err, rid)
    if "x-request-id" not in resp.headers and not resp.prepared:
        resp.headers["x-request-id"] = rid
    return resp


async def _served(request: web.Request, route: str) -> web.StreamResponse:
    """Run the pipeline; the request gets exactly one access-log line however it ends."""
    status = 500
    try:
        resp = await pipeline.handle(request, route)
        status = resp.status
        return resp
    except GatewayError as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away first
        raise
    finally:
        request.app[GATEWAY].log_request(request, status)


async def chat(request: web.Request) -> web.StreamResponse:
    return await _served(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _served(request, "completions")


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _served(request, "embeddings")


async def models(request: web.Request) -> web.Response:
    g: Gateway = request.app[GATEWAY]
    data = [{"id": m, "object": "model", "created": g.started, "owned_by": "shapegate"} for m in g.pool.models()]
    return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    g: Gateway = request.app[GATEWAY]
    ready = g.pool.is_ready() and not g.stopping
    return web.json_response({"ready": ready, "backends": {b.id: b.health.state for b in g.pool.all()}},
                             status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    g: Gateway = request.app[GATEWAY]
    if not g.cfg.metrics.enabled:
        raise web.HTTPNotFound()
    if g.cfg.metrics.require_admin:
        g.auth.require_admin(request.headers)
    return web.Response(body=g.metrics.exposition(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def stats(request: web.Request) -> web.Response:
    g: Gateway = request.app[GATEWAY]
    # An admin key, or the dashboard's signed sign-in cookie.
    if session_principal(request, request.app[DASHBOARD_SECRET]) is None:
        g.auth.require_admin(request.headers)
    return web.Response(body=orjson.dumps(stats_report(g)), content_type="application/json")


SHUTTING_DOWN: web.AppKey[bool] = web.AppKey("shutting_down", bool)
DASHBOARD_SECRET: web.AppKey[bytes] = web.AppKey("dashboard_secret", bytes)
REQUEST_IDS: web.AppKey[RequestIds] = web.AppKey("request_ids", RequestIds)


def dashboard_secret(cfg: GatewayConfig) -> bytes:
    """The cookie-signing secret: from the environment (replicas share it), else random per process."""
    env = cfg.dashboard.session_secret_env
    value = os.environ.get(env, "") if env else ""
    if env and len(value) < 16:
        raise ValueError(f"environment variable {env} must hold a dashboard secret of at least 16 characters")
    return value.encode() if value else secrets.token_bytes(32)


async def client_session(app: web.Application) -> AsyncIterator[None]:
    """One pooled upstream session for all backends; TCP_NODELAY on, bounded connections."""
    g: Gateway = app[GATEWAY]
    u = g.cfg.upstream
    connector = aiohttp.TCPConnector(limit=u.pool_limit, limit_per_host=u.pool_limit_per_backend,
                                     keepalive_timeout=u.keepalive_s, ttl_dns_cache=300,
                                     family=socket.AF_UNSPEC)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                    json_serialize=lambda o: orjson.dumps(o).decode(),
                                    skip_auto_headers=("User-Agent", "Accept-Encoding"))
    g.attach(session)
    yield
    for b in g.pool.all():
        b.adapter.close()
    await session.close()


async def routing_state(app: web.Application) -> AsyncIterator[None]:
    """Replicas share prefix/session affinity through the configured store, off the request path."""
    g: Gateway = app[GATEWAY]
    async with shared_state(g.affinity_index, g.cfg.state):
        yield


async def background_loops(app: web.Application) -> AsyncIterator[None]:
    g: Gateway = app[GATEWAY]
    # The loops read g.cfg on every round, so a reloaded [health] section applies without a restart.
    tasks = [asyncio.create_task(probe_loop(g.pool, lambda: g.cfg.health,
                                            lambda b, state: g.metrics.health_change(b.id, state)),
                                 name="probe-loop"),
             asyncio.create_task(load_loop(g.pool, lambda: g.cfg.health), name="load-loop"),
             asyncio.create_task(_flush_loop(g), name="log-flush")]
    yield
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    g.access_log.close()


async def _flush_loop(g: Gateway) -> None:
    while True:
        await asyncio.sleep(0.2)
        g.access_log.flush()
        g.metrics.refresh()  # with several workers: this one's pool view, for whichever answers a scrape


def build_app(cfg: GatewayConfig, config_path: str | None = None) -> web.Application:
    app = web.Application(middlewares=[errors_and_auth], client_max_size=cfg.server.max_body_bytes,
                          handler_args={"tcp_keepalive": True})
    app[GATEWAY] = Gateway(cfg)
    app[SHUTTING_DOWN] = False
    app[REQUEST_IDS] = RequestIds()
    app[RELOADER] = Reloader(app[GATEWAY], config_path)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app[DASHBOARD_SECRET] = dashboard_secret(cfg)
    if cfg.dashboard.enabled:
        gw = app[GATEWAY]
        setup_dashboard(app, admin_for_key=gw.auth.admin_for_key, session_secret=app[DASHBOARD_SECRET],
                        stats_provider=lambda: stats_report(gw), secure_cookie=cfg.dashboard.secure_cookie,
                        session_ttl_s=cfg.dashboard.session_ttl_s)
    app.router.add_post("/admin/reload", admin_reload)
    app.cleanup_ctx.append(client_session)
    app.cleanup_ctx.append(background_loops)
    app.cleanup_ctx.append(routing_state)
    return app

