"""GET /admin/experiments (state and verdicts) and PUT /admin/experiments/{name} (weights, stop, fraction)."""

from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web

from gateway.config_experiments import weight_problem
from gateway.errors import GatewayError, bad_request
from gateway.experiments.experiment import check_change
from gateway.experiments.report import report
from gateway.runtime import GATEWAY

EXPERIMENT_SHARE: web.AppKey = web.AppKey("experiment_share")
CHANGES = ("weights", "enabled", "fraction")
REPORT_CACHE_S = 2.0  # a dashboard polling every second does not recompute every bootstrap each time


async def experiments_report(app: web.Application) -> dict:
    """Every experiment with its verdicts; the statistics run in a thread, off the event loop."""
    g = app[GATEWAY]
    share = app.get(EXPERIMENT_SHARE)
    cached = g.experiments_cache
    key = (id(g.experiments), tuple(x.version for x in g.experiments.by_name.values()))
    if cached is not None and cached[0] == key and time.monotonic() - cached[1] < REPORT_CACHE_S:
        return cached[2]
    snaps = g.experiments.snapshot(share.remote_samples if share is not None else lambda name: [])
    data = await asyncio.to_thread(lambda: [report(s) for s in snaps])
    result = {"object": "list", "data": data, "generated_at": round(time.time(), 3)}
    g.experiments_cache = (key, time.monotonic(), result)
    return result


async def list_experiments(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(await experiments_report(request.app)), content_type="application/json")


def _weights_problem(weights: object) -> str | None:
    """Weights past MAX_WEIGHT (check_change has taken the rest): their total could pass a float's range."""
    if not isinstance(weights, dict):
        return None
    return next((why for name, w in weights.items() if (why := weight_problem(str(name), w)) is not None), None)


async def change_experiment(request: web.Request) -> web.Response:
    """Weights (a canary ramp), enabled (stop or restart) or a shadow's fraction; all or nothing."""
    g = request.app[GATEWAY]
    g.auth.require_admin(request.headers)
    name = request.match_info["name"]
    x = g.experiments.by_name.get(name)
    if x is None:
        raise GatewayError(404, f"No experiment named {name[:64]!r}.", code="experiment_not_found")
    try:
        change = orjson.loads(await request.read())
    except orjson.JSONDecodeError as e:
        raise bad_request(f"The request body is not valid JSON: {e}.", code="invalid_json") from None
    if not isinstance(change, dict) or not change:
        raise bad_request(f"Expected a JSON object with one or more of: {', '.join(CHANGES)}.")
    unknown = sorted(k for k in change if k not in CHANGES)
    if unknown:
        raise bad_request(f"Unknown field {unknown[0][:64]!r}; expected {', '.join(CHANGES)}.", param=unknown[0][:64])
    why = check_change(x, change) or _weights_problem(change.get("weights"))
    if why is not None:
        param = next((k for k in CHANGES if k in change and k in why), None)
        raise bad_request(f"No change made: {why}.", param=param, code="invalid_experiment_change")
    share = request.app.get(EXPERIMENT_SHARE)
    version = await share.next_version(x.version) if share is not None else x.version + 1
    x.change(change.get("weights"), change.get("enabled"), change.get("fraction"))
    x.version = version
    shared = await share.publish(g.experiments) if share is not None and share.active else None
    out = {"name": x.name, **x.control(), "shared": shared}
    if shared and share is not None and share.client is not None:
        # Taken by Redis is not applied everywhere: each other replica says whether it applied this version, or
        # why it refused it (another configuration of the experiment, say); `shared` only when all of them did.
        replicas = await share.confirm(x.name, version)
        out["shared"] = not replicas["refused"] and not replicas["pending"]
        out["replicas"] = replicas
    return web.Response(body=orjson.dumps(out), content_type="application/json")
