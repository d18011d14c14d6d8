"""Mergeable summaries: sketch accuracy, percentiles of merged processes, worker files, breaker openings."""

from __future__ import annotations

import math
import os
import random
import time
from collections import deque

import orjson
import pytest

from gateway.config import StateConfig
from gateway.contracts import CLIENT_ERROR, CLIENT_LEFT, DEFAULT, ENGINE_ERROR, OK, REJECTED, Outcome, RequestShape
from gateway.fleet.health import Breaker
from gateway.runtime import request_result
from gateway.stats import sketch
from gateway.stats.merge import render
from gateway.stats.rolling import BackendStats, Tally
from gateway.stats.share import STALE_S, STATS_DIR_ENV, Sharing

SHAPE = RequestShape(model="m", route="chat", stream=True, prompt_tokens=100, output_tokens=100, klass=DEFAULT)
FIT = {"ttft_t0": 0.01, "prefill_rate": 1e4, "itl_a": 0.005, "itl_b": 0.0, "samples": 0, "ttft_per_running": 0.0,
       "service_s": 1.0}


def nearest_rank(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[max(0, math.ceil(q * len(v)) - 1)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sketch_quantiles_stay_within_the_relative_error(seed):
    rng = random.Random(seed)
    values = [rng.lognormvariate(-3.0, 1.5) for _ in range(5000)]  # ~1 ms to seconds, long tail
    sk = sketch.decode(orjson.loads(orjson.dumps(sketch.encode(sketch.build(values)))))
    for q in (0.01, 0.5, 0.9, 0.99, 1.0):
        assert sketch.quantile(sk, q) == pytest.approx(nearest_rank(values, q), rel=sketch.REL_ERR * 1.001)
    assert sketch.quantile({}, 0.5) is None
    assert sketch.quantile(sketch.build([0.0, 0.0, 5.0]), 0.5) < 2e-6  # zero shares the lowest bucket


def test_sliding_sketches_match_a_rebuild_after_every_change():
    """Kept up to date incrementally, yet always what sketching the window's samples afresh would give."""
    rng = random.Random(5)
    samples: deque = deque(maxlen=50)
    sliding = sketch.Sliding(lambda s: s[1], lambda s: (s[2], s[2] * 2) if s[3] else (None, None), 2)
    added, now = 0, 0.0
    for step in range(300):
        for _ in range(rng.choice((0, 1, 3, 40, 120))):  # idle spells, bursts past the cap
            now += rng.expovariate(20.0)
            samples.append((now, rng.choice("ab"), rng.lognormvariate(-3, 1), rng.random() < 0.9))
            added += 1
        window = 2.0 if step < 200 else 5.0  # a reload that widens the window starts over
        sliding.update(samples, added, now - window, window)
        inside = [s for s in samples if s[0] >= now - window]
        for g in "ab":
            mine = [s for s in inside if s[1] == g]
            ok = [s for s in mine if s[3]]
            want = [sketch.build(s[2] for s in ok), sketch.build(s[2] * 2 for s in ok)]
            assert sliding.held.get(g, 0) == len(mine)
            assert [{i: float(n) for i, n in sk.items()} for sk in sliding.sketches.get(g, [{}, {}])] == want


def served(stats: BackendStats, n: int, ttft: float, start: float, result: str = OK) -> None:
    for i in range(n):
        stats.add(Outcome("a", SHAPE, ok=result == OK, status=200, ttft=ttft, itl=ttft / 10, e2e=ttft * 2,
                          prompt_tokens=100, completion_tokens=5, result=result), now=start + i * 0.001)


def summary(worker: str, stats: BackendStats, now: float, taken_at: float = 0.0, **extra) -> dict:
    entry = {"engine": "vllm", "health": "ready", "breaker": "closed", "in_flight": 1, "load": None, "fit": FIT,
             "failovers": 0, "breaker_openings": 0, **stats.summary(now, 60.0)}
    return {"worker": worker, "replica": "r", "taken_at": taken_at, "window_s": 60.0, "enabled": True,
            "backends": {"a": entry}, "rejected": {}, "reasons": {}, **extra}


def test_percentiles_are_merged_from_distributions_never_averaged():
    fast, slow = BackendStats(max_samples=4096, now=0.0), BackendStats(max_samples=4096, now=0.0)
    served(fast, 900, 0.010, start=50.0)
    served(slow, 100, 0.100, start=50.0)
    served(slow, 10, 0.0, start=51.0, result=CLIENT_LEFT)
    rep = render([summary("1", fast, 60.0), summary("2", slow, 60.0, rejected={DEFAULT: 2},
                                                    reasons={DEFAULT: {"round_robin": 110}})], 0.0)
    (a,) = rep["backends"]
    o = a["overall"]
    assert o["requests"] == 1010 and o["outcomes"]["client_left"] == 10 and o["error_rate"] == 0.0
    assert o["ttft_ms"]["p50"] == pytest.approx(10.0, rel=sketch.REL_ERR)
    assert o["ttft_ms"]["p90"] == pytest.approx(10.0, rel=sketch.REL_ERR)  # 900 of 1000 served are fast
    assert o["ttft_ms"]["p99"] == pytest.approx(100.0, rel=sketch.REL_ERR)  # (averaging p99s would say 55)
    assert o["rps"] == pytest.approx(1010 / 60.0) and a["in_flight"] == 2
    assert rep["totals"]["rejected"] == 2 and rep["classes"][DEFAULT]["reasons"] == {"round_robin": 110}
    assert rep["workers"]["count"] == 2


def test_a_process_that_sampled_fewer_requests_weighs_for_all_it_served():
    busy, idle = BackendStats(max_samples=64, now=0.0), BackendStats(max_samples=4096, now=0.0)
    served(busy, 1000, 0.010, start=50.0)  # 64 samples stand for 1,000 requests
    served(idle, 100, 0.100, start=50.0)
    o = render([summary("1", busy, 60.0), summary("2", idle, 60.0)], 0.0)["backends"][0]["overall"]
    assert o["samples"] == 164 and o["requests"] == 1100
    assert o["ttft_ms"]["p90"] == pytest.approx(10.0, rel=sketch.REL_ERR)  # unweighted it would be 100
    assert o["ttft_ms"]["p99"] == pytest.approx(100.0, rel=sketch.REL_ERR)


def test_a_malformed_summary_is_left_out():
    stats = BackendStats(max_samples=16, now=0.0)
    served(stats, 3, 0.01, start=50.0)
    bad = {"worker": "9", "taken_at": 0.0, "backends": {"a": {"engine": "vllm"}}}
    rep = render([summary("1", stats, 60.0), bad], 0.0)
    assert rep["totals"]["requests"] == 3 and rep["workers"]["count"] == 1


def test_worker_files_fresh_ones_only(tmp_path, monkeypatch):
    monkeypatch.setenv(STATS_DIR_ENV, str(tmp_path))
    sharing = Sharing(StateConfig())
    now = time.time()
    sharing.write_file(orjson.dumps({"worker": sharing.worker, "taken_at": now}))
    (tmp_path / "101.json").write_bytes(orjson.dumps({"worker": "101", "taken_at": now - 0.5}))
    (tmp_path / "102.json").write_bytes(orjson.dumps({"worker": "102", "taken_at": now - STALE_S - 1}))  # hung
    (tmp_path / "103.json").write_bytes(b"{not json")
    (tmp_path / ".104.tmp").write_bytes(orjson.dumps({"worker": "104", "taken_at": now}))  # still being written
    assert [p["worker"] for p in sharing.peers(now)] == ["101"]  # never its own
    # (both sides sorted: where this process's pid falls among the names depends on the pid)
    assert sorted(os.listdir(tmp_path)) == sorted([".104.tmp", "101.json", "102.json", "103.json",
                                                   f"{sharing.worker}.json"])
    sharing.remove_file()
    assert f"{sharing.worker}.json" not in os.listdir(tmp_path)


def test_breaker_counts_each_opening_once():
    b = Breaker(threshold=2, open_s=5.0)
    b.on_failure(0.0)
    assert b.openings == 0
    b.on_failure(0.1)
    b.on_failure(0.2)  # already open: no new opening
    assert (b.state(0.3), b.openings) == ("open", 1)
    assert b.state(6.0) == "half_open"
    b.on_attempt(6.0)
    b.on_failure(6.1)  # the trial failed: open again
    assert b.openings == 2
    b.on_success()
    b.on_failure(20.0, hold_s=30.0)  # an engine's Retry-After opens at once
    assert b.openings == 3


def test_tally_windows_and_folds_cumulative_counters():
    t = Tally()
    assert t.fold("x", 3, now=10.0) == 3 and t.fold("x", 3, now=11.0) == 0 and t.fold("x", 5, now=12.0) == 2
    assert t.fold("x", 1, now=13.0) == 1  # the counter restarted (a replaced backend): counted from zero
    t.add("y", now=13.5)
    assert t.window(now=13.9, window_s=3.0) == {"x": 3, "y": 1}
    assert t.window(now=100.0, window_s=3.0) == {}


@pytest.mark.parametrize("outcome,status,want", [
    (None, 503, REJECTED), (None, 429, REJECTED), (None, 400, CLIENT_ERROR), (None, 404, CLIENT_ERROR),
    (None, 499, CLIENT_LEFT), (Outcome("a", SHAPE, ok=False, status=500, result=ENGINE_ERROR), 502, ENGINE_ERROR),
    (Outcome("a", SHAPE, ok=False, status=400, result=CLIENT_ERROR), 400, CLIENT_ERROR),
])
def test_a_request_ends_with_one_result(outcome, status, want):
    assert request_result(outcome, status) == want
