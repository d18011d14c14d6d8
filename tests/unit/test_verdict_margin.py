"""Verdicts with a practical margin, on means, medians and tails: identical arms are no difference on every
metric, a 15 % ITL gap is found, and a gap under the margin is never "better" however tight its interval."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gateway.experiments.verdict import (METRICS, TAIL_POINTS, _bootstrap_quantile, compare, describe, min_samples_of,
                                         stats_of)

N = 2000  # per arm: what one process's reservoir holds per arm, class and metric
OUTPUT_TOKENS = 48


def simulated_arm(seed: int, n: int = N, itl_scale: float = 1.0, scale: float = 1.0) -> dict[str, np.ndarray]:
    """One arm of same-size requests on the simulated MI350X vLLM at concurrency 16, as the gateway measures
    them (tests/integration/test_experiments_sim.py; spreads measured there): TTFT lognormal with sigma 0.2,
    per-request ITL with 0.15, e2e = TTFT + tokens * ITL, output tok/s = tokens / e2e, no engine errors.
    `scale` slows every figure alike (another engine process, nothing changed); `itl_scale` the ITL alone."""
    rng = np.random.default_rng(seed)
    ttft = rng.lognormal(math.log(0.026), 0.2, n) * scale
    itl = rng.lognormal(math.log(0.0054), 0.15, n) * itl_scale * scale
    e2e = ttft + OUTPUT_TOKENS * itl
    return {"ttft": ttft, "itl": itl, "e2e": e2e, "output_tps": OUTPUT_TOKENS / e2e, "error_rate": np.zeros(n)}


def verdicts(a: dict, b: dict, **kw) -> dict[tuple[str, str], dict]:
    return {(m, s): compare("all", m, "vllm", a[m], "sglang", b[m], stat=s, **kw) for m in METRICS
            for s in stats_of(m)}


# -- the two properties asked for, over 10 seeded runs -----------------------------------------------------
def test_identical_simulated_arms_are_no_difference_on_every_metric_in_10_of_10():
    # Every metric's mean and median, and the latencies' p99. Over 100 seeds the means and medians read
    # no_difference in 100 of 100; the TTFT p99 (20 samples beyond it per arm) in 96, the other 4 were
    # insufficient_data, never a difference.
    for run in range(10):
        got = verdicts(simulated_arm(1000 + run), simulated_arm(2000 + run))
        assert {k: c["verdict"] for k, c in got.items() if c["verdict"] != "no_difference"} == {}, run


def test_a_15_percent_itl_gap_is_found_in_10_of_10():
    for run in range(10):
        got = verdicts(simulated_arm(1000 + run), simulated_arm(2000 + run, itl_scale=0.85))
        for stat in ("mean", "p50", "p99"):
            c = got["itl", stat]
            assert c["verdict"] == "b_better", (run, c)
            assert 0.8 < c["ratio"] < 0.9
        # The rest follows from ITL: e2e and output tok/s move, TTFT does not.
        assert got["ttft", "mean"]["verdict"] == "no_difference"
        assert got["e2e", "mean"]["verdict"] == got["output_tps", "mean"]["verdict"] == "b_better"


def test_two_processes_a_few_percent_apart_are_never_told_better():
    # The issue: identical engines in two processes, 3 % apart on every figure with nothing changed.
    for run in range(10):
        got = verdicts(simulated_arm(1000 + run), simulated_arm(2000 + run, scale=1.03))
        assert not [k for k, c in got.items() if c["verdict"] in ("a_better", "b_better")], run
        assert all(got[m, "mean"]["verdict"] == "no_difference" for m in METRICS), run


def test_the_issues_case_tight_interval_over_the_floor_under_the_margin_is_no_difference():
    # TTFT 2.5 % apart on 20,000 requests each: the interval excludes 1 and the gap is over the A/A floor, which
    # made it "better" before the margin; now it is no difference, and says how far apart the arms are.
    a = np.random.default_rng(1).lognormal(math.log(0.2), 0.25, 20_000)
    b = np.random.default_rng(2).lognormal(math.log(0.2), 0.25, 20_000) * 1.025
    without = compare("all", "ttft", "vllm", a, "sglang", b, margin=0.0)
    assert without["verdict"] == "a_better" and without["ci_low"] > 1
    assert math.log(without["ratio"]) > math.log1p(without["noise_floor"])
    c = compare("all", "ttft", "vllm", a, "sglang", b)
    assert (c["verdict"], c["margin"]) == ("no_difference", 0.05)
    assert describe(c) == "TTFT on all: no difference that matters (arm sglang 3 % higher, within the 5 % margin)"


def test_better_needs_the_whole_interval_beyond_the_margin():
    # 6 % apart, the interval about +-3 %: beyond the margin as a point, not as an interval. More data, then.
    a = np.random.default_rng(3).lognormal(0, 0.3, 800)
    b = np.random.default_rng(4).lognormal(0, 0.3, 800)
    b *= 1.06 * a.mean() / b.mean()
    c = compare("all", "e2e", "a", a, "b", b)
    assert c["ci_low"] > 1 and c["ci_low"] < 1.05 < c["ratio"]
    assert c["verdict"] == "insufficient_data" and c["needed"] > 0
    assert compare("all", "e2e", "a", a, "b", b, margin=0.0)["verdict"] == "a_better"
    # A wider margin than the gap: no difference that matters.
    assert compare("all", "e2e", "a", a, "b", b, margin=0.10)["verdict"] == "no_difference"


# -- quantiles ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_the_quantile_bootstrap_is_the_bootstrap(q):
    # Drawn from order statistics in O(resamples): the same distribution as resampling n values and taking
    # their quantile, which costs O(resamples * n).
    x = np.sort(np.random.default_rng(5).lognormal(0, 0.5, 777))
    fast = _bootstrap_quantile(x, q, 100_000, np.random.default_rng(6))
    slow = np.quantile(x[np.random.default_rng(7).integers(0, len(x), (20_000, len(x)))], q, axis=1)
    for p in (2.5, 25, 50, 75, 97.5):
        assert abs(np.percentile(fast, p) / np.percentile(slow, p) - 1) < 0.01, p


def test_a_quantile_waits_for_samples_beyond_it():
    assert min_samples_of("mean", 30) == min_samples_of("p50", 30) == 30
    assert min_samples_of("p99", 30) == TAIL_POINTS * 100 == 1000
    a, b = simulated_arm(1, 600), simulated_arm(2, 600)
    c = compare("all", "ttft", "a", a["ttft"], "b", b["ttft"], stat="p99")
    assert (c["verdict"], c["needed"]) == ("insufficient_data", 400)
    assert describe(c) == "TTFT p99 on all: not enough data yet (about 400 more requests per arm)"


def test_which_statistics_each_metric_gets():
    assert stats_of("ttft") == stats_of("itl") == stats_of("e2e") == ("mean", "p50", "p99")
    assert stats_of("output_tps") == ("mean", "p50")  # its p99 is its fastest requests
    assert stats_of("error_rate") == ("mean",)
    with pytest.raises(ValueError):
        compare("k", "error_rate", "a", [0.0] * 50, "b", [0.0] * 50, stat="p99")
    with pytest.raises(ValueError):
        compare("k", "ttft", "a", [1.0] * 50, "b", [1.0] * 50, margin=1.0)


def test_quantile_verdicts_are_json_ready_deterministic_and_described():
    a, b = simulated_arm(1), simulated_arm(2, itl_scale=0.85)
    c = compare("long_output", "itl", "vllm", a["itl"], "sglang", b["itl"], stat="p99")
    json.dumps(c, allow_nan=False)
    assert c == compare("long_output", "itl", "vllm", list(a["itl"]), "sglang", list(b["itl"]), stat="p99")
    assert c["stat"] == "p99" and c["value"]["sglang"] < c["value"]["vllm"]
    assert describe(c).startswith("arm sglang: ITL p99 ") and describe(c).endswith(" than vllm on long_output")
    # Each statistic draws from its own seed: the mean's verdicts are what they were before quantiles came.
    mean = compare("long_output", "itl", "vllm", a["itl"], "sglang", b["itl"])
    assert mean["stat"] == "mean" and mean["value"] == mean["mean"]
