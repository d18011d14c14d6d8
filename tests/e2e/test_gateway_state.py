"""Conversations that survive any engine: the gateway keeps the Responses and Conversations state, in front of a
real llama-server and a real vLLM started without any store flag (neither keeps a response), through two replicas
sharing one Redis, with the official Python and JavaScript SDKs. Every turn is routed on its own: round robin sends
them to both engines, and the engine of turn 2 dying before turn 3 costs the chain nothing."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio

from tests.e2e.engines import EngineHandle, start_llama_server, start_vllm_server
from tests.e2e.js_client import run_script
from tests.e2e.targets import PUBLIC_MODEL, backend, config
from tests.gateway_harness import RunningGateway, USER_KEY, start_gateway

# Each test starts its own vLLM (tens of seconds on two cores, more while the session's engines run beside it).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
MAX_OUT = 8
STORE_SWITCH = "VLLM_ENABLE_RESPONSES_API_STORE"


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[dict[str, EngineHandle]]:
    """Engines of this module's own, so that one can be killed: vLLM without its store switch."""
    started: dict[str, EngineHandle] = {}
    try:
        started["llamacpp-real"] = await start_llama_server()
        started["vllm-real"] = await start_vllm_server(env_changes={STORE_SWITCH: ""})
        yield started
    finally:
        for h in started.values():
            await h.close()


@pytest_asyncio.fixture
async def replicas(engines: dict[str, EngineHandle]) -> AsyncIterator[list[RunningGateway]]:
    cfg = config([backend(name, name.split("-")[0], h.url) for name, h in engines.items()])
    cfg["state"] = {"backend": "redis", "key_prefix": f"e2e-{uuid.uuid4().hex[:8]}:"}
    started = [await start_gateway(cfg), await start_gateway(cfg)]
    yield started
    for r in started:
        await r.stop()


def clients(replicas: list[RunningGateway]) -> list[openai.AsyncOpenAI]:
    return [openai.AsyncOpenAI(base_url=r.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=120)
            for r in replicas]


@pytest.mark.parametrize("portfolio", ["real"])
async def test_python_sdk_chains_conversations_and_an_engine_lost_between_turns(
        portfolio: str, engines: dict[str, EngineHandle], replicas: list[RunningGateway]) -> None:
    a, b = clients(replicas)
    try:
        # a plain chain, the turns alternating replicas (and, by round robin, engines)
        prev, served, turns = None, [], []
        for i, c in enumerate((a, b, a)):
            raw = await c.responses.with_raw_response.create(model=PUBLIC_MODEL, input=f"plain turn {i}",
                                                             previous_response_id=prev, max_output_tokens=MAX_OUT)
            turns.append(raw.parse())
            served.append(raw.headers["x-shapegate-backend"])
            prev = turns[-1].id
        assert set(served) == set(engines)  # both engines served turns of one chain
        assert [t.previous_response_id for t in turns] == [None, turns[0].id, turns[1].id]
        for before, after in zip(turns, turns[1:]):  # each turn's prompt holds the turns before it
            assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
        assert (await b.responses.retrieve(prev)).output_text == turns[-1].output_text
        items = [i async for i in a.responses.input_items.list(prev, order="asc")]
        assert [i.content[0].text for i in items if i.role == "user"] == [f"plain turn {i}" for i in range(3)]

        # a streamed chain
        prev = None
        for i, c in enumerate((b, a, b)):
            stream = await c.responses.create(model=PUBLIC_MODEL, input=f"streamed turn {i}", stream=True,
                                              previous_response_id=prev, max_output_tokens=MAX_OUT)
            done = [ev async for ev in stream if ev.type == "response.completed"][0].response
            assert done.previous_response_id == prev and done.store is True
            prev = done.id
        await a.responses.delete(prev)
        with pytest.raises(openai.NotFoundError):
            await b.responses.retrieve(prev)

        # a conversation of three turns
        conv = await a.conversations.create()
        for i, c in enumerate((a, b, a)):
            await c.responses.create(model=PUBLIC_MODEL, input=f"conversation turn {i}", conversation=conv.id,
                                     max_output_tokens=MAX_OUT)
        roles = [i.role async for i in b.conversations.items.list(conv.id, order="asc")]
        assert roles == ["user", "assistant"] * 3

        # the engine of turn 2 dies before turn 3: turn 3 is served by the other one, with the whole chain
        raw = await a.responses.with_raw_response.create(model=PUBLIC_MODEL, input="turn 1",
                                                         max_output_tokens=MAX_OUT)
        first = raw.parse()
        raw = await b.responses.with_raw_response.create(model=PUBLIC_MODEL, input="turn 2",
                                                         previous_response_id=first.id, max_output_tokens=MAX_OUT)
        second, second_engine = raw.parse(), raw.headers["x-shapegate-backend"]
        await engines[second_engine].close()
        raw = await a.responses.with_raw_response.create(model=PUBLIC_MODEL, input="turn 3",
                                                         previous_response_id=second.id, max_output_tokens=MAX_OUT)
        third = raw.parse()
        assert raw.headers["x-shapegate-backend"] != second_engine
        assert third.status in ("completed", "incomplete") and third.previous_response_id == second.id
        assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("portfolio", ["real"])
async def test_javascript_sdk_chains_and_a_conversation(portfolio: str, engines: dict[str, EngineHandle],
                                                        replicas: list[RunningGateway]) -> None:
    seen = await run_script("state_client.mjs", replicas[0].url, replicas[1].url, PUBLIC_MODEL, USER_KEY)
    plain, streamed = seen["plain"], seen["streamed"]
    assert [t["previous"] for t in plain] == [None, plain[0]["id"], plain[1]["id"]]
    assert [t["previous"] for t in streamed] == [None, streamed[0]["id"], streamed[1]["id"]]
    for chain in (plain, streamed, seen["conversation"]):
        assert chain[0]["input"] < chain[1]["input"] < chain[2]["input"]  # every turn holds the ones before
    assert all(t["deltas"] >= 1 for t in streamed)
    assert seen["retrieved"] and seen["deleted"]
    assert seen["input_user_texts"] == [f"plain turn {i}" for i in range(3)]
    assert seen["conversation_roles"] == ["user", "assistant"] * 3
