"""Context windows of real engines (llama.cpp 2,048 per slot, vLLM 4,096) and their simulators behind one gateway."""

from __future__ import annotations

import time

import openai
import pytest

from gateway.sim.runner import start_sim
from tests.e2e.targets import PUBLIC_MODEL, backend, config, sim_options
from tests.gateway_harness import USER_KEY, start_gateway
from tests.kit import until

pytestmark = pytest.mark.e2e

SMALL, LARGE = 2048, 4096


def prose(chars: int) -> str:
    """Plain words. The real tiny models' tokenizer counts about 0.7 tokens a character, the simulators' about
    0.25, the gateway's estimate 0.25: the gateway learns the difference from the engines' usage figures."""
    text = "the quick brown fox jumps over a lazy dog while seven wizards hum "
    return (text * (chars // len(text) + 1))[:chars]


async def chars_per_token(client: openai.AsyncOpenAI) -> float:
    """How the engines count this text (both engines of a pair share a tokenizer): one reply's usage."""
    text = prose(2000)
    reply = await client.chat.completions.create(model=PUBLIC_MODEL, messages=[{"role": "user", "content": text}],
                                                 max_tokens=1)
    return len(text) / reply.usage.prompt_tokens


async def chat(client: openai.AsyncOpenAI, text: str, session: str | None = None) -> tuple[int, dict, str]:
    """(status, reply headers, error code) of one streamed chat request."""
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=PUBLIC_MODEL, messages=[{"role": "user", "content": text}], max_tokens=4, stream=True,
            extra_headers={"x-session-id": session} if session else None)
        async for _ in raw.parse():
            pass
        return raw.status_code, dict(raw.headers), ""
    except openai.APIStatusError as e:
        return e.status_code, dict(e.response.headers), str(e.code)


async def test_requests_go_where_they_fit_and_too_long_ones_are_refused_at_once(
        portfolio: dict[str, str] | None) -> None:
    sims = [] if portfolio is not None else [await start_sim(sim_options(e)) for e in ("llamacpp", "vllm")]
    urls = portfolio or {s.engine: s.url for s in sims}
    cfg = config([{**backend("llama", "llamacpp", urls["llamacpp"]), "interactive": True},
                  backend("vllm", "vllm", urls["vllm"])])
    cfg["routing"] = {"policy": "shape"}
    gw = await start_gateway(cfg)
    try:
        pool = gw.state.pool

        async def both_ready() -> bool:
            return all(b.usable(time.monotonic()) for b in pool.all())

        await until(both_ready, "both backends usable", timeout=60.0)  # (/readyz answers once one backend is ready)
        assert (pool.get("llama").window(PUBLIC_MODEL), pool.get("vllm").window(PUBLIC_MODEL)) == (SMALL, LARGE)
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0,
                                      timeout=120) as client:
            cpt = await chars_per_token(client)

            def sized(tokens: int) -> str:
                return prose(int(tokens * cpt))

            # A session whose history grows past llama.cpp's slot: every turn is served, the long ones by vLLM.
            served, failovers = [], 0
            for turn in range(1, 13):
                status, h, code = await chat(client, sized(300 * turn), session="growing")
                assert status == 200, (turn, status, code)  # no context error reaches a client some backend holds
                served.append(h["x-shapegate-backend"])
                failovers += "failover" in h["x-shapegate-reason"]
            assert served[0] == "llama" and served[-1] == "vllm", served
            assert failovers <= 1, served  # at most one engine refusal taught the estimate the rest
            # Prompts only vLLM holds: served by it, with no refusal on the way now that the estimate learned.
            for i in range(3):
                status, h, code = await chat(client, sized(3200), session=f"long-{i}")
                assert (status, h["x-shapegate-backend"]) == (200, "vllm"), (status, code)
                assert "failover" not in h["x-shapegate-reason"]
            # Far past every window: refused by the gateway, no engine asked.
            status, h, code = await chat(client, sized(60_000))
            assert (status, code, h.get("x-shapegate-backend")) == (400, "context_length_exceeded", None)
    finally:
        await gw.stop()
        for s in sims:
            await s.close()
