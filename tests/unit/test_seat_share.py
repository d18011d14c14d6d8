"""Learned seat counts exchanged between processes, without Redis: the larger count wins, only news is written,
and an entry that is not one a process writes (or names another engine) is left out."""

from __future__ import annotations

import logging

import orjson
import pytest

from gateway.config import BackendConfig, GatewayConfig
from gateway.contracts import LoadSample
from gateway.fleet.pool import BackendState
from gateway.ops.seat_share import MAX_SEATS, SeatShare
from gateway.queueing.seats import room, seat_count

URL = "http://127.0.0.1:1"
CFG = GatewayConfig(auth={"enabled": False}, backends=[
    BackendConfig(id="x", engine="vllm", url=URL, models={"m": "m"})])


def state() -> BackendState:
    return BackendState(CFG.backends[0], None, CFG)


def learn_full_at(b: BackendState, running: int) -> None:
    """Load samples as the engine sends them: `running` at once and more waiting, twice in a row."""
    for t in (1.0, 1.5):
        b.take_load(LoadSample(at=t, running=running, waiting=2))


def entry(full: object, peak: object, url: object = URL) -> bytes:
    return orjson.dumps({"url": url, "full": full, "peak": peak})


def test_a_learned_count_goes_out_and_a_fresh_process_takes_it():
    old, fresh = state(), state()
    learn_full_at(old, 6)
    out = SeatShare().outgoing([old])
    assert orjson.loads(out["x"]) == {"url": URL, "full": 6, "peak": 6}
    assert seat_count(fresh, 2.0) == 0 and room(fresh, 2.0) is None  # nothing known: never held back
    assert SeatShare().take(out, {"x": fresh}) == 1
    assert (fresh.full_at, fresh.peak_running) == (6, 6)
    assert seat_count(fresh, 2.0) == 6 and room(fresh, 2.0) == 7  # one past, until the engine is seen queueing


def test_only_news_is_written_and_the_larger_count_stays():
    share, b = SeatShare(), state()
    assert share.outgoing([b]) == {}  # learned nothing yet
    learn_full_at(b, 4)
    share.take({"x": entry(4, 4)}, {"x": b})
    assert share.outgoing([b]) == {}  # the hash says as much already
    share.take({"x": entry(8, 9)}, {"x": b})  # another process saw more
    assert (b.full_at, b.peak_running) == (8, 9)
    share.take({"x": entry(2, 3)}, {"x": b})  # a stale writer: taken as nothing, and corrected
    assert (b.full_at, b.peak_running) == (8, 9)
    assert orjson.loads(share.outgoing([b])["x"]) == {"url": URL, "full": 8, "peak": 9}
    share.take({}, {"x": b})  # Redis lost its data: written again
    assert "x" in share.outgoing([b])


def test_a_count_past_the_bound_is_written_at_the_bound_once():
    share, b = SeatShare(), state()
    b.take_load(LoadSample(at=1.0, running=MAX_SEATS * 10, waiting=0))  # an engine that says anything
    out = share.outgoing([b])
    assert orjson.loads(out["x"])["peak"] == MAX_SEATS
    share.take(out, {"x": b})
    assert share.outgoing([b]) == {}


def test_an_entry_for_another_engine_is_left_out_and_replaced():
    share, b = SeatShare(), state()
    assert share.take({"x": entry(16, 16, url="http://10.0.0.9:8000")}, {"x": b}) == 0
    assert (b.full_at, b.peak_running) == (0, 0)
    learn_full_at(b, 2)
    assert orjson.loads(share.outgoing([b])["x"])["url"] == URL


@pytest.mark.parametrize("raw", [
    b"not json", b"[]", b"{}", entry("8", 8), entry(8.5, 9), entry(True, 8), entry(-1, 8), entry(8, MAX_SEATS + 1),
    entry(9, 8), entry(2, 2, url=None),
])
def test_a_malformed_entry_is_logged_once_and_left_out(raw, caplog):
    share, b = SeatShare(), state()
    with caplog.at_level(logging.WARNING, logger="shapegate.replicas"):
        for _ in range(3):
            assert share.take({"x": raw, "gone": entry(2, 2)}, {"x": b}) == 0
    assert (b.full_at, b.peak_running) == (0, 0)
    assert len([r for r in caplog.records if "malformed seat count" in r.getMessage()]) == 1
    learn_full_at(b, 2)
    assert "x" in share.outgoing([b])  # a good entry replaces it
