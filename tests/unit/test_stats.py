"""The online latency model on a fake clock: fits, priors, warm-up, forgetting; the output estimator."""

from __future__ import annotations

import pytest

from gateway.config import LatencyHints
from gateway.contracts import CLIENT_LEFT, DEFAULT, ENGINE_ERROR, OK, Outcome, RequestShape
from gateway.stats.merge import figures, merge
from gateway.stats.rolling import (PRIOR_ITL_S, PRIOR_PREFILL_TPS, PRIOR_TTFT_S, BackendStats, DecayingRidge,
                                   LatencyModel, OutputEstimator)
from gateway.stats.sketch import REL_ERR

SHAPE = RequestShape(model="m", route="chat", stream=True, prompt_tokens=100, output_tokens=100, klass=DEFAULT)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def outcome(*, ttft=0.1, itl=0.02, e2e=2.0, prompt=100, cached=0, out=100, running=0, ok=True, status=None,
            result=OK) -> Outcome:
    return Outcome(backend="b", shape=SHAPE, ok=ok, status=status or (200 if ok else 502), ttft=ttft, itl=itl,
                   e2e=e2e, prompt_tokens=prompt, completion_tokens=out, cached_tokens=cached,
                   running_at_start=running, result=result)


def model(clock: FakeClock, hints: LatencyHints = LatencyHints(), warmup: int = 0, half_life: float = 120.0):
    return LatencyModel(hints, half_life, warmup, clock)


# -- DecayingRidge ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,points,truth", [
    (0, [((), 3.0)] * 5, [3.0]),
    (1, [((x,), 0.5 + 2.0 * x) for x in (0.0, 1.0, 2.0, 3.0)], [0.5, 2.0]),
    (2, [((x1, x2), 1.0 + 0.1 * x1 - 0.3 * x2) for x1 in (0.0, 10.0, 20.0) for x2 in (0.0, 1.0, 5.0)],
     [1.0, 0.1, -0.3]),
])
def test_ridge_recovers_noiseless_data(k, points, truth):
    r = DecayingRidge(k, half_life=1e9)
    for _ in range(200):  # many samples: the prior's single pseudo-sample becomes negligible
        for xs, y in points:
            r.add(xs, y, now=0.0)
    got = r.solve(prior=tuple([0.0] * (k + 1)), scales=tuple([1.0] * (k + 1)), prior_w=1.0, now=0.0)
    assert got == pytest.approx(truth, rel=5e-3, abs=2e-3)


def test_ridge_is_the_prior_without_data_and_forgets_at_its_half_life():
    r = DecayingRidge(1, half_life=10.0)
    assert r.solve((1.0, 2.0), (1.0, 1.0), 1.0, now=0.0) == pytest.approx([1.0, 2.0])
    r.add((1.0,), 5.0, now=0.0)
    r.add((1.0,), 5.0, now=0.0)
    assert r.weight(0.0) == pytest.approx(2.0)
    assert r.weight(10.0) == pytest.approx(1.0)
    assert r.weight(30.0) == pytest.approx(0.25)


# -- LatencyModel ------------------------------------------------------------------------------------------
def test_cold_estimate_is_the_optimistic_prior_or_the_hints():
    clock = FakeClock()
    est = model(clock).estimate()
    assert (est.ttft_t0, est.prefill_rate, est.itl_a, est.samples) == pytest.approx(
        (PRIOR_TTFT_S, PRIOR_PREFILL_TPS, PRIOR_ITL_S, 0))
    hinted = model(clock, LatencyHints(ttft_ms=50, prefill_tps=2000, itl_ms=12, itl_per_stream_ms=1)).estimate()
    assert (hinted.ttft_t0, hinted.prefill_rate, hinted.itl_a, hinted.itl_b) == pytest.approx(
        (0.05, 2000, 0.012, 0.001))


def test_learns_ttft_line_and_itl_slope_from_measurements():
    clock = FakeClock()
    m = model(clock)
    # An engine with t0 = 65 ms, 3,000 prompt tokens/s, +1 ms TTFT per running request,
    # ITL 17.5 ms + 1 ms per extra stream.
    for i in range(20):
        for prompt, running in ((p, r) for p in (100, 500, 1000, 2000) for r in (0, 2, 4, 8)):
            clock.t += 0.01
            ttft = 0.065 + prompt / 3000 + 0.001 * running
            itl = 0.0175 + 0.001 * running  # streams = running + 1 throughout the request
            m.learn(outcome(ttft=ttft, itl=itl, prompt=prompt, running=running), clock.t, running_end=running)
    est = m.estimate()
    assert est.ttft_t0 == pytest.approx(0.065, rel=0.05)
    assert est.prefill_rate == pytest.approx(3000, rel=0.05)
    assert est.ttft_per_running == pytest.approx(0.001, rel=0.25)
    assert est.itl_a == pytest.approx(0.0175, rel=0.05)
    assert est.itl_b == pytest.approx(0.001, rel=0.1)
    assert est.ttft(1000, running=2) == pytest.approx(0.065 + 1000 / 3000 + 0.002, rel=0.05)
    assert est.itl(5) == pytest.approx(0.0175 + 0.004, rel=0.05)


def test_cached_prompt_tokens_do_not_count_as_prefill():
    clock = FakeClock()
    m = model(clock)
    for prompt in (500, 1000, 2000, 4000) * 30:
        # Half of each prompt was cached: the engine computed only the other half.
        m.learn(outcome(ttft=0.05 + (prompt / 2) / 2000, prompt=prompt, cached=prompt // 2), clock.t)
    assert m.estimate().prefill_rate == pytest.approx(2000, rel=0.05)


@pytest.mark.parametrize("case,kwargs,teaches", [
    ("failed request", {"ok": False}, False),
    ("ordinary", {}, True),
])
def test_what_teaches(case, kwargs, teaches):
    m = model(FakeClock())
    assert m.learn(outcome(**kwargs), 0.0) is teaches
    assert m.samples == int(teaches)


def test_warm_up_samples_are_skipped_after_each_ready_transition():
    clock = FakeClock()
    m = model(clock, warmup=2)
    assert [m.learn(outcome(), clock.t, ready_since=1.0) for _ in range(3)] == [False, False, True]
    # The backend restarted (became ready again): its first samples are again warm-up.
    assert [m.learn(outcome(), clock.t, ready_since=50.0) for _ in range(3)] == [False, False, True]
    assert (m.samples, m.skipped) == (2, 4)


def test_a_request_that_queued_for_a_slot_does_not_teach_ttft():
    clock = FakeClock()
    m = model(clock)
    for _ in range(50):
        m.learn(outcome(ttft=0.1, prompt=100, running=1), clock.t, slots=4)
    before = m.estimate().ttft_t0
    for _ in range(50):  # 4 slots busy: a 10 s wait for a slot, not prefill
        m.learn(outcome(ttft=10.0, prompt=100, running=4), clock.t, slots=4)
    clock.t += 2  # past the estimate's refresh
    assert m.estimate().ttft_t0 == pytest.approx(before, rel=0.01)


def test_stale_estimates_decay_back_towards_the_prior():
    clock = FakeClock()
    m = model(clock, half_life=10.0)
    for _ in range(20):
        m.learn(outcome(itl=0.08, running=0), clock.t)
    assert m.estimate().itl_a == pytest.approx(0.08, rel=0.1)
    assert m.estimate().samples == 20
    clock.t += 200  # twenty half-lives without a sample
    est = m.estimate()
    assert est.samples == 0
    assert est.itl_a < 0.01  # optimistic again: the gateway will try the backend once more


def test_estimate_is_cached_until_a_sample_or_the_refresh_interval():
    clock = FakeClock()
    m = model(clock)
    a = m.estimate()
    assert m.estimate() is a
    m.learn(outcome(), clock.t)
    assert m.estimate() is a  # at most one solve per MIN_AGE_S, however many samples arrive
    clock.t += 0.06
    b = m.estimate()
    assert b is not a and b.samples == 1
    clock.t += 0.5
    assert m.estimate() is b  # nothing new
    clock.t += 1.0
    assert m.estimate() is not b  # old enough: recomputed so that forgetting shows


def test_refit_interval_spaces_the_solves_out():
    clock = FakeClock()
    m = model(clock)
    m.refit_s = 5.0  # [stats] refit_interval_s
    a = m.estimate()
    m.learn(outcome(), clock.t)
    clock.t += 4.9  # past the refresh interval and the default least age, not this one
    assert m.estimate() is a
    clock.t += 0.2
    assert m.estimate() is not a and m.estimate().samples == 1


def test_service_time_is_the_mean_e2e_of_unqueued_requests():
    clock = FakeClock()
    m = model(clock)
    for e2e in (2.0, 4.0) * 50:
        m.learn(outcome(e2e=e2e), clock.t)
    assert m.estimate().service_s == pytest.approx(3.0, rel=0.05)


# -- OutputEstimator and BackendStats ----------------------------------------------------------------------
def test_output_estimator_ewma_and_bounded_lru():
    est = OutputEstimator(capacity=2, alpha=0.5)
    assert est.expected("p", "m") is None
    est.learn("p", "m", 100)
    est.learn("p", "m", 200)
    assert est.expected("p", "m") == 150
    est.learn("q", "m", 10)
    est.learn("r", "m", 10)  # evicts the least recently updated key
    assert est.expected("p", "m") is None and est.expected("r", "m") == 10


def test_backend_stats_summary_by_class_and_result():
    s = BackendStats(max_samples=16)
    for i in range(4):
        s.add(outcome(ttft=0.1 * (i + 1), itl=0.01, e2e=1.0), now=100.0 + i)
    s.add(outcome(ok=False, result=CLIENT_LEFT), now=103.0)
    s.add(outcome(ok=False, result=ENGINE_ERROR, status=500), now=103.0)
    summary = s.summary(now=103.0, window_s=10.0)
    (klass,) = summary["classes"]
    c = summary["classes"][klass]
    assert klass == DEFAULT and c["n"] == [4, 1, 0, 1] and c["samples"] == 6
    assert c["tokens"] == 6 * 100
    merged = merge([{"taken_at": 0.0, "backends": {"b": backend_entry(summary)}}])
    rep = figures(merged["backends"]["b"]["classes"][klass])
    assert rep["requests"] == 6 and rep["error_rate"] == pytest.approx(1 / 6)  # the client's leaving is not an error
    assert rep["outcomes"] == {"ok": 4, "client_left": 1, "client_error": 0, "engine_error": 1}
    assert rep["ttft_ms"]["p50"] == pytest.approx(200.0, rel=REL_ERR)  # served requests only


def backend_entry(summary: dict) -> dict:
    return {"engine": "vllm", "health": "ready", "breaker": "closed", "in_flight": 0, "load": None,
            "fit": {"ttft_t0": 0.01, "prefill_rate": 1e4, "itl_a": 0.005, "itl_b": 0.0, "samples": 0,
                    "ttft_per_running": 0.0, "service_s": 1.0},
            "failovers": 0, "breaker_openings": 0, **summary}
