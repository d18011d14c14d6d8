"""Unit tests of the step scheduler on a virtual clock: batching, budgets, slots, caches, aborts."""

from dataclasses import replace

import pytest

from gateway.sim.profiles import Profile
from gateway.sim.scheduler import Scheduler, SimRequest

BASE = Profile(name="t", engine="vllm", title="t", frontend_s=0.0, itl_base_s=0.010,
               itl_per_seq_s=0.001, prefill_tps=10_000.0, max_running=8, max_step_tokens=4096,
               kv_tokens=100_000, max_model_len=8192)


def profile(engine: str = "vllm", **changes) -> Profile:
    return replace(BASE, engine=engine, **changes)


def req(prompt_len: int = 100, out: int = 10, t: float = 0.0, first: int = 0, **kw) -> SimRequest:
    return SimRequest(prompt=list(range(first, first + prompt_len)), max_new=out, arrival=t,
                      ready_at=t, **kw)


def run(sched: Scheduler, until: float = 1e9) -> float:
    now = 0.0
    while sched.has_work() and now < until:
        res = sched.step(now)
        if res is None:
            now = sched.next_ready()
            continue
        now = res.end
    return now


def test_single_request_timing_follows_the_cost_model():
    sched = Scheduler(profile())
    r = req(100, 5)
    sched.submit(r)
    run(sched)
    # prefill step: base + 1 seq + 100 tokens / 10k tok/s; then 4 decode steps of base + 1 seq
    assert r.first_token_at == pytest.approx(0.010 + 0.001 + 0.010)
    assert r.last_token_at - r.first_token_at == pytest.approx(4 * 0.011)
    assert r.generated == 5


def test_itl_rises_with_the_running_batch():
    gaps = {}
    for n in (1, 8):
        sched = Scheduler(profile())
        reqs = [req(10, 20, first=i * 100) for i in range(n)]
        for r in reqs:
            sched.submit(r)
        run(sched)
        gaps[n] = (reqs[0].last_token_at - reqs[0].first_token_at) / 19
    assert gaps[1] == pytest.approx(0.011)
    assert gaps[8] == pytest.approx(0.018)


def test_concurrent_prefills_share_the_prefill_rate():
    sched = Scheduler(profile())
    a, b = req(1000, 1, first=0), req(1000, 1, first=5000)
    sched.submit(a)
    sched.submit(b)
    run(sched)
    assert a.first_token_at == pytest.approx(0.010 + 0.002 + 0.2)


def test_chunked_prefill_respects_the_step_token_budget():
    sched = Scheduler(profile(max_step_tokens=512))
    r = req(1200, 2)
    sched.submit(r)
    res = sched.step(0.0)
    assert res.prefill_tokens == 512 and not res.emitted
    run(sched)
    assert r.generated == 2


def test_requests_beyond_max_batch_wait():
    sched = Scheduler(profile(max_running=2))
    reqs = [req(10, 5, first=i * 100) for i in range(3)]
    for r in reqs:
        sched.submit(r)
    sched.step(0.0)
    assert len(sched.running) == 2 and sched.waiting_count(0.0) == 1
    run(sched)
    assert reqs[2].admitted_at >= reqs[0].last_token_at


def test_kv_budget_makes_requests_wait():
    sched = Scheduler(profile(kv_tokens=250))
    reqs = [req(100, 50, first=i * 1000) for i in range(2)]
    for r in reqs:
        sched.submit(r)
    sched.step(0.0)
    assert len(sched.running) == 1
    run(sched)
    assert reqs[1].admitted_at >= reqs[0].last_token_at
    assert sched.kv_reserved == 0


def test_prefix_cache_skips_cached_prompt_tokens():
    sched = Scheduler(profile())
    a = req(1000, 1)
    sched.submit(a)
    run(sched)
    b = req(1000, 1, t=1.0)
    sched.submit(b)
    res = sched.step(1.0)
    assert b.cached == 992  # 62 full 16-token blocks (the last token is always computed)
    assert res.prefill_tokens == 8


def test_sglang_cache_is_token_granular_and_prefill_stalls_decode():
    sched = Scheduler(profile("sglang"))
    a = req(100, 30)
    sched.submit(a)
    sched.step(0.0)
    sched.step(1.0)  # a is decoding now
    b = req(101, 5, t=2.0)
    sched.submit(b)
    res = sched.step(2.0)
    assert b.cached == 100 and res.prefill_tokens == 1
    assert a not in res.emitted  # SGLang runs the prefill batch on its own


def test_llamacpp_slots_defer_and_reuse_prompt_per_slot():
    sched = Scheduler(profile("llamacpp", max_running=2))
    reqs = [req(50, 5, first=i * 1000) for i in range(3)]
    for r in reqs:
        sched.submit(r)
    sched.step(0.0)
    assert sum(o is not None for o in sched.slot_owner) == 2 and len(sched.waiting) == 1
    run(sched)
    again = req(60, 2, first=1000, t=10.0)  # shares 50 tokens with reqs[1]
    sched.submit(again)
    sched.step(10.0)
    assert again.slot == reqs[1].slot and again.cached == 50


def test_llamacpp_pinned_request_waits_for_its_slot_only():
    sched = Scheduler(profile("llamacpp", max_running=2))
    busy = req(10, 50, slot_hint=0)
    sched.submit(busy)
    sched.step(0.0)
    pinned, free = req(10, 2, slot_hint=0, first=100), req(10, 2, first=200)
    sched.submit(pinned)
    sched.submit(free)
    sched.step(0.1)
    assert pinned.state == "waiting" and free.slot == 1


def test_abort_frees_the_batch_entry_and_admits_the_next():
    sched = Scheduler(profile(max_running=1))
    a, b = req(10, 1000), req(10, 3, first=100)
    sched.submit(a)
    sched.submit(b)
    sched.step(0.0)
    assert sched.abort(a)
    assert sched.kv_reserved == 0 and not sched.running
    sched.step(0.1)
    assert b.state == "running"
    assert sched.counters.aborted == 1
    assert not sched.abort(a)


def test_frontend_delay_holds_requests_back():
    sched = Scheduler(profile())
    r = SimRequest(prompt=[1, 2], max_new=1, arrival=0.0, ready_at=0.05)
    sched.submit(r)
    assert sched.step(0.0) is None
    assert sched.next_ready() == 0.05
    assert sched.step(0.05) is not None


def test_invalid_requests_are_refused():
    sched = Scheduler(profile())
    with pytest.raises(ValueError):
        sched.submit(SimRequest(prompt=[], max_new=1, arrival=0, ready_at=0))
