"""GET /admin/usage and the dashboard's usage view: the usage ledger over a time range, grouped and priced."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from gateway.errors import GatewayError
from gateway.runtime import GATEWAY, Gateway
from gateway.stats import ledger_report
from gateway.stats.ledger_store import StoreError

DEFAULT_SPAN_S = 7 * 86400  # the range when none is given: the last 7 days, up to now
MAX_FILTER_LEN = 256
DASHBOARD_DAYS = (1, 7, 30, 90)


def _bad(message: str, param: str) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_usage_query")


def _time(query: Mapping[str, str], name: str, default: float, now: float) -> float:
    text = query.get(name)
    if text is None:
        return default
    try:
        return ledger_report.parse_time(text, now)
    except ValueError as e:
        raise _bad(f"`{name}`: {e}", name) from None


def parse_query(query: Mapping[str, str], retention_days: int, now: float) -> tuple[int, int, tuple[str, ...],
                                                                                   dict[str, str]]:
    """(first hour, last hour, grouping, filters) of a request's query string, or a 400 naming the parameter.
    `from` and `to` take what ledger_report.parse_time does; `by` a comma-separated list of GROUPS."""
    first = _time(query, "from", now - DEFAULT_SPAN_S, now)
    last = _time(query, "to", now, now)
    if last < first:
        raise _bad("`to` is before `from`.", "to")
    oldest = int(now // 3600) - retention_days * 24  # nothing older is kept: no need to ask the store for it
    first_hour, last_hour = max(int(first // 3600), oldest), min(int(last // 3600), int(now // 3600))
    by = tuple(g.strip() for g in query.get("by", "key").split(",") if g.strip())
    unknown = [g for g in by if g not in ledger_report.GROUPS]
    if not by or unknown or len(set(by)) != len(by):
        raise _bad(f"`by` takes a comma-separated list of {', '.join(ledger_report.GROUPS)}, each once.", "by")
    filters = {}
    for name in ledger_report.FILTERS:
        value = query.get(name)
        if value is not None:
            if len(value) > MAX_FILTER_LEN:
                raise _bad(f"`{name}` is longer than {MAX_FILTER_LEN} characters.", name)
            filters[name] = value
    return first_hour, last_hour, by, filters


async def _rows(g: Gateway, first_hour: int, last_hour: int) -> dict:
    if g.usage is None:
        raise GatewayError(404, "The usage ledger is off ([usage] enabled = false).", code="usage_disabled")
    if last_hour < first_hour:
        return {}
    try:
        return await g.usage.store.read(first_hour, last_hour)
    except StoreError as e:
        raise GatewayError(503, f"The usage store did not answer: {e}", code="usage_store_unavailable") from None


def _about(g: Gateway, first_hour: int, last_hour: int) -> dict[str, Any]:
    """What every report says of itself: its range, where the figures come from and how complete they are."""
    u = g.usage
    assert u is not None
    return {"from": first_hour * 3600, "to": (last_hour + 1) * 3600, "store": u.store.kind,
            "scope": "replicas" if u.store.kind == "redis" else "process",
            "retention_days": g.cfg.usage.retention_days, "currency": g.cfg.usage.currency,
            "flush_interval_s": g.cfg.usage.flush_interval_s,
            "unsent_rows": u.waiting_rows, "lost_rows": u.lost_rows}


async def usage_report(g: Gateway, query: Mapping[str, str]) -> dict[str, Any]:
    now = time.time()
    first_hour, last_hour, by, filters = parse_query(query, g.cfg.usage.retention_days, now)
    rows = await _rows(g, first_hour, last_hour)
    return {**_about(g, first_hour, last_hour), "filters": filters,
            **ledger_report.build(rows, by, filters, g.cfg.usage.prices)}


async def usage(request: web.Request) -> web.Response:
    """GET /admin/usage?from=&to=&by=key,model,api,backend,hour,day&key=&model=&api=&backend= (admin key or the
    dashboard's cookie: checked by the caller)."""
    report = await usage_report(request.app[GATEWAY], request.query)
    return web.Response(body=orjson.dumps(report), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


async def dashboard_usage(g: Gateway, query: Mapping[str, str]) -> dict[str, Any]:
    """The dashboard's view over days: the last `days` (1, 7, 30 or 90) by day and by key, from one read."""
    try:
        days = int(query.get("days", "7"))
    except ValueError:
        days = 0
    if days not in DASHBOARD_DAYS:
        raise _bad(f"`days` is one of {', '.join(map(str, DASHBOARD_DAYS))}.", "days")
    now = time.time()
    first_hour, last_hour, _, _ = parse_query({"from": str(now - days * 86400)}, g.cfg.usage.retention_days, now)
    rows = await _rows(g, first_hour, last_hour)
    prices = g.cfg.usage.prices
    by_day = ledger_report.build(rows, ("day",), {}, prices)
    by_key = ledger_report.build(rows, ("key",), {}, prices)
    return {**_about(g, first_hour, last_hour), "days": days, "priced": bool(prices), "by_day": by_day["rows"],
            "by_key": by_key["rows"], "totals": by_key["totals"],
            "unpriced_models": by_key.get("unpriced_models", [])}
