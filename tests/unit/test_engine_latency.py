"""The engines' own latency figures: interval means of histogram totals, restarts, llama.cpp's throughputs."""

from __future__ import annotations

from gateway.config import LatencyHints
from gateway.contracts import LoadSample
from gateway.fleet.engine_latency import ALPHA, EngineLatency
from gateway.stats.rolling import COLD_SAMPLES, LatencyModel


def test_interval_means_between_scrapes_and_a_restart():
    r = EngineLatency()
    assert r.observe(LoadSample(ttft_sum=2.0, ttft_count=10, itl_sum=0.5, itl_count=100)) is True
    assert (r.ttft, r.itl) == (0.2, 0.005)  # the first sample: the engine's whole life
    assert r.observe(LoadSample(ttft_sum=2.0, ttft_count=10, itl_sum=0.5, itl_count=100)) is False  # idle
    r.observe(LoadSample(ttft_sum=3.0, ttft_count=12, itl_sum=0.5 + 0.02 * 50, itl_count=150))
    assert abs(r.ttft - (0.2 + ALPHA * (0.5 - 0.2))) < 1e-12  # the interval's mean (1 s over 2), folded in
    assert abs(r.itl - (0.005 + ALPHA * (0.02 - 0.005))) < 1e-12
    before = r.ttft
    r.observe(LoadSample(ttft_sum=0.1, ttft_count=1))  # totals went backwards: the engine restarted
    assert abs(r.ttft - (before + ALPHA * (0.1 - before))) < 1e-12


def test_llamacpp_throughputs_and_no_figures_at_all():
    r = EngineLatency()
    assert r.observe(LoadSample(running=1.0)) is False and r.itl is None
    r.observe(LoadSample(prompt_tps=2000.0, predicted_tps=100.0))
    assert (r.prefill_rate, r.itl) == (2000.0, 0.01)
    assert r.observe(LoadSample(prompt_tps=0.0, predicted_tps=0.0)) is False  # idle since the last scrape


def test_the_engines_figures_stand_in_for_the_prior_only_at_cold_start():
    m = LatencyModel(LatencyHints(), clock=lambda: 0.0)
    assert m.engine_prior(ttft=0.3, itl=0.02, prefill_rate=1500.0) is True
    est = m.estimate()
    assert abs(est.ttft_t0 - 0.3) < 1e-3 and abs(est.itl_a - 0.02) < 1e-4 and abs(est.prefill_rate - 1500) < 1
    m.samples = COLD_SAMPLES  # the gateway's own measurements now lead
    assert m.engine_prior(ttft=9.0, itl=9.0, prefill_rate=1.0) is False
    assert abs(m.estimate().ttft_t0 - 0.3) < 1e-3
