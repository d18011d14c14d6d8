"""Context windows through a real gateway in front of simulated engines: discovery, fits, retries, refusals."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from gateway.sim.runner import SimOptions, start_sim
from tests.gateway_harness import USER_KEY, gateway_config, start_gateway

MODEL = "m"
WINDOWS = {"vllm": 4096, "sglang": 2048, "llama": 1024}  # llama.cpp: per slot


@pytest.fixture
async def sims():
    started = {name: await start_sim(SimOptions(engine="llamacpp" if name == "llama" else name, model=MODEL,
                                                max_model_len=n))
               for name, n in WINDOWS.items()}
    yield started
    for s in started.values():
        await s.close()


def backend(sims, name: str, **extra) -> dict:
    engine = "llamacpp" if name == "llama" else name
    return {"id": name, "engine": engine, "url": sims[name].url, "models": [MODEL], **extra}


def words(tokens: int) -> str:
    """Text the simulated engines count as about `tokens` tokens (one per word) and the gateway estimates a
    little higher (five characters a word)."""
    return " word" * tokens


def dense(tokens: int) -> str:
    """Text of one-letter words: the engines count a token per two characters, the gateway one per four, so
    its estimate is about half the truth."""
    return " a" * tokens


async def ask(client: openai.AsyncOpenAI, text: str, session: str | None = None, max_tokens: int = 4,
              stream: bool = False) -> tuple[int, dict]:
    """(status, reply headers) of one chat request; an API error's status and headers likewise."""
    headers = {"x-session-id": session} if session else None
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, stream=stream,
            extra_headers=headers)
    except openai.APIStatusError as e:
        return e.status_code, dict(e.response.headers)
    if stream:
        async for _ in raw.parse():
            pass
    return raw.status_code, dict(raw.headers)


async def all_ready(gw) -> None:
    """Until every backend is ready (/readyz, which start_gateway waits for, needs only one)."""
    for _ in range(200):
        if all(b.usable(time.monotonic()) for b in gw.state.pool.all()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("a backend did not become ready")


@pytest.fixture
async def client():
    async with openai.AsyncOpenAI(base_url="http://unused/v1", api_key=USER_KEY, max_retries=0) as c:
        yield c


def at(client: openai.AsyncOpenAI, gw) -> openai.AsyncOpenAI:
    return client.with_options(base_url=gw.url + "/v1")


async def test_each_engine_says_its_window_and_the_config_overrides_it(sims):
    gw = await start_gateway(gateway_config([backend(sims, "vllm"), backend(sims, "sglang"), backend(sims, "llama"),
                                             backend(sims, "llama", id="capped", max_context=777)]))
    try:
        pool = gw.state.pool
        await all_ready(gw)
        assert {b.id: b.window(MODEL) for b in pool.all()} == {**WINDOWS, "capped": 777}
        assert pool.largest_window(MODEL) == 4096
    finally:
        await gw.stop()


async def test_a_long_prompt_goes_only_where_it_fits(sims, client):
    """2,000 tokens: only vLLM's 4,096 holds them, whatever the class (a session would go to llama.cpp)."""
    gw = await start_gateway(gateway_config([backend(sims, "llama", interactive=True), backend(sims, "sglang"),
                                             backend(sims, "vllm")], routing={"policy": "shape"}))
    await all_ready(gw)
    try:
        for i in range(6):
            status, h = await ask(at(client, gw), words(2000), session=f"s{i}" if i % 2 else None,
                                  stream=bool(i % 3))
            assert status == 200 and h["x-shapegate-backend"] == "vllm", (status, h)
            assert "failover" not in h["x-shapegate-reason"]
    finally:
        await gw.stop()


async def test_a_growing_session_moves_to_the_larger_window_and_keeps_being_served(sims, client):
    gw = await start_gateway(gateway_config([backend(sims, "llama", interactive=True), backend(sims, "vllm")],
                                            routing={"policy": "shape"}))
    await all_ready(gw)
    try:
        served = []
        for turn in range(1, 9):
            status, h = await ask(at(client, gw), words(150 * turn), session="chat-1", stream=True)
            assert status == 200, h  # never a context error: some backend holds every turn
            served.append(h["x-shapegate-backend"])
        assert served[0] == "llama" and served[-1] == "vllm", served
        # Once the history outgrew the small window it stayed on the large one.
        assert served == sorted(served, key=lambda b: b == "vllm"), served
    finally:
        await gw.stop()


async def test_an_undercount_is_retried_on_a_larger_window_and_learned(sims, client):
    gw = await start_gateway(gateway_config([backend(sims, "llama", interactive=True), backend(sims, "vllm")],
                                            routing={"policy": "shape"}))
    await all_ready(gw)
    try:
        # ~1,300 tokens to the engines, ~660 to the gateway's estimate: it looks as if llama.cpp's 1,024 held it.
        status, h = await ask(at(client, gw), dense(1300), session="s1", stream=True)
        assert status == 200 and h["x-shapegate-backend"] == "vllm", h
        assert "failover from llama after context_length_exceeded" in h["x-shapegate-reason"], h
        # llama.cpp said how long the prompt was: the next such request goes to vLLM at once.
        status, h = await ask(at(client, gw), dense(1300), session="s2", stream=True)
        assert status == 200 and h["x-shapegate-backend"] == "vllm" and "failover" not in h["x-shapegate-reason"]
        # A short request of the same kind still fits llama.cpp.
        status, h = await ask(at(client, gw), dense(100), session="s3", stream=True)
        assert status == 200 and h["x-shapegate-backend"] == "llama", h
    finally:
        await gw.stop()


async def test_a_prompt_that_fits_nowhere_is_refused_at_once(sims, client):
    gw = await start_gateway(gateway_config([backend(sims, "llama"), backend(sims, "vllm")]))
    await all_ready(gw)
    try:
        submitted = {n: sims[n].state.tel.requests_total for n in ("llama", "vllm")}
        for stream in (False, True):
            try:
                await at(client, gw).chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": words(20_000)}], max_tokens=4, stream=stream)
                raise AssertionError("a prompt no backend holds was accepted")
            except openai.BadRequestError as e:
                assert e.code == "context_length_exceeded" and e.param == "messages"
                assert "4096 tokens" in e.message
                assert "x-shapegate-backend" not in e.response.headers  # no backend was tried
        assert {n: sims[n].state.tel.requests_total for n in ("llama", "vllm")} == submitted
    finally:
        await gw.stop()


async def test_when_only_a_backend_that_is_down_could_hold_it_the_answer_is_503(sims, client):
    gw = await start_gateway(gateway_config([backend(sims, "llama"), backend(sims, "vllm")]))
    await all_ready(gw)
    try:
        await sims["vllm"].close()  # the one engine with a window large enough goes away
        vllm = gw.state.pool.get("vllm")
        for _ in range(100):
            if not vllm.usable(time.monotonic()):
                break
            await asyncio.sleep(0.05)
        status, h = await ask(at(client, gw), words(2000))
        assert status == 503 and int(h["retry-after"]) >= 1, (status, h)
        status, h = await ask(at(client, gw), words(100))
        assert status == 200 and h["x-shapegate-backend"] == "llama"  # what fits the other one is served
    finally:
        await gw.stop()
