"""The usage ledger against the real engines' own token counters: a mixed run of every generating API, streamed
and not, through two replicas on one Redis in front of llama-server and vLLM, counts what their /metrics count
(llamacpp:prompt_tokens_total + prompt_tokens_cached_total and tokens_predicted_total; vllm:prompt_tokens_total and
generation_tokens_total), within the tokens of requests still in flight when the counts are compared."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import aiohttp
import anthropic
import openai
import pytest

from gateway.sim.runner import start_sim
from tests import kit
from tests.e2e import wire
from tests.e2e.targets import PUBLIC_MODEL, backend, config, engine_running, sim_options
from tests.gateway_harness import ADMIN_KEY, USER_KEY, RunningGateway, start_gateway
from tests.integration.replicas_kit import drop_keys, redis_client
from tests.needs import REDIS_URL

pytestmark = pytest.mark.e2e

ENGINES = ("llamacpp", "vllm")
# Each engine's counters of prompt tokens taken in (llama.cpp counts those its slot cache held apart) and of
# tokens generated: (family, sample) pairs as prometheus_client names them.
PROMPT = {"llamacpp": (("llamacpp:prompt_tokens", "llamacpp:prompt_tokens_total"),
                       ("llamacpp:prompt_tokens_cached", "llamacpp:prompt_tokens_cached_total")),
          "vllm": (("vllm:prompt_tokens", "vllm:prompt_tokens_total"),)}
GENERATED = {"llamacpp": ("llamacpp:tokens_predicted", "llamacpp:tokens_predicted_total"),
             "vllm": ("vllm:generation_tokens", "vllm:generation_tokens_total")}
GENERATING = ("chat", "completions", "responses", "messages")
ROUNDS = 2
MAX_OUT = 6


@pytest.fixture
async def engine_urls(portfolio: dict[str, str] | None) -> AsyncIterator[dict[str, str]]:
    """The real pair, or a pair of simulators shaped like them."""
    if portfolio is not None:
        yield portfolio
        return
    sims = [await start_sim(sim_options(e, report_cached_tokens=True)) for e in ENGINES]
    for s in sims:
        await s.wait_ready(30)
    yield {e: s.url for e, s in zip(ENGINES, sims)}
    for s in sims:
        await s.close()


@pytest.fixture
async def replicas(engine_urls: dict[str, str]) -> AsyncIterator[list[RunningGateway]]:
    client = await redis_client()
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    cfg = config([backend(e, e, url) for e, url in engine_urls.items()])
    cfg["state"] = {"backend": "redis", "redis_url": REDIS_URL, "key_prefix": prefix}
    cfg["usage"] = {"flush_interval_s": 0.1}
    gws = [await start_gateway(cfg, timeout=60.0), await start_gateway(cfg, timeout=60.0)]
    yield gws
    for g in gws:
        await g.stop()
    await drop_keys(client, prefix)
    await client.aclose()


async def engine_counts(http: aiohttp.ClientSession, engine: str, url: str) -> tuple[int, int]:
    fams = await wire.metric_families(http, url)
    prompt = sum(wire.sample_value(fams, *name) for name in PROMPT[engine])
    return int(prompt), int(wire.sample_value(fams, *GENERATED[engine]))


async def ledger_rows(gw: RunningGateway) -> list[dict]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as s:
        async with s.get(gw.url + "/admin/usage", params={"by": "backend,api", "from": "2h"}) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["rows"]


async def ledger_counts(gw: RunningGateway) -> dict[str, tuple[int, int]]:
    out = {e: (0, 0) for e in ENGINES}
    for row in await ledger_rows(gw):
        if row["api"] in GENERATING and row["backend"] in out:
            p, c = out[row["backend"]]
            out[row["backend"]] = (p + row["prompt_tokens"], c + row["completion_tokens"])
    return out


async def one_round(gw: RunningGateway, i: int) -> None:
    """Every generating API once, streamed and not (round robin spreads them over both engines)."""
    text = f"Round {i}. Say something about the sea."
    msgs = [{"role": "user", "content": text}]
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=120) as oai:
        await oai.chat.completions.create(model=PUBLIC_MODEL, messages=msgs, max_tokens=MAX_OUT, temperature=0.7)
        stream = await oai.chat.completions.create(model=PUBLIC_MODEL, messages=msgs, max_tokens=MAX_OUT,
                                                   stream=True, temperature=0.7)
        async for _ in stream:
            pass
        await oai.completions.create(model=PUBLIC_MODEL, prompt=text, max_tokens=MAX_OUT, temperature=0.7)
        await oai.responses.create(model=PUBLIC_MODEL, input=text, max_output_tokens=MAX_OUT, store=False)
        rstream = await oai.responses.create(model=PUBLIC_MODEL, input=text, max_output_tokens=MAX_OUT,
                                             store=False, stream=True)
        async for _ in rstream:
            pass
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=USER_KEY, max_retries=0, timeout=120) as claude:
        await claude.messages.create(model=PUBLIC_MODEL, max_tokens=MAX_OUT, messages=msgs)
        async with claude.messages.stream(model=PUBLIC_MODEL, max_tokens=MAX_OUT, messages=msgs) as ms:
            await ms.get_final_message()


async def test_the_ledger_counts_what_the_engines_count(engine_urls, replicas):
    async with wire.new_session() as http:
        before = {e: await engine_counts(http, e, url) for e, url in engine_urls.items()}
        for i in range(ROUNDS):
            for gw in replicas:
                await one_round(gw, i)

        async def compared() -> tuple[dict, dict] | None:
            # Requests still on an engine (none by now, unless its metrics lag) bound the difference.
            in_flight = sum([await engine_running(http, e, url) for e, url in engine_urls.items()])
            after = {e: await engine_counts(http, e, url) for e, url in engine_urls.items()}
            engines = {e: (after[e][0] - before[e][0], after[e][1] - before[e][1]) for e in engine_urls}
            ledger = await ledger_counts(replicas[1])
            return (engines, ledger) if in_flight == 0 and engines == ledger else None

        try:
            engines, ledger = await kit.until(compared, "the ledger's tokens equal the engines' counters",
                                              timeout=60.0, every=0.5)
        except AssertionError:
            after = {e: await engine_counts(http, e, url) for e, url in engine_urls.items()}
            engines = {e: (after[e][0] - before[e][0], after[e][1] - before[e][1]) for e in engine_urls}
            raise AssertionError(f"engines counted {engines}, the ledger {await ledger_counts(replicas[1])}; "
                                 f"per backend and API: {await ledger_rows(replicas[1])}") from None
    assert all(p > 0 and c > 0 for p, c in ledger.values())  # both engines served
    assert engines == ledger
