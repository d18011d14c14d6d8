"""Shape routing learns from non-streamed replies too: each shape ends on its best engine without one stream."""

from __future__ import annotations

import openai

from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import USER_KEY, gateway_config, start_gateway

MODEL = "m"


async def test_non_streamed_traffic_alone_teaches_each_shape_its_engine():
    # quick: answers at once, decodes slowly. steady: slow to answer (and to read a prompt), decodes fast.
    quick = await FakeEngine(Knobs(ttft_s=0.01, prefill_s_per_kchar=0.01, token_s=0.006)).start()
    steady = await FakeEngine(Knobs(ttft_s=0.12, prefill_s_per_kchar=0.15, token_s=0.0005)).start()
    cfg = gateway_config([{"id": "quick", "engine": "vllm", "url": quick.url, "models": [MODEL]},
                          {"id": "steady", "engine": "vllm", "url": steady.url, "models": [MODEL]}],
                         shape={"long_output_tokens": 64, "long_prompt_tokens": 200},
                         health={"warmup": False})
    gw = await start_gateway(cfg)
    long_prompt = "word " * 400  # ~500 tokens by the gateway's estimate, answered in 4
    went: dict[str, list[str]] = {"long_output": [], "long_prompt": []}
    try:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
            for i in range(24):
                for klass, text, max_tokens in (("long_output", "write", 120), ("long_prompt", long_prompt, 4)):
                    raw = await c.chat.completions.with_raw_response.create(
                        model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": f"{i} {text}"}])
                    assert raw.headers["x-shapegate-reason"].startswith(f"shape:{klass}")
                    went[klass].append(raw.headers["x-shapegate-backend"])
        est = {b.id: b.latency for b in gw.state.pool.all()}
        assert all(m.from_e2e > 0 for m in est.values())  # taught by replies that were not streamed
        # The last 8 of each shape, once both engines are measured, go where that shape is served best.
        assert went["long_output"][-8:] == ["steady"] * 8, went
        assert went["long_prompt"][-8:] == ["quick"] * 8, went
        fit = {bid: m.estimate() for bid, m in est.items()}
        assert fit["quick"].itl_a > 3 * fit["steady"].itl_a
        assert fit["steady"].ttft_t0 + 500 / fit["steady"].prefill_rate > 3 * (
            fit["quick"].ttft_t0 + 500 / fit["quick"].prefill_rate)
    finally:
        await gw.stop()
        await quick.stop()
        await steady.stop()
