"""Fault injection on loopback: kills, refused connections, hangs, 5xx bursts, slow TTFT, recovery, all down."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from gateway.contracts import READY, UNHEALTHY
from gateway.fleet.health import OPEN
from tests.gateway_harness import gateway_config, start_gateway
from tests.integration.failover_kit import AUTH, MSG, ask, backend, every_class, first_content, sim
from tests.kit import until
from tests.procs import sim_proc


async def test_engine_killed_mid_stream_then_restarted():
    """A stream cut by a killed engine ends with an error event and [DONE]; traffic moves, then comes back."""
    a = await sim_proc("vllm", None, "--profile", "r9700-vllm").start()
    b = await sim("sglang")
    gw = await start_gateway(gateway_config([
        backend("a", "vllm", a.url, {"m": "sim-model", "only-a": "sim-model"}),
        backend("b", "sglang", b.url)], routing={"policy": "round_robin"}))
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "only-a", "messages": MSG, "stream": True, "max_tokens": 400}
            streams = [await s.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH) for _ in range(3)]
            heads = [await first_content(r) for r in streams]
            await a.kill()
            tails = [await r.read() for r in streams]
            for r, head, tail in zip(streams, heads, tails):
                raw = head + tail
                assert r.headers["x-shapegate-backend"] == "a"
                assert raw.endswith(b"data: [DONE]\n\n") and b'data: {"error"' in raw, "error event, never a cut"
                assert b'"code":"upstream_error"' in raw
            assert b'shapegate_stream_errors_total{backend="a"} 3.0' in gw.state.metrics.exposition()
            # Everything after the kill is served by the survivor, not one request lost.
            replies = await asyncio.gather(*(ask(s, gw.url) for _ in range(10)))
            assert [(r.status, r.backend, r.ending) for r in replies] == [(200, "b", "finish")] * 10
            await until(lambda: gw.state.pool.get("a").health.state == UNHEALTHY, timeout=3)
            await a.start()  # same port: the engine recovers
            await until(lambda: gw.state.pool.get("a").health.state == READY, timeout=5)
            replies = await asyncio.gather(*(ask(s, gw.url) for _ in range(6)))
            assert all(r.status == 200 and r.ending == "finish" for r in replies)
            assert {r.backend for r in replies} == {"a", "b"}, "traffic returns to the recovered engine"
    finally:
        await gw.stop()
        await a.stop()
        await b.close()


async def test_refused_connections_fail_over_before_probes_notice():
    a, b = await sim("vllm"), await sim("llamacpp")
    # Slow probes: only the passive path (refused connect -> breaker) can save these requests.
    gw = await start_gateway(gateway_config([backend("a", "vllm", a.url), backend("b", "llamacpp", b.url)],
                                            routing={"policy": "round_robin"},
                                            health={"interval_s": 30.0}))
    try:
        await a.close()
        async with aiohttp.ClientSession() as s:
            replies = [await ask(s, gw.url, stream=i % 2 == 0) for i in range(8)]
        assert all(r.status == 200 and r.backend == "b" for r in replies)
        assert any("failover from a" in r.reason for r in replies)
        st = gw.state.pool.get("a")
        assert st.breaker.state(time.monotonic()) == OPEN
    finally:
        await gw.stop()
        await b.close()


async def test_hang_and_slow_ttft_fail_over_on_the_class_deadline():
    hang, slow, ok = await sim("vllm"), await sim("sglang"), await sim("llamacpp")
    hang.set_faults(hang_s=-1)
    slow.set_faults(slow_start_s=3.0)
    gw = await start_gateway(gateway_config(
        [backend("hang", "vllm", hang.url, {"m": "sim-model", "hang-only": "sim-model"}),
         backend("slow", "sglang", slow.url), backend("ok", "llamacpp", ok.url)],
        routing={"policy": "round_robin"}, health={"breaker_failures": 2},
        upstream={"ttft_deadline_s": every_class(0.3), "first_byte_timeout_s": 1.0}))
    try:
        async with aiohttp.ClientSession() as s:
            replies = await asyncio.gather(*(ask(s, gw.url) for _ in range(9)))
            assert [(r.status, r.backend, r.ending) for r in replies] == [(200, "ok", "finish")] * 9
            assert all(r.elapsed < 2.5 for r in replies), "two deadlines at most, never the engines' own pace"
            assert any("failover from" in r.reason for r in replies)
            # Its breaker is open now; a request for a model only it serves is refused with a wait hint...
            refused = await ask(s, gw.url, model="hang-only")
            assert refused.status == 503 and 1 <= int(refused.retry_after) <= 5
            # ...and once it admits a trial, the last candidate gets first_byte_timeout_s, not the class deadline.
            gw.state.pool.get("hang").breaker.on_success()
            lone = await ask(s, gw.url, model="hang-only")
            assert lone.status == 504 and lone.error()["code"] == "upstream_timeout" and lone.elapsed >= 0.9
    finally:
        await gw.stop()
        for e in (hang, slow, ok):
            await e.close()


async def test_5xx_burst_and_retry_after():
    a, b = await sim("vllm"), await sim("vllm")
    gw = await start_gateway(gateway_config([backend("a", "vllm", a.url), backend("b", "vllm", b.url)],
                                            routing={"policy": "round_robin"}, health={"breaker_failures": 3}))
    try:
        async with aiohttp.ClientSession() as s:
            a.set_faults(error_next=50, error_status=502)
            replies = [await ask(s, gw.url, stream=i % 2 == 1) for i in range(12)]
            assert all(r.status == 200 and r.backend == "b" for r in replies)
            assert a.state.faults.spec.error_next == 50 - 3, "the breaker opened after 3 failures"
            a.reset_faults()
            gw.state.pool.get("a").breaker.on_success()
            b.set_faults(error_next=1, error_status=503, retry_after_s=30)
            replies = [await ask(s, gw.url) for _ in range(6)]
            assert all(r.status == 200 for r in replies)
            held = gw.state.pool.get("b").breaker
            assert held.reopens_in(time.monotonic()) > 20
            assert [r.backend for r in replies[-4:]] == ["a"] * 4, "an engine's Retry-After keeps it out"
    finally:
        await gw.stop()
        await a.close()
        await b.close()


async def test_a_request_that_breaks_every_engine_does_not_take_them_out():
    a, b = await sim("vllm"), await sim("sglang")
    gw = await start_gateway(gateway_config([backend("a", "vllm", a.url), backend("b", "sglang", b.url)],
                                            routing={"policy": "round_robin"}, health={"breaker_failures": 2}))
    try:
        a.set_faults(error_next=4, error_status=500)
        b.set_faults(error_next=4, error_status=500)
        async with aiohttp.ClientSession() as s:
            bad = [await ask(s, gw.url, stream=False) for _ in range(4)]
            assert [r.status for r in bad] == [500] * 4 and all(r.error()["message"] for r in bad)
            for name in ("a", "b"):
                st = gw.state.pool.get(name)
                assert st.breaker.failures == 0 and st.usable(time.monotonic())
            good = [await ask(s, gw.url) for _ in range(4)]
            assert all(r.status == 200 for r in good) and {r.backend for r in good} == {"a", "b"}
            # A 500 that another engine then serves is charged to the engine that gave it.
            a.set_faults(error_next=1, error_status=500)
            b.set_faults(error_next=0)
            served = [await ask(s, gw.url) for _ in range(2)]
            assert all(r.status == 200 for r in served)
            assert gw.state.pool.get("a").breaker.failures == 1
    finally:
        await gw.stop()
        await a.close()
        await b.close()


async def test_engine_that_recovers_gets_traffic_back():
    a, b = await sim("llamacpp"), await sim("vllm")
    gw = await start_gateway(gateway_config([backend("a", "llamacpp", a.url), backend("b", "vllm", b.url)],
                                            routing={"policy": "round_robin"}))
    try:
        a.set_faults(unhealthy=True)  # llama.cpp's way: /health answers 503 "Loading model"
        await until(lambda: gw.state.pool.get("a").health.state == UNHEALTHY)
        async with aiohttp.ClientSession() as s:
            replies = [await ask(s, gw.url) for _ in range(4)]
            assert {r.backend for r in replies} == {"b"}
            a.reset_faults()
            await until(lambda: gw.state.pool.get("a").health.state == READY)
            replies = [await ask(s, gw.url) for _ in range(4)]
            assert {r.backend for r in replies} == {"a", "b"}
        text = gw.state.metrics.exposition()
        assert b'shapegate_backend_health_changes_total{backend="a",state="unhealthy"} 1.0' in text
        assert b'shapegate_engine_load_age_seconds{backend="b",engine="vllm"}' in text
    finally:
        await gw.stop()
        await a.close()
        await b.close()


async def test_all_engines_down_gives_clear_errors():
    a, b = await sim("vllm"), await sim("sglang")
    gw = await start_gateway(gateway_config([backend("a", "vllm", a.url), backend("b", "sglang", b.url)],
                                            health={"interval_s": 30.0}))
    try:
        await a.close()
        await b.close()
        async with aiohttp.ClientSession() as s:
            tried = await ask(s, gw.url)  # both refused before any probe noticed
            assert tried.status == 502 and tried.error()["code"] == "upstream_error"
            assert "127.0.0.1" not in tried.body.decode()
            after = await ask(s, gw.url)  # both breakers open now: refused at once with a wait hint
            assert after.status == 503 and after.error()["code"] == "no_backend_available"
            assert 1 <= int(after.retry_after) <= 120
    finally:
        await gw.stop()


async def test_engine_error_mid_stream_is_relayed_and_never_retried():
    a = await sim("llamacpp")
    a.set_faults(error_after_chunks=3)  # llama.cpp sends the error event and no [DONE]
    gw = await start_gateway(gateway_config([backend("a", "llamacpp", a.url)]))
    try:
        async with aiohttp.ClientSession() as s:
            r = await ask(s, gw.url, max_tokens=20)
        assert r.status == 200 and r.ending == "error", "the gateway adds the [DONE] the engine left out"
        assert a.state.tel is not None and gw.state.pool.get("a").breaker.failures == 0
    finally:
        await gw.stop()
        await a.close()
