"""The dashboard's keys view: every key's id, admin flag, limits, quotas and last use, with its usage over the stats window."""

from __future__ import annotations

import time

from gateway.keys.auth import ANONYMOUS
from gateway.ops.admin_keys import key_listing
from gateway.runtime import Gateway
from gateway.stats.key_usage import OTHER, merge_usage

MAX_ROWS = 200  # the busiest keys first; the view says how many more there are


def _limits(limits) -> dict:
    def own(x) -> dict:
        return {"rpm": x.rpm, "tpm": x.tpm, "tokens_per_day": x.tokens_per_day, "tokens_per_month": x.tokens_per_month}
    return {**own(limits), "models": {name: own(m) for name, m in limits.models.items()}}


def _source(key_id: str, auth: bool) -> str:
    """Where usage under an id that no key has now comes from."""
    if key_id == OTHER:
        return "other"
    return "anonymous" if key_id == ANONYMOUS.id and not auth else "unlisted"


def _order(row: dict) -> tuple:
    u = row["usage"] or {}
    return (-(u.get("requests", 0) + u.get("refused", 0)), -(row["last_used"] or 0.0), row["id"])


async def keys_view(g: Gateway) -> dict:
    """The keys with their figures over the window, merged over this process group's workers as the dashboard's
    feed is (a replica's view covers its own workers: gateway/stats/merge.py group_report); never a key or a
    digest. Usage under an id that is no key now (revoked meanwhile, `anonymous` with auth off, or OTHER once
    more keys were busy than key_usage counts apart) is listed as such."""
    now_m, now_wall = time.monotonic(), time.time()
    window = g.cfg.stats.window_s
    peers = g.sharing.peers(now_wall)
    usage = merge_usage([{"worker": g.sharing.worker, "keys": g.key_usage.summary(now_m, window)}, *peers])
    rows = [{**k, "usage": usage.pop(k["id"], None)} for k in await key_listing(g)]
    rows += [{"id": kid, "admin": None, "limits": None, "created": None, "last_used": None, "quotas": [],
              "source": _source(kid, g.cfg.auth.enabled), "usage": u} for kid, u in usage.items()]
    rows.sort(key=_order)
    return {"now": now_wall, "window_s": window, "scope": "group", "workers": 1 + len(peers),
            "expected_workers": g.sharing.expected, "auth": g.cfg.auth.enabled, "stats": g.cfg.stats.enabled,
            "defaults": _limits(g.cfg.limits), "total": len(rows), "keys": rows[:MAX_ROWS]}
