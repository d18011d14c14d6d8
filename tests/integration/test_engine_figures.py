"""The engines' own latency figures: a cold gateway starts from them, and /metrics shows them beside its fit."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from gateway.sim.runner import SimOptions, start_sim
from tests.gateway_harness import ADMIN_KEY, gateway_config, start_gateway
from tests.sim.support import chat_body, read_sse, sample, scrape


async def stream_directly(http: aiohttp.ClientSession, url: str, n: int) -> None:
    """Traffic the gateway never sees: another replica's, or served before this gateway started."""
    body = chat_body(max_tokens=24, stream=True, ignore_eos=True)
    for _ in range(n):
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            await read_sse(r)


def engine_mean(families: dict, metric: str) -> float:
    """The engine's own mean, from its histogram (read here, not through the gateway)."""
    return sample(families, metric, metric + "_sum") / sample(families, metric, metric + "_count")


async def test_a_cold_gateway_starts_from_the_engines_own_figures():
    fast = await start_sim(SimOptions(engine="vllm", profile="r9700-vllm"))
    slow = await start_sim(SimOptions(engine="sglang", profile="r9700-sglang"))
    gw = None
    try:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(stream_directly(http, fast.url, 3), stream_directly(http, slow.url, 3))
            own = {"fast": await scrape(http, fast.url), "slow": await scrape(http, slow.url)}
            gw = await start_gateway(gateway_config(
                [{"id": "fast", "engine": "vllm", "url": fast.url, "models": {"m": "sim-model"}},
                 {"id": "slow", "engine": "sglang", "url": slow.url, "models": {"m": "sim-model"}}],
                health={"warmup": False, "load_interval_s": 0.1}))
            pool = gw.state.pool
            deadline = time.monotonic() + 10
            while any(b.reported.itl is None for b in pool.all()):
                assert time.monotonic() < deadline, "no engine figures scraped"
                await asyncio.sleep(0.05)
            prefix = {"fast": "vllm", "slow": "sglang"}
            for bid, b in ((b.id, b) for b in pool.all()):
                est = b.latency.estimate()
                assert b.latency.samples == 0  # nothing measured by the gateway itself yet
                itl = engine_mean(own[bid], f"{prefix[bid]}:inter_token_latency_seconds")
                ttft = engine_mean(own[bid], f"{prefix[bid]}:time_to_first_token_seconds")
                assert abs(est.itl_a - itl) <= 0.1 * itl, (bid, est.itl_a, itl)
                assert abs(est.ttft_t0 - ttft) <= 0.1 * ttft, (bid, est.ttft_t0, ttft)
            fit = {b.id: b.latency.estimate() for b in pool.all()}
            assert fit["slow"].itl_a > 2 * fit["fast"].itl_a  # as the profiles say (60 vs 17.5 ms)
            async with http.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
                text = await r.text()
            assert 'shapegate_engine_reported_itl_seconds{backend="slow",engine="sglang"}' in text
            assert 'shapegate_latency_fit_divergence{backend="fast",engine="vllm"}' in text
    finally:
        if gw is not None:
            await gw.stop()
        await fast.close()
        await slow.close()
