"""build_app(cfg): routes, middlewares and lifetimes (client session, probe and load loops) of the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import time
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from gateway.config import GatewayConfig, StateConfig
from gateway.dashboard import FeedHistory, session_principal, setup_dashboard
from gateway.errors import GatewayError
from gateway.experiments.share import ExperimentShare
from gateway.experiments.share import share_loop as experiment_share_loop
from gateway.fleet.health import load_loop, probe_loop
from gateway.apis.api import Api
from gateway.apis.registry import known_paths
from gateway.errors import model_not_found
from gateway.http.front import Front, start_serving
from gateway.http.inner import PEER_HEADER, unknown_path
from gateway.observe.loop_watch import GcWatch, release_heap, settle_heap, watch_lag
from gateway.ops.admin_experiments import EXPERIMENT_SHARE, change_experiment, list_experiments
from gateway.ops.admin_keys import admin_binding, create_key, list_keys, revoke_key
from gateway.ops.admin_probe import PROBE_RUNNER, ProbeRunner, probe_report, stop_probe
from gateway.ops.keys_view import keys_view
from gateway.ops.reload import RELOADER, Reloader, admin_reload
from gateway.ops.replica_sync import ReplicaSync
from gateway.ops.workers import GROUP_SECRET_ENV
from gateway.pipeline import serve_api
from gateway.routing.affinity import AffinityIndex, RedisStore, StateStore, sync_loop
from gateway.routing.request import Exchange
from gateway.runtime import GATEWAY, Gateway, stats_report
from gateway.stats.merge import fold_counters, replicas_report, take_summary
from gateway.stats.share import share_loop

log = logging.getLogger("shapegate")

def _error_response(err: GatewayError, request_id: str) -> web.Response:
    return web.Response(body=err.body(), status=err.status, headers=err.reply_headers(request_id))


def guarded(handler, *, key: bool = True):
    """Any other route: request id, API key unless key=False, and errors as OpenAI-shaped JSON. The front has
    read these requests already (and checked their request id and body size) before aiohttp sees them."""

    async def route(request: web.Request) -> web.StreamResponse:
        g: Gateway = request.app[GATEWAY]
        rid = request.headers.get("x-request-id") or g.request_ids.next()
        try:
            if key:
                g.auth.authenticate(request.headers)
            resp = await handler(request)
        except GatewayError as e:
            return _error_response(e, rid)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error_response(_http_error(e.status, e.reason), rid)
        if "x-request-id" not in resp.headers and not resp.prepared:
            resp.headers["x-request-id"] = rid
        return resp

    return route


def _http_error(status: int, reason: str | None) -> GatewayError:
    return GatewayError(status, reason or "error", code={404: "not_found", 405: "method_not_allowed"}.get(status))


async def unmatched(request: web.Request) -> web.Response:
    """The last route: an unknown path is a 404, a known path with another method a 405 (both as JSON)."""
    allowed = sorted({r.method for r in request.app.router.routes()
                      if r.resource is not None and r.resource.canonical == request.path and r.method != "*"})
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    known = {*known_paths(), *(r.resource.canonical for r in request.app.router.routes() if r.resource is not None)}
    raise GatewayError(404, unknown_path(request.path, known), code="not_found")


def _model_card(g: Gateway, model: str) -> dict:
    card: dict = {"id": model, "object": "model", "created": g.started, "owned_by": "shapegate"}
    window = g.pool.largest_window(model)
    if window is not None:
        card["max_model_len"] = window  # the largest context window among its backends, as vLLM's cards say it
    return card


async def models(request: web.Request) -> web.Response:
    g: Gateway = request.app[GATEWAY]
    data = [_model_card(g, m) for m in g.pool.models()]
    return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: one model's card (a model id may hold slashes); an unknown one is model_not_found."""
    g: Gateway = request.app[GATEWAY]
    name = request.match_info["model"]
    if not g.pool.serves(name):
        raise model_not_found(name[:256])
    return web.Response(body=orjson.dumps(_model_card(g, name)), content_type="application/json")


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


def signed_in(request: web.Request) -> bool:
    """The request carries a dashboard sign-in cookie of a key that is a live admin key right now."""
    g: Gateway = request.app[GATEWAY]
    binding = functools.partial(admin_binding, g)
    return session_principal(request, request.app[DASHBOARD_SECRET], binding=binding) is not None


async def stats(request: web.Request) -> web.Response:
    g: Gateway = request.app[GATEWAY]
    # An admin key, or the dashboard's signed sign-in cookie.
    if not signed_in(request):
        g.auth.require_admin(request.headers)
    scope = request.query.get("scope", "group")
    if scope not in ("group", "replicas"):
        raise GatewayError(400, "scope must be `group` (this replica's workers) or `replicas` (every replica "
                           "sharing the Redis store).", param="scope", code="invalid_scope")
    report = stats_report(g) if scope == "group" else replicas_report(g)
    return web.Response(body=orjson.dumps(report), content_type="application/json")


async def experiments(request: web.Request) -> web.Response:
    """GET /admin/experiments: an admin key or the dashboard's sign-in cookie, as for /stats."""
    if not signed_in(request):
        request.app[GATEWAY].auth.require_admin(request.headers)
    return await list_experiments(request)


async def probe(request: web.Request) -> web.Response:
    """GET /admin/probe: an admin key or the dashboard's sign-in cookie, as for /stats."""
    if not signed_in(request):
        request.app[GATEWAY].auth.require_admin(request.headers)
    return await probe_report(request)


DASHBOARD_SECRET: web.AppKey[bytes] = web.AppKey("dashboard_secret", bytes)
FEED_HISTORY: web.AppKey[FeedHistory] = web.AppKey("feed_history", FeedHistory)


def dashboard_secret(cfg: GatewayConfig) -> bytes:
    """The cookie-signing secret: from the configured environment variable (replicas share it), else the one
    `serve --workers N` made for its workers (gateway/ops/workers.py), else random for this process alone."""
    env = cfg.dashboard.session_secret_env or (GROUP_SECRET_ENV if GROUP_SECRET_ENV in os.environ else None)
    value = os.environ.get(env, "") if env else ""
    if env and len(value) < 16:
        raise ValueError(f"environment variable {env} must hold a dashboard secret of at least 16 characters")
    return value.encode() if value else secrets.token_bytes(32)


PROBE_CONNECTIONS_PER_BACKEND = 8


async def client_session(app: web.Application) -> AsyncIterator[None]:
    """The session of probes and load scrapes (requests go through each adapter's own pool)."""
    g: Gateway = app[GATEWAY]
    u = g.cfg.upstream
    # Probes, load scrapes and warm-ups only: a few at a time per backend (client traffic has its own pools).
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=PROBE_CONNECTIONS_PER_BACKEND,
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
    for t in list(g.background_tasks):
        t.cancel()  # each records itself as failed (the gateway stopped) before it ends
    if g.background_tasks:
        await asyncio.wait(list(g.background_tasks), timeout=g.cfg.state.redis_timeout_s * 4)
    if g.engine_index is not None:
        await g.engine_index.close()  # its last writes to Redis, within their timeout
    if g.store is not None:
        await g.store.close()


async def shared_limits(app: web.Application) -> AsyncIterator[None]:
    """Rate limits in Redis (with Redis state): the scripts loaded up front, settlements sent until the end."""
    shared = app[GATEWAY].limiter.shared
    if shared is None:
        yield
        return
    async with shared.running():
        yield


async def loop_health(app: web.Application) -> AsyncIterator[None]:
    """The loop's lag and GC pauses in /metrics, measured for as long as the app runs."""
    m = app[GATEWAY].metrics
    lag = m.loop_lag.labels()
    pauses = {gen: m.gc_pause.labels(str(gen)) for gen in (0, 1, 2)}
    gc_watch = GcWatch(lambda gen, s: pauses[gen].observe(s))
    gc_watch.install()
    frozen = app[GATEWAY].cfg.server.gc_freeze
    if frozen:
        settle_heap()
    task = asyncio.create_task(watch_lag(lag.observe, gc_watch), name="loop-lag")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    gc_watch.remove()
    if frozen:
        release_heap()


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
             asyncio.create_task(_flush_loop(g, app.get(FEED_HISTORY)), name="log-flush")]
    # Other workers and replicas read this process's stats summary; it is published off the request path.
    stop_sharing = asyncio.Event()
    sharing = (asyncio.create_task(share_loop(g.sharing, lambda: take_summary(g), stop_sharing), name="stats-share")
               if g.sharing.active else None)
    # Experiments' run-time changes and samples reach the other workers and replicas the same way.
    share = app[EXPERIMENT_SHARE] = ExperimentShare(g.sharing)
    exp_sharing = (asyncio.create_task(experiment_share_loop(share, lambda: g.experiments, stop_sharing),
                                       name="experiment-share") if share.active else None)
    # Latency learning and breaker openings go to the other replicas and theirs come in (first pulled here).
    replicas = await ReplicaSync.start(g) if g.sharing.redis is not None else None
    await g.keys.start()  # run-time keys loaded before the first request, then kept in step with the store
    clash = sorted({k.id for k in g.cfg.auth.keys} & g.keys.records.keys())
    if clash:  # made by a replica configured otherwise: a reload here would be refused (gateway/ops/reload.py)
        log.warning("run-time keys %s have ids that [[auth.keys]] also holds; revoke them (DELETE /admin/keys/<id>) "
                    "or rename the configured keys", ", ".join(clash))
    yield
    await g.keys.stop()
    for t in list(g.shadow_tasks):
        t.cancel()  # copies are worth nothing once the gateway stops; they never delay a shutdown
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    if sharing is not None:
        stop_sharing.set()
        await sharing  # ends within one store round trip (each bounded by redis_timeout_s)
    if exp_sharing is not None:
        stop_sharing.set()
        await exp_sharing
    else:
        await share.close()
    if replicas is not None:
        await replicas.stop()
    g.access_log.close()
    g.metrics.refresh()  # with several workers: this one's last counts, for the workers still serving


async def _flush_loop(g: Gateway, history: FeedHistory | None) -> None:
    while True:
        await asyncio.sleep(0.2)
        g.access_log.flush()
        now = time.monotonic()
        fold_counters(g, now)  # breaker openings reach /metrics within 0.2 s
        g.metrics.refresh()  # with several workers: this one's pool view, for whichever answers a scrape
        if history is not None:  # the dashboard's charts' past: the feed as it is now, once a second
            history.sample(lambda: stats_report(g), now)


@contextlib.asynccontextmanager
async def shared_state(index: AffinityIndex | None, cfg: StateConfig) -> AsyncIterator[StateStore | None]:
    """While the app runs: with `backend = "redis"`, sync the index through Redis in the background."""
    if index is None or cfg.backend != "redis":
        yield None
        return
    store = RedisStore.from_url(cfg.redis_url, cfg.key_prefix, cfg.affinity_ttl_s, cfg.redis_timeout_s)
    stop = asyncio.Event()
    task = asyncio.create_task(sync_loop(index, store, cfg.flush_interval_s, stop), name="state-sync")
    try:
        yield store
    finally:
        stop.set()
        await task  # ends within one store round trip (each bounded by redis_timeout_s)
        await index.sync(store)  # last batch; a store error is logged, never raised
        await store.close()


def build_app(cfg: GatewayConfig, config_path: str | None = None) -> web.Application:
    app = web.Application(client_max_size=cfg.server.max_body_bytes, handler_args={"tcp_keepalive": True})
    app[GATEWAY] = Gateway(cfg)
    app[RELOADER] = Reloader(app[GATEWAY], config_path)
    r = app.router  # the API routes themselves are served by the front (gateway/http/front.py)
    r.add_get("/v1/models", guarded(models))
    r.add_get("/v1/models/{model:.+}", guarded(model))
    # Liveness and readiness answer without a key (orchestrators); /metrics asks for an admin key itself
    # when configured to (read per scrape, so that a reload applies).
    r.add_get("/healthz", guarded(healthz, key=False))
    r.add_get("/readyz", guarded(readyz, key=False))
    r.add_get("/metrics", guarded(metrics, key=False))
    r.add_get("/stats", guarded(stats, key=False))  # its own check: admin key or the dashboard cookie
    app[DASHBOARD_SECRET] = dashboard_secret(cfg)
    if cfg.dashboard.enabled:
        gw = app[GATEWAY]
        # Each worker keeps the feed it would serve (its process group merged), so any of them fills the charts.
        history = app[FEED_HISTORY] = FeedHistory()
        # admin_for_key through gw.auth as it is at each sign-in: a reload replaces the Authenticator.
        setup_dashboard(app, admin_for_key=lambda key: gw.auth.admin_for_key(key),
                        session_secret=app[DASHBOARD_SECRET],
                        stats_provider=lambda: stats_report(gw), secure_cookie=cfg.dashboard.secure_cookie,
                        session_ttl_s=cfg.dashboard.session_ttl_s,
                        wrap=lambda h: guarded(h, key=False),  # its own sign-in: cookie or admin key
                        session_binding=functools.partial(admin_binding, gw), peer_header=PEER_HEADER,
                        history=history, keys_provider=lambda: keys_view(gw))
    r.add_post("/admin/reload", guarded(admin_reload))
    r.add_get("/admin/experiments", guarded(experiments, key=False))  # its own check: admin key or cookie
    r.add_put("/admin/experiments/{name}", guarded(change_experiment))
    r.add_get("/admin/probe", guarded(probe, key=False))  # its own check: admin key or cookie
    app[PROBE_RUNNER] = ProbeRunner()
    app.on_shutdown.append(stop_probe)
    r.add_get("/admin/keys", guarded(list_keys))
    r.add_post("/admin/keys", guarded(create_key))
    r.add_delete("/admin/keys/{id}", guarded(revoke_key))
    r.add_route("*", "/{tail:.*}", guarded(unmatched, key=False))
    app.cleanup_ctx.append(client_session)
    app.cleanup_ctx.append(background_loops)
    app.cleanup_ctx.append(routing_state)
    app.cleanup_ctx.append(loop_health)
    app.cleanup_ctx.append(shared_limits)
    return app


async def serve(app: web.Application, host: str, port: int, *, reuse_port: bool = False,
                shutdown_timeout: float = 60.0) -> Front:
    """Serve a built app on host:port: the front is handed the pipeline for API requests, and the gateway for
    its settings, request ids and refusal count. `await front.close(timeout)` stops it."""
    g = app[GATEWAY]
    # Typed as the pipeline takes it, so that mypy checks here that the front's exchange is an Exchange.
    api: Callable[[Exchange, Api], Awaitable[object]] = functools.partial(serve_api, g)
    return await start_serving(app, host, port, owner=g, api=api, reuse_port=reuse_port,
                               shutdown_timeout=shutdown_timeout)
