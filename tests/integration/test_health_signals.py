"""Active probes per engine, load scraping, stale keep-alive connections and admission control on loopback."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from benchmarks.loopback import free_port
from gateway.contracts import READY, UNHEALTHY
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import gateway_config, start_gateway
from tests.integration.failover_kit import AUTH, MSG, ask, backend, sim
from tests.kit import until


async def test_load_signals_from_each_engine_map_to_common_fields():
    engines = {"vllm": await sim("vllm"), "sglang": await sim("sglang"), "llamacpp": await sim("llamacpp", slots=2)}
    gw = await start_gateway(gateway_config([backend(k, k, e.url) for k, e in engines.items()]))
    try:
        pool = gw.state.pool
        await until(lambda: all(pool.get(k).fresh_load(time.monotonic()) is not None for k in engines))
        now = time.monotonic()
        v, s, ll = (pool.get(k).fresh_load(now) for k in ("vllm", "sglang", "llamacpp"))
        assert v.running == 0 and v.waiting == 0 and v.kv_usage is not None
        assert s.running == 0 and s.waiting == 0 and s.kv_usage is not None
        assert (ll.idle_slots, ll.total_slots, ll.waiting) == (2, 2, 0)
        # A sample older than load_stale_s is not shown to policies: they fall back to in-flight counts.
        b = pool.get("vllm")
        assert b.view(now + gw.state.cfg.health.load_stale_s + 1).load is None
    finally:
        await gw.stop()
        for e in engines.values():
            await e.close()


def sglang_like(metrics: bool, health_delay: float = 0.0) -> web.Application:
    """An SGLang-shaped server: /health may be slow (it generates), /ping is cheap, /metrics may be off."""
    calls = {"health": 0}

    async def health(request):
        calls["health"] += 1
        if calls["health"] > 1:
            await asyncio.sleep(health_delay)
        return web.Response(status=200)

    async def ping(request):
        return web.Response(status=200)

    async def loads(request):
        return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2,
                                             "token_usage": 0.4}]})

    async def prometheus(request):
        return web.Response(text="sglang:num_running_reqs 1\n")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/ping", ping)
    app.router.add_get("/v1/loads", loads)
    if metrics:
        app.router.add_get("/metrics", prometheus)
    return app


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_sglang_probes_are_slow_and_rare_but_a_dead_process_is_seen_at_once():
    sg_runner, sg_url = await serve(sglang_like(metrics=False, health_delay=3.0))
    other = await FakeEngine(Knobs()).start()
    gw = await start_gateway(gateway_config(
        [backend("sg", "sglang", sg_url), backend("v", "vllm", other.url)],
        health={"sglang_interval_s": 30.0, "sglang_timeout_s": 5.0}))
    try:
        pool = gw.state.pool
        # /metrics is off (404): the load comes from /v1/loads instead.
        await until(lambda: pool.get("sg").fresh_load(time.monotonic()) is not None)
        assert (pool.get("sg").load.running, pool.get("sg").load.waiting) == (3.0, 2.0)
        # A slow SGLang probe never holds up the other backends' probes.
        await other.stop()
        await until(lambda: pool.get("v").health.state == UNHEALTHY, timeout=1.5)
        # Between the rare deep probes, the cheap liveness route notices a process that is gone.
        t0 = time.monotonic()
        await sg_runner.cleanup()
        await until(lambda: pool.get("sg").health.state == UNHEALTHY, timeout=3)
        assert time.monotonic() - t0 < 3
    finally:
        await gw.stop()


async def test_a_pooled_connection_the_engine_closed_is_retried_once_on_the_same_backend():
    """Like llama-server after a stream: the idle keep-alive connection is gone by the next request."""
    seen = {"requests": 0}

    async def handle(reader, writer):
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(x.split(b":")[1]) for x in head.split(b"\r\n")
                               if x.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if head.startswith(b"POST"):
                    seen["requests"] += 1
                    if served:  # the second request on a reused connection: close without answering
                        break
                    served += 1
                body = b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":' \
                       b'{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}'
                if head.startswith(b"GET"):
                    body = b'{"object":"list","data":[]}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the peer closed: this connection is done
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    gw = await start_gateway(gateway_config([backend("l", "openai", url, {"m": "m"})]))
    try:
        async with aiohttp.ClientSession() as s:
            replies = [await ask(s, gw.url, stream=False) for _ in range(3)]
        assert [(r.status, r.backend) for r in replies] == [(200, "l")] * 3
        assert seen["requests"] == 5, "the two requests on a stale connection went once more, fresh"
        assert gw.state.pool.get("l").breaker.failures == 0, "and the engine was not charged for it"
    finally:
        await gw.stop()
        server.close()


async def test_no_idle_slot_for_a_class_that_needs_one_is_refused_with_retry_after():
    ll = await sim("llamacpp", slots=1, profile="r9700-llamacpp-vulkan")
    gw = await start_gateway(gateway_config(
        [backend("ll", "llamacpp", ll.url)],
        admission={"slot_classes": ["interactive", "default", "long_output", "long_prompt"], "retry_after_s": 2},
        queue={"enabled": False}))  # refused at once: no queue to wait in
    try:
        b = gw.state.pool.get("ll")
        await until(lambda: b.fresh_load(time.monotonic()) is not None)
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "messages": MSG, "stream": True, "max_tokens": 100}
            async with s.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH) as busy:
                await busy.content.readany()
                refused = await ask(s, gw.url)
                assert refused.status == 503 and refused.retry_after == "2"
                assert refused.error()["code"] == "server_is_overloaded"
                await busy.read()
            assert (await ask(s, gw.url)).status == 200, "a free slot takes requests again"
        assert b.health.state == READY
    finally:
        await gw.stop()
        await ll.close()


async def test_a_backend_that_just_became_ready_is_warmed_up_before_traffic():
    gate = asyncio.Event()
    e = await FakeEngine(Knobs(gate=gate)).start()
    gw = await start_gateway(gateway_config([backend("w", "vllm", e.url)], health={"warmup": True}),
                             wait_ready=False)
    try:
        await until(lambda: len(e.knobs.seen) == 1)  # the warm-up request is parked at the gate
        assert e.knobs.seen[0]["max_tokens"] == 1
        assert gw.state.pool.get("w").health.state != READY, "no client traffic before the warm-up ends"
        gate.set()
        await until(lambda: gw.state.pool.get("w").health.state == READY)
    finally:
        await gw.stop()
        await e.stop()
