"""The usage ledger's rows as a report: filtered, grouped by key, model, API, backend, hour or day, priced."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from gateway.config_usage import ModelPrice
from gateway.stats.ledger import CACHED, COMPLETION, COUNTS, N_COUNTS, PROMPT, Row

GROUPS = ("key", "model", "api", "backend", "hour", "day")
FILTERS = ("key", "model", "api", "backend")
_DIM = {"key": 1, "model": 2, "api": 3, "backend": 4}
MAX_ROWS = 10_000  # rows of one report; more are summed into its totals, and `truncated` says how many


def hour_label(hour: int) -> str:
    return datetime.fromtimestamp(hour * 3600, timezone.utc).strftime("%Y-%m-%dT%H:00Z")


def day_label(hour: int) -> str:
    return datetime.fromtimestamp(hour * 3600, timezone.utc).strftime("%Y-%m-%d")


def parse_time(text: str, now: float | None = None) -> float:
    """A point in time as a client may give it: seconds since the epoch, an ISO 8601 date or time (UTC unless it
    says), or a span back from now (`90m`, `36h`, `7d`). ValueError otherwise."""
    t = text.strip()
    if not t:
        raise ValueError("empty")
    units = {"m": 60, "h": 3600, "d": 86400}
    if t[-1] in units and t[:-1].isdigit():
        return (time.time() if now is None else now) - int(t[:-1]) * units[t[-1]]
    try:
        return float(t) if t.replace(".", "", 1).isdigit() else _iso(t)
    except (ValueError, OverflowError):
        raise ValueError(f"{text[:40]!r} is not a time (seconds since the epoch, an ISO 8601 date or time, or a "
                         "span back from now such as 24h or 7d)") from None


def _iso(t: str) -> float:
    d = datetime.fromisoformat(t[:-1] + "+00:00" if t.endswith(("Z", "z")) else t)
    if d.tzinfo is None:
        d = d.replace(tzinfo=timezone.utc)
    return d.timestamp()


def cost_of(counts: list[int], price: ModelPrice | None) -> float:
    """What a row's own tokens cost at `price` (0 without one); shadow copies are the operator's, not counted."""
    if price is None:
        return 0.0
    cached_price = price.input_per_million if price.cached_input_per_million is None \
        else price.cached_input_per_million
    fresh = max(counts[PROMPT] - counts[CACHED], 0)
    return (fresh * price.input_per_million + counts[CACHED] * cached_price
            + counts[COMPLETION] * price.output_per_million) / 1e6


def _label(row: Row, by: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for g in by:
        if g == "hour":
            out.append(hour_label(row[0]))
        elif g == "day":
            out.append(day_label(row[0]))
        else:
            out.append(row[_DIM[g]])
    return tuple(out)


def _figures(counts: list[int], cost: float | None) -> dict[str, Any]:
    out: dict[str, Any] = dict(zip(COUNTS, counts))
    if cost is not None:
        out["cost"] = round(cost, 9)
    return out


def build(rows: Mapping[Row, list[int]], by: tuple[str, ...], filters: Mapping[str, str],
          prices: Mapping[str, ModelPrice]) -> dict[str, Any]:
    """The report's `rows` (one per group, busiest first; by time when grouped by hour or day), `keys` (each key
    id's totals, whatever the grouping), `totals` and, with prices, each figure's `cost` and the models that
    had tokens but no price."""
    priced = bool(prices)
    groups: dict[tuple[str, ...], list[Any]] = {}  # label -> [counts, cost]
    keys: dict[str, list[Any]] = {}
    total: list[Any] = [[0] * N_COUNTS, 0.0]
    unpriced: set[str] = set()
    for row, counts in rows.items():
        if any(row[_DIM[f]] != v for f, v in filters.items()):
            continue
        price = prices.get(row[2])
        if priced and price is None and (counts[PROMPT] or counts[COMPLETION]):
            unpriced.add(row[2])
        cost = cost_of(counts, price)
        for into in (groups.setdefault(_label(row, by), [[0] * N_COUNTS, 0.0]),
                     keys.setdefault(row[1], [[0] * N_COUNTS, 0.0]), total):
            acc = into[0]
            for i in range(N_COUNTS):
                acc[i] += counts[i]
            into[1] += cost
    timed = "hour" in by or "day" in by
    order = sorted(groups.items(), key=(lambda kv: kv[0]) if timed else (lambda kv: (-kv[1][0][0], kv[0])))
    out_rows = [{**dict(zip(by, label)), **_figures(acc, cost if priced else None)}
                for label, (acc, cost) in order[:MAX_ROWS]]
    report: dict[str, Any] = {
        "by": list(by), "rows": out_rows, "truncated": max(len(order) - MAX_ROWS, 0),
        "keys": {k: _figures(acc, cost if priced else None) for k, (acc, cost) in sorted(keys.items())},
        "totals": _figures(total[0], total[1] if priced else None)}
    if priced:
        report["unpriced_models"] = sorted(unpriced)
    return report
