"""An engine that does not serve a configured model by name, and one down at start: simulated engines on loopback."""

from __future__ import annotations

import logging

import aiohttp

from benchmarks.loopback import free_port
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import gateway_config, start_gateway
from tests.integration.failover_kit import ADMIN, ask, backend, sim
from tests.kit import until

MODEL = "qwen3-30b"


def said(caplog, *parts: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if all(p in r.getMessage() for p in parts)]


async def stats_row(url: str, bid: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/stats", headers=ADMIN) as r:
            assert r.status == 200
            return next(row for row in (await r.json())["backends"] if row["id"] == bid)


async def test_an_engine_without_the_model_loses_no_request_and_says_so(caplog):
    caplog.set_level(logging.INFO, logger="shapegate")
    good = await sim("vllm", model=MODEL)
    bad = await sim("sglang")  # started without the model's name: it serves "sim-model" only
    gw = await start_gateway(gateway_config(
        [backend("bad", "sglang", bad.url, {MODEL: MODEL}), backend("good", "vllm", good.url, {MODEL: MODEL})],
        routing={"policy": "round_robin"}, health={"sglang_interval_s": 0.2}))
    try:
        # At start: the model the engine does not list, once, with the engine's own flag for the fix.
        await until(lambda: said(caplog, "backend bad", "does not list model 'qwen3-30b'"))
        [line] = said(caplog, "backend bad", "does not list model")
        assert f"(sglang at {bad.url})" in line and "(it lists: sim-model)" in line
        assert "start the engine with --served-model-name qwen3-30b, or map it in [[backends]] models" in line
        assert not said(caplog, "backend good", "does not list")
        async with aiohttp.ClientSession() as s:
            replies = [await ask(s, gw.url, MODEL, stream=i % 2 == 0) for i in range(6)]
        assert [(r.status, r.backend) for r in replies] == [(200, "good")] * 6, [r.body[:200] for r in replies]
        assert all(r.ending == "finish" for r in replies[::2])
        failed_over = [r.reason for r in replies if "failover from bad" in r.reason]
        assert len(failed_over) == 1 and failed_over[0].endswith("failover from bad after model_not_found")
        b = gw.state.pool.get("bad")
        assert MODEL in b.lacks and b.breaker.failures == 0, "the engine is sound: no breaker verdict"
        assert len(said(caplog, "backend bad", "refused model qwen3-30b")) == 1
        row = await stats_row(gw.url, "bad")
        assert "does not serve 'qwen3-30b'" in row["unsupported"][MODEL]
        assert "--served-model-name qwen3-30b" in row["unsupported"][MODEL]
        assert (await stats_row(gw.url, "good"))["unsupported"] == {}
        # Its list changes (restarted with the name, on the same port): the model is routed there again.
        port = bad.port
        await bad.close()
        bad = await sim("sglang", model=MODEL, port=port)
        await until(lambda: MODEL not in b.lacks, "the model routed to bad again", timeout=10)
        assert b.unsupported == {}
        async with aiohttp.ClientSession() as s:
            replies = [await ask(s, gw.url, MODEL, stream=False) for _ in range(4)]
        assert {(r.status, r.backend) for r in replies} == {(200, "bad"), (200, "good")}
    finally:
        await gw.stop()
        await good.close()
        await bad.close()


async def test_with_no_backend_serving_the_model_the_client_is_told_the_misconfiguration():
    bad = await sim("vllm")
    gw = await start_gateway(gateway_config([backend("bad", "vllm", bad.url, {MODEL: MODEL})]))
    try:
        async with aiohttp.ClientSession() as s:
            first = await ask(s, gw.url, MODEL)
            later = await ask(s, gw.url, MODEL, stream=False)  # no candidate left: said without asking the engine
        for r in (first, later):
            err = r.error()
            assert (r.status, err["code"], err["param"]) == (404, "model_not_found", "model")
            assert "gateway misconfiguration" in err["message"] and "--served-model-name qwen3-30b" in err["message"]
    finally:
        await gw.stop()
        await bad.close()


async def test_an_engine_down_at_start_is_logged_within_the_grace_with_why(caplog):
    caplog.set_level(logging.INFO, logger="shapegate")
    up = await sim("vllm")
    port = free_port()
    gw = await start_gateway(gateway_config(
        [backend("up", "vllm", up.url), backend("down", "vllm", f"http://127.0.0.1:{port}")],
        health={"startup_grace_s": 0.3, "backoff_max_s": 0.2}))
    late = None
    try:
        await until(lambda: said(caplog, "backend down", "is not ready"), timeout=3)
        [line] = said(caplog, "backend down", "is not ready")
        assert f"(vllm at http://127.0.0.1:{port})" in line and "connection refused" in line
        # The cause unchanged: not said again, however many probes see it.
        await until(lambda: gw.state.pool.get("down").health.fail_streak >= 6)
        assert len(said(caplog, "backend down", "is not ready")) == 1
        # Another cause (the engine answers, but not ready): said once more, with the status and body.
        late = await FakeEngine(Knobs(health_status=503)).start(port)
        await until(lambda: len(said(caplog, "backend down", "is not ready")) == 2, timeout=3)
        assert "HTTP 503" in said(caplog, "backend down", "is not ready")[1]
        assert not said(caplog, "backend up", "is not ready")
    finally:
        await gw.stop()
        await up.close()
        if late is not None:
            await late.stop()
