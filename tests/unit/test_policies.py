"""Every routing policy, table-driven on hand-made backend snapshots (no network, no clock)."""

from __future__ import annotations

import pytest

import policies
from gateway.contracts import (DEFAULT, INTERACTIVE, LONG_OUTPUT, LONG_PROMPT, BackendView, LatencyEstimate, LoadSample,
                               RequestShape, RouteInput)
from policies import least_loaded, prefix_affinity, round_robin, shape

# Roughly the R9700 engines: vLLM-like, SGLang-like (slow), llama.cpp-like (fast decode, 4 slots).
VLLM = LatencyEstimate(ttft_t0=0.065, prefill_rate=3000, itl_a=0.0175, itl_b=0.001, samples=50,
                       ttft_per_running=0.001, service_s=10.0)
SGLANG = LatencyEstimate(ttft_t0=0.27, prefill_rate=1200, itl_a=0.060, itl_b=0.00275, samples=50,
                         ttft_per_running=0.002, service_s=30.0)
LLAMA = LatencyEstimate(ttft_t0=0.005, prefill_rate=2000, itl_a=0.0078, itl_b=0.0015, samples=50,
                        ttft_per_running=0.001, service_s=8.0)
HIP = LatencyEstimate(ttft_t0=0.005, prefill_rate=3800, itl_a=0.0096, itl_b=0.0015, samples=50,
                      ttft_per_running=0.001, service_s=8.0)


def view(id: str, est: LatencyEstimate, in_flight: int = 0, load: LoadSample | None = None,
         interactive: bool = False, engine: str = "vllm") -> BackendView:
    return BackendView(id=id, engine=engine, in_flight=in_flight, latency=est, load=load, interactive=interactive)


def slots(busy: int, total: int = 4) -> LoadSample:
    return LoadSample(running=busy, waiting=max(busy - total, 0), idle_slots=max(total - busy, 0),
                      total_slots=total)


def req(klass: str, prompt: int = 100, output: int = 100, session: str | None = None,
        hashes: tuple[int, ...] = ()) -> RequestShape:
    return RequestShape(model="m", route="chat", stream=True, prompt_tokens=prompt, output_tokens=output,
                        klass=klass, session_id=session, prefix_hashes=hashes)


def rank(policy, shape_: RequestShape, *views: BackendView, affinity: str | None = None, cached: int = 0):
    return policy.rank(RouteInput(shape_, tuple(views), affinity, 0.0, cached))


def ids(decision) -> list[str]:
    return [b.id for b in decision.ranked]


def make(name: str, **params):
    cls, p = policies.REGISTRY[name]
    return cls(p.model_validate(params))


# -- registry ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(policies.REGISTRY))
def test_every_policy_ranks_every_candidate_once_and_explains(name):
    p = make(name)
    assert p.name == name
    vs = (view("a", VLLM), view("b", SGLANG, 2), view("c", LLAMA, 1, slots(1), engine="llamacpp"))
    d = rank(p, req(DEFAULT), *vs)
    assert sorted(ids(d)) == ["a", "b", "c"] and d.reason


def test_params_are_validated():
    with pytest.raises(ValueError):
        make("shape", herd_weight=-1)
    with pytest.raises(ValueError):
        make("prefix_affinity", cache_threshold=2)
    with pytest.raises(ValueError):
        make("round_robin", anything=1)


# -- round_robin, least_loaded -------------------------------------------------------------------------------
def test_round_robin_rotates():
    p = round_robin.RoundRobin(round_robin.Params())
    vs = (view("a", VLLM), view("b", VLLM), view("c", VLLM))
    assert [ids(rank(p, req(DEFAULT), *vs))[0] for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_by_in_flight_then_engine_queue():
    p = least_loaded.LeastLoaded(least_loaded.Params())
    d = rank(p, req(DEFAULT), view("a", VLLM, 3), view("b", VLLM, 1), view("c", VLLM, 2))
    assert ids(d) == ["b", "c", "a"]
    d = rank(p, req(DEFAULT), view("a", VLLM, 1, LoadSample(waiting=5)), view("b", VLLM, 1, LoadSample(waiting=0)))
    assert ids(d)[0] == "b"


# -- prefix_affinity -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,shape_,views,affinity,cached,first,why", [
    ("no affinity: least loaded", req(DEFAULT, 1000), (("a", 5), ("b", 1)), None, 0, "b", "no affinity"),
    ("prefix match above threshold", req(DEFAULT, 1000), (("a", 5), ("b", 1)), "a", 400, "a", "prefix 40%"),
    ("prefix match below threshold", req(DEFAULT, 1000), (("a", 5), ("b", 1)), "a", 200, "b", "match 20% < 30%"),
    ("session pin whatever the match", req(INTERACTIVE, 1000, session="s"), (("a", 5), ("b", 1)), "a", 0, "a",
     "session"),
    ("affinity backend not a candidate", req(DEFAULT, 1000), (("a", 5), ("b", 1)), "gone", 900, "b",
     "gone unavailable"),
    ("overloaded: abs and rel imbalance", req(DEFAULT, 1000), (("a", 80), ("b", 10)), "a", 900, "b", "overloaded"),
    ("busy but within 1.5x: stays", req(DEFAULT, 1000), (("a", 100), ("b", 70)), "a", 900, "a", "prefix 90%"),
    ("busy but within +64: stays", req(DEFAULT, 1000), (("a", 60), ("b", 1)), "a", 900, "a", "prefix 90%"),
])
def test_prefix_affinity(case, shape_, views, affinity, cached, first, why):
    p = prefix_affinity.PrefixAffinity(prefix_affinity.Params())
    d = rank(p, shape_, *(view(i, VLLM, n) for i, n in views), affinity=affinity, cached=cached)
    assert ids(d)[0] == first, case
    assert why in d.reason, d.reason


def test_prefix_affinity_counts_engine_reported_load():
    # The engine says 90 running + waiting (other clients): far more than our own in-flight count.
    busy = view("a", VLLM, 1, LoadSample(running=80, waiting=10))
    d = rank(prefix_affinity.PrefixAffinity(prefix_affinity.Params()), req(DEFAULT, 1000), busy, view("b", VLLM, 2),
             affinity="a", cached=900)
    assert ids(d)[0] == "b"


# -- shape ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,shape_,views,first,reason", [
    ("long output: lowest e2e (decode speed)", req(LONG_OUTPUT, 110, 1000),
     [view("vllm", VLLM), view("sglang", SGLANG), view("llama", LLAMA, 0, slots(0), engine="llamacpp")],
     "llama", "shape:long_output e2e="),
    ("long prompt: lowest TTFT (prefill speed)", req(LONG_PROMPT, 4000, 100),
     [view("vllm", VLLM), view("llama", LLAMA, 0, slots(0), engine="llamacpp"),
      view("hip", HIP, 0, slots(0), engine="llamacpp")],
     "hip", "shape:long_prompt ttft="),
    ("slot engine full: its queue wait counts", req(LONG_OUTPUT, 110, 1000),
     [view("vllm", VLLM, 2), view("llama", LLAMA, 6, slots(4), engine="llamacpp")],
     "vllm", "shape:long_output"),
    ("engine queue reported: wait counts", req(DEFAULT, 100, 100),
     [view("a", VLLM, 12, LoadSample(running=8, waiting=4)), view("b", VLLM, 4, LoadSample(running=4, waiting=0))],
     "b", "shape:default"),
    ("KV cache full: new requests wait", req(DEFAULT, 100, 100),
     [view("a", VLLM, 3, LoadSample(running=3, waiting=0, kv_usage=0.99)),
      view("b", VLLM, 3, LoadSample(running=3, waiting=0, kv_usage=0.5))],
     "b", "shape:default"),
    ("equal engines: the idle one (herding)", req(DEFAULT, 500, 200),
     [view("a", VLLM, 20), view("b", VLLM, 5)], "b", "shape:default"),
    ("interactive: idle slot on the interactive llama", req(INTERACTIVE, 300, 120, session="s"),
     [view("vllm", VLLM), view("llama", LLAMA, 3, slots(3), interactive=True, engine="llamacpp")],
     "llama", "shape:interactive slot llama"),
    ("interactive: no idle slot, overflow to the best other", req(INTERACTIVE, 300, 120, session="s"),
     [view("sglang", SGLANG), view("vllm", VLLM, 3), view("llama", LLAMA, 4, slots(4), interactive=True,
                                                           engine="llamacpp")],
     "vllm", "shape:interactive ttft="),
    ("interactive: a llama not marked interactive gets no special treatment", req(INTERACTIVE, 300, 120,
                                                                                  session="s"),
     [view("vllm", VLLM), view("llama", SGLANG, 0, slots(0), engine="llamacpp")], "vllm", "shape:interactive ttft="),
])
def test_shape_picks(case, shape_, views, first, reason):
    d = rank(make("shape"), shape_, *views)
    assert ids(d)[0] == first, (case, d.reason)
    assert d.reason.startswith(reason), d.reason
    assert len(d.reason) < 80


def test_shape_reason_compares_best_with_runner_up():
    d = rank(make("shape"), req(LONG_OUTPUT, 110, 1000), view("a", LLAMA, 0, slots(0)), view("b", SGLANG))
    assert d.reason.startswith("shape:long_output e2e=") and " vs " in d.reason


def test_reasons_name_the_runner_up_and_keep_their_first_word():
    # The first word is the `reason` label of shapegate_routing_decisions_total: it stays as it was.
    d = rank(make("shape"), req(LONG_OUTPUT, 110, 1000), view("a", LLAMA, 0, slots(0)), view("b", SGLANG))
    assert ids(d) == ["a", "b"]
    head, _, rest = d.reason.partition(" ")
    assert head == "shape:long_output" and rest.startswith("e2e=") and " vs b=" in rest, d.reason
    d = rank(make("shape"), req(LONG_PROMPT, 4000, 10), view("slow", SGLANG), view("fast", VLLM))
    assert d.reason.startswith("shape:long_prompt ttft=") and " vs slow=" in d.reason, d.reason
    p = prefix_affinity.PrefixAffinity(prefix_affinity.Params())
    d = rank(p, req(DEFAULT, 1000), view("a", VLLM, 80), view("b", VLLM, 10), affinity="a", cached=900)
    assert d.reason == "prefix_affinity:least_loaded (a overloaded 80 vs b=10)"


def test_shape_uses_the_cached_prefix_on_the_affinity_backend():
    long_prompt = req(LONG_PROMPT, 4000, 100)
    vs = (view("a", VLLM), view("b", HIP, 0, slots(0), engine="llamacpp"))
    assert ids(rank(make("shape"), long_prompt, *vs))[0] == "b"
    # 3,900 of the 4,000 prompt tokens are in a's prefix cache: a's TTFT drops below b's.
    assert ids(rank(make("shape"), long_prompt, *vs, affinity="a", cached=3900))[0] == "a"
    # A slot engine keeps one prompt per slot: without a session its cache is not counted.
    vs2 = (view("a", VLLM), view("b", LLAMA, 0, slots(0), engine="llamacpp"))
    assert ids(rank(make("shape"), long_prompt, *vs2, affinity="b", cached=3900))[0] == "a"
    session = req(LONG_PROMPT, 4000, 100, session="s")
    assert ids(rank(make("shape"), session, *vs2, affinity="b", cached=3900))[0] == "b"


def test_shape_herd_weight_protects_running_streams():
    # 1,000 tokens on an engine with 30 running streams slows each of them down for as long.
    gen = req(LONG_OUTPUT, 110, 1000)
    vs = (view("busy", VLLM, 30), view("idle", SGLANG, 0))
    assert ids(rank(make("shape", herd_weight=0.0), gen, *vs))[0] == "busy"
    assert ids(rank(make("shape", herd_weight=1.0), gen, *vs))[0] == "idle"
    # TTFT classes are scored on their own first token only.
    assert ids(rank(make("shape", herd_weight=1.0), req(LONG_PROMPT, 3000, 100), *vs))[0] == "busy"


def test_shape_keeps_ttft_classes_off_engines_that_stream_too_slowly():
    session = req(INTERACTIVE, 3000, 120, session="s")
    vs = (view("sglang", SGLANG, 0), view("busy", VLLM, 45))  # vLLM at 45 streams: ITL 62 ms
    assert ids(rank(make("shape"), session, *vs))[0] == "busy"  # both too slow: the best TTFT
    quick_start = LatencyEstimate(ttft_t0=0.01, prefill_rate=20000, itl_a=0.08, itl_b=0.001, samples=50)
    vs = (view("quick-start", quick_start, 0), view("vllm", VLLM, 0))  # vLLM: later first token, 17.5 ms ITL
    assert ids(rank(make("shape"), session, *vs))[0] == "vllm"
    assert ids(rank(make("shape", max_itl_s=1.0), session, *vs))[0] == "quick-start"


def test_shape_explores_an_unmeasured_backend_with_small_requests_one_at_a_time():
    slow_prior = LatencyEstimate(1.0, 100, 0.5, 0.0005, samples=0, service_s=1.0)  # looks terrible, unmeasured
    p = make("shape", explore_samples=2, explore_in_flight=1, explore_max_output=256)
    d = rank(p, req(DEFAULT, output=100), view("known", VLLM), view("new", slow_prior))
    assert ids(d)[0] == "new" and d.reason == "shape:default explore new"
    # Not with a long request, and not while its exploration request is still running.
    assert ids(rank(p, req(LONG_OUTPUT, output=1000), view("known", VLLM), view("new", slow_prior)))[0] == "known"
    d = rank(p, req(DEFAULT), view("known", VLLM), view("new", slow_prior, in_flight=1))
    assert ids(d) == ["known", "new"]  # still a failover candidate
    # Several unmeasured: the least measured first.
    half = LatencyEstimate(1.0, 100, 0.5, 0.0005, samples=1, service_s=1.0)
    assert ids(rank(p, req(DEFAULT), view("a", half), view("b", slow_prior)))[0] == "b"


def test_shape_reserves_interactive_slots_for_sessions():
    vs = (view("vllm", VLLM, 2), view("llama", LLAMA, 3, slots(3), interactive=True, engine="llamacpp"))
    short = req(DEFAULT, 110, 100)
    assert ids(rank(make("shape", reserve_interactive_slots=0), short, *vs))[0] == "llama"
    # The last idle slot is kept for sessions: another class would have to wait for a slot.
    assert ids(rank(make("shape", reserve_interactive_slots=1), short, *vs))[0] == "vllm"
    session = req(INTERACTIVE, 300, 120, session="s")
    assert ids(rank(make("shape", reserve_interactive_slots=1), session, *vs))[0] == "llama"


def test_shape_idle_slot_from_scrape_when_total_unknown():
    assert shape.idle_slot(view("x", LLAMA, 5, LoadSample(idle_slots=1)), 1)
    assert not shape.idle_slot(view("x", LLAMA, 0, LoadSample(idle_slots=0)), 1)
    assert shape.idle_slot(view("x", LLAMA, 0), 1) and not shape.idle_slot(view("x", LLAMA, 1), 1)


def test_shape_queue_wait_uses_the_sizes_it_sent():
    p = make("shape", size_alpha=1.0)
    full = view("llama", LLAMA, 4, slots(4), engine="llamacpp")
    rank(p, req(LONG_OUTPUT, 110, 1000), full)  # only candidate: records what it sent there
    # Service ~ 1,000 tokens x ITL: a queued request waits several seconds, more than the measured mean says.
    assert p.service(full, 4) > 10.0
    wait, ttft, _, _ = p.predict(full, RouteInput(req(DEFAULT), (full,)), 0)
    assert wait > 2.5 and ttft > wait


def test_shape_never_queues_a_long_generation_behind_busy_slots_when_a_batching_engine_can_start_it():
    # The llama decodes 2x faster, so even a wait of one request looks worth it by the model; it is not:
    # a request behind busy slots waits as long as a whole generation, the least certain prediction of all.
    busy = view("llama", LLAMA, 2, slots(2, total=2), engine="llamacpp")
    gen = req(LONG_OUTPUT, 110, 1000)
    d = rank(make("shape", wait_weight=0.0), gen, busy, view("vllm", VLLM, 1))
    assert ids(d) == ["vllm", "llama"]  # the slot engine stays as failover
    # With nowhere to start at once, the predictions decide as before.
    d = rank(make("shape"), gen, busy, view("vllm", VLLM, 900, LoadSample(running=256, waiting=600)))
    assert ids(d)[0] == "llama"


def test_shape_busy_slots_by_the_engines_own_count():
    # The gateway holds no request there, but the engine reports both slots busy (another replica's requests).
    other = view("llama", LLAMA, 0, slots(2, total=2), engine="llamacpp")
    wait, *_ = make("shape").predict(other, RouteInput(req(DEFAULT), (other,)), 0)
    assert wait > 0


def test_shape_keeps_a_slot_per_recent_session_on_an_interactive_backend():
    p = make("shape", reserve_interactive_slots=1, session_memory_s=60)
    llama = view("llama", LLAMA, 0, slots(0, total=2), interactive=True, engine="llamacpp")
    vllm = view("vllm", VLLM, 1)
    gen = req(DEFAULT, 110, 100)
    at = lambda t: RouteInput(gen, (llama, vllm), None, t, 0)  # noqa: E731
    assert ids(p.rank(at(0.0)))[0] == "llama"  # one slot kept, one free for other classes
    for s in ("s1", "s2"):  # two live sessions: both slots are theirs
        p.rank(RouteInput(req(INTERACTIVE, 300, 120, session=s), (llama, vllm), None, 10.0, 0))
    assert ids(p.rank(at(20.0))) == ["vllm", "llama"]
    assert ids(p.rank(at(69.0)))[0] == "vllm"  # s1 and s2 were seen at 10 s: still within 60 s at 69 s...
    assert ids(p.rank(at(71.0)))[0] == "llama"  # ...and forgotten after 70 s


def test_shape_policy_reads_every_setting_it_was_given():
    # The policy copies its settings out of the pydantic model (cheaper to read): none may be left behind.
    values = {"herd_weight": 0.25, "wait_weight": 2.5, "max_itl_s": 0.07, "explore_samples": 3, "explore_in_flight": 2,
              "explore_max_output": 100, "reserve_interactive_slots": 2, "session_memory_s": 30.0, "kv_high": 0.9,
              "assumed_slots": 3, "size_alpha": 0.2}
    assert set(values) == set(shape.Params.model_fields)  # a new setting: add it here (and to shape.Settings)
    params = shape.Params(**values)
    assert all(values[k] != v for k, v in shape.Params().model_dump().items())  # each differs from its default
    settings = shape.Shape(params).p
    assert {name: getattr(settings, name) for name in values} == values
