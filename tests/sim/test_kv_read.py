"""Decode steps pay for reading the KV cache of every decoding sequence: long contexts slow the whole batch."""

import pytest

from gateway.sim.profiles import get_profile
from gateway.sim.scheduler import Scheduler
from tests.sim.test_scheduler import profile, req, run

READ_S = 1e-6  # per KV token per step: large, so the effect is plain in the numbers


def decode_gap(prompts: list[int], **changes) -> float:
    """Mean ITL of the first request when `prompts` decode side by side, prefilled in one step."""
    sched = Scheduler(profile(kv_read_s_per_token=READ_S, max_step_tokens=8192, **changes))
    reqs = [req(n, 20, first=i * 100_000) for i, n in enumerate(prompts)]
    for r in reqs:
        sched.submit(r)
    run(sched)
    return (reqs[0].last_token_at - reqs[0].first_token_at) / 19


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp"])
def test_a_long_context_slows_the_streams_batched_with_it(engine):
    short = decode_gap([100, 100], engine=engine)
    long = decode_gap([100, 4000], engine=engine)
    # Same batch size; the second sequence holds 3,900 more tokens the attention reads every step.
    assert long - short == pytest.approx(3900 * READ_S, rel=1e-6)


def test_the_read_grows_with_the_tokens_generated():
    sched = Scheduler(profile(kv_read_s_per_token=READ_S))
    r = req(1000, 3)
    sched.submit(r)
    steps = [sched.step(t) for t in (0.0, 1.0, 2.0)]
    base = profile().step_seconds(1, 0)
    # The first step is prefill (compute, its own rate); decode steps read prompt + tokens so far.
    assert steps[0].end - steps[0].start == pytest.approx(profile().step_seconds(1, 1000))
    assert steps[1].end - steps[1].start == pytest.approx(base + 1001 * READ_S)
    assert steps[2].end - steps[2].start == pytest.approx(base + 1002 * READ_S)


def test_off_by_default_and_on_in_the_r9700_profiles():
    assert profile().kv_read_s_per_token == 0.0
    for engine, name in (("vllm", "r9700-vllm"), ("sglang", "r9700-sglang"),
                         ("llamacpp", "r9700-llamacpp-vulkan"), ("llamacpp", "r9700-llamacpp-hip")):
        p = get_profile(engine, name)
        # Qwen3-30B-A3B f16 KV: 2 x 48 layers x 4 heads x 128 dims x 2 bytes, at the card's 494 GB/s.
        assert p.kv_read_s_per_token == pytest.approx(2 * 48 * 4 * 128 * 2 / 494e9, rel=0.01)
        # A 12k-token chat adds ~2.4 ms to each step of the streams decoding beside it.
        assert p.step_seconds(2, 0, 12_000) - p.step_seconds(2, 0) == pytest.approx(0.0024, rel=0.01)


def test_an_aborted_sequence_stops_costing():
    sched = Scheduler(profile(kv_read_s_per_token=READ_S))
    a, b = req(100, 50), req(5000, 50, first=100_000)
    sched.submit(a)
    sched.submit(b)
    sched.step(0.0)
    sched.step(1.0)
    sched.abort(b)
    res = sched.step(2.0)
    assert res.end - res.start == pytest.approx(profile().step_seconds(1, 0) + (100 + a.generated - 1) * READ_S)

