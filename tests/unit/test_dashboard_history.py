"""The dashboard's history ring: fixed size, sampled on a timer, served as columns the charts read."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from gateway.dashboard.history import FIELDS, FeedHistory

CHARTS_JS = Path(__file__).resolve().parents[2] / "gateway" / "dashboard" / "static" / "charts.js"


def feed(now: float, *ids: str, ttft: float | None = 12.3456, waiting: int | None = 2) -> dict:
    return {"now": now, "scope": "group", "backends": [
        {"id": bid, "in_flight": 1, "load": {"waiting": waiting},
         "overall": {"ttft_ms": {"p50": ttft, "p99": 40.0}, "itl_ms": {"p50": 1.5}, "output_tps": 100.0,
                     "rps": 2.0, "error_rate": 0.0}} for bid in ids]}


def test_the_charts_draw_the_fields_the_history_keeps():
    ids = re.findall(r"\{ id: '(\w+)'", CHARTS_JS.read_text())
    assert ids == [name for name, _ in FIELDS]


def test_the_ring_keeps_the_last_span_only():
    h = FeedHistory(span_s=10.0, interval_s=1.0)
    for t in range(25):
        h.add(feed(1000.0 + t, "a"))
    report = h.report()
    assert len(h) == 10 and report["t"] == [1015.0 + i for i in range(10)]
    assert report["backends"]["a"]["ttft_p50"] == [12.35] * 10  # four figures
    assert report["scope"] == "group" and report["fields"] == [name for name, _ in FIELDS]


def test_backends_that_come_and_go_have_nulls_where_absent():
    h = FeedHistory()
    h.add(feed(1.0, "a"))
    h.add(feed(2.0, "a", "b", ttft=None, waiting=None))
    h.add({"now": 3.0, "backends": [{"id": "b", "overall": "junk"}, {"no": "id"}, "junk"]})
    b = h.report()["backends"]
    assert b["a"]["ttft_p50"] == [12.35, None, None]
    assert b["b"]["ttft_p50"] == [None, None, None] and b["b"]["waiting"] == [None, None, None]
    assert b["b"]["in_flight"] == [None, 1.0, None]


def test_backends_beyond_the_cap_are_not_kept():
    h = FeedHistory(max_backends=2)
    h.add(feed(1.0, "a", "b", "c"))
    assert set(h.report()["backends"]) == {"a", "b"}


def test_points_are_taken_once_an_interval_on_the_timer():
    h = FeedHistory(interval_s=1.0)
    calls = []

    def provider() -> dict:
        calls.append(1)
        return feed(float(len(calls)), "a")

    for tick in range(26):  # the flush loop's 0.2 s ticks over 5 s
        h.sample(provider, 100.0 + tick * 0.2)
    assert len(calls) == 6 and len(h) == 6  # at 0 s, 1 s, ... 5 s


def test_a_failing_feed_leaves_a_gap_and_is_logged_once_per_spell(caplog):
    h = FeedHistory(interval_s=1.0)
    failing = True

    def provider() -> dict:
        if failing:
            raise RuntimeError("stats unavailable")
        return feed(1.0, "a")

    with caplog.at_level(logging.ERROR, logger="gateway.dashboard.history"):
        for t in range(3):
            h.sample(provider, float(t))
        failing = False
        h.sample(provider, 3.0)
        failing = True
        h.sample(provider, 4.0)
    assert len(h) == 1
    assert len([r for r in caplog.records if "could not sample the feed" in r.getMessage()]) == 2
