"""The Responses and Messages APIs with the official `openai` and `anthropic` clients: every call is made
straight to a real engine ("direct") and again through shapegate in front of that engine ("gateway"), and
both must give the same kind of result.

What each engine serves (see OBSERVED.md, "Responses, Messages and the rest"):
- both: POST /v1/responses (plain and streamed), POST /v1/messages (plain and streamed),
  POST /v1/messages/count_tokens;
- vLLM only: a response store, so `previous_response_id` and GET /v1/responses/{id}; it needs
  VLLM_ENABLE_RESPONSES_API_STORE=1 at launch (without it every lookup is 404);
- llama-server only: POST /v1/responses/input_tokens. It keeps no responses and refuses
  `previous_response_id` with a 400, so the chain and retrieve tests run on vLLM only.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio
from anthropic.types import Message, MessageTokensCount, TextBlock
from openai.types.responses import (
    InputTokenCountResponse,
    Response,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextDeltaEvent,
)

from tests.e2e import vllm_env, wire
from tests.e2e.engines import EngineHandle
from tests.e2e.targets import PUBLIC_MODEL, open_target
from tests.gateway_harness import USER_KEY

pytestmark = pytest.mark.e2e

MAX_OUT = 8
PROMPT = "Say something."
# Both engines load the same vocabulary: "Say something." in the ChatML template is 27 tokens on each.
PROMPT_TOKENS = 27
# The switch that gives vLLM's OpenAI server its (in-memory) response store.
VLLM_STORE_SWITCH = "VLLM_ENABLE_RESPONSES_API_STORE"

# A response cut by max_output_tokens: vLLM says "incomplete" (incomplete_details.reason "max_output_tokens"),
# llama-server still says "completed".
STATUS_AT_LIMIT = {"llamacpp": "completed", "vllm": "incomplete"}

# Streamed event types, repeats collapsed: the same order on both engines.
RESPONSE_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                   "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                   "response.content_part.done", "response.output_item.done", "response.completed"]
MESSAGE_EVENTS = ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                  "message_delta", "message_stop"]

# Rejected with 400 by both engines (llama-server accepts most malformed Messages bodies, even without
# max_tokens, but not a content that is neither a string nor a list).
BAD_MESSAGES = [{"role": "user", "content": 5}]


@dataclass(frozen=True)
class Side:
    """Where the clients send: the engine itself, or a gateway whose only backend is that engine."""

    engine: str  # "llamacpp" | "vllm"
    base: str  # URL root, without /v1
    model: str  # the name clients send, and the one replies must carry
    key: str
    backend_id: str | None  # the gateway's backend id; None when direct

    @property
    def via_gateway(self) -> bool:
        return self.backend_id is not None

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=self.key, max_retries=0, timeout=60)

    def anthropic(self) -> anthropic.AsyncAnthropic:
        # the SDK sends the key as x-api-key, as Anthropic clients do
        return anthropic.AsyncAnthropic(base_url=self.base, api_key=self.key, max_retries=0, timeout=60)

    def check_backend_header(self, headers: Any) -> None:
        if self.via_gateway:
            assert headers.get("x-shapegate-backend") == self.backend_id


@pytest_asyncio.fixture(params=["direct", "gateway"])
async def side(request: pytest.FixtureRequest, engine: EngineHandle) -> AsyncIterator[Side]:
    if request.param == "direct":
        yield Side(engine.engine, engine.url, engine.model, "sk-unused", None)
        return
    name = f"{engine.engine}-real"
    async with open_target(name, engine) as target:
        yield Side(engine.engine, target.url, PUBLIC_MODEL, USER_KEY, name)


vllm_only = pytest.mark.parametrize("engine", ["vllm"], indirect=True)
llama_only = pytest.mark.parametrize("engine", ["llamacpp"], indirect=True)


def _require_vllm_store() -> None:
    """The session's vLLM was launched with this process's environment plus LAUNCH_ENV: without the switch it
    answers every stored-response lookup with 404, which would read as a gateway fault."""
    if {**os.environ, **vllm_env.LAUNCH_ENV}.get(VLLM_STORE_SWITCH) != "1":
        pytest.fail(f"vLLM was started without {VLLM_STORE_SWITCH}=1 (tests/e2e/vllm_env.LAUNCH_ENV): "
                    "it stores no responses, so previous_response_id and retrieve cannot work", pytrace=False)


def _collapsed(types: list[str]) -> list[str]:
    out: list[str] = []
    for t in types:
        if not out or out[-1] != t:
            out.append(t)
    return out


def _check_response(side: Side, r: Response) -> None:
    assert isinstance(r, Response) and r.object == "response"
    assert r.id.startswith("resp_") and r.model == side.model
    (item,) = r.output
    assert isinstance(item, ResponseOutputMessage) and item.role == "assistant" and item.id.startswith("msg_")
    assert all(isinstance(part, ResponseOutputText) for part in item.content)
    assert r.output_text
    u = r.usage
    assert u is not None and u.input_tokens == PROMPT_TOKENS
    assert 1 <= u.output_tokens <= MAX_OUT and u.total_tokens == u.input_tokens + u.output_tokens
    if u.output_tokens == MAX_OUT:
        assert r.status == STATUS_AT_LIMIT[side.engine]
    else:  # the model stopped by itself first
        assert r.status == "completed"


def _check_message(side: Side, m: Message) -> None:
    assert isinstance(m, Message) and m.type == "message" and m.role == "assistant"
    assert m.id and m.model == side.model
    (block,) = m.content
    assert isinstance(block, TextBlock) and block.text
    assert m.stop_reason in ("max_tokens", "end_turn")
    # llama-server counts the cached part of the prompt apart (cache_read_input_tokens), as Anthropic does
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == PROMPT_TOKENS
    assert 1 <= m.usage.output_tokens <= MAX_OUT


# -- Responses API -------------------------------------------------------------------------------------------
async def test_responses_create(side: Side) -> None:
    async with side.openai() as client:
        raw = await client.responses.with_raw_response.create(model=side.model, input=PROMPT,
                                                              max_output_tokens=MAX_OUT, temperature=0.7)
    side.check_backend_header(raw.headers)
    _check_response(side, raw.parse())


async def test_responses_create_with_instructions_and_item_list(side: Side) -> None:
    async with side.openai() as client:
        r = await client.responses.create(
            model=side.model, instructions="Be brief.", max_output_tokens=MAX_OUT,
            input=[{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}])
    assert isinstance(r, Response) and r.output_text and r.model == side.model
    assert r.usage is not None and r.usage.input_tokens > PROMPT_TOKENS  # the system turn counts too


async def test_responses_stream(side: Side) -> None:
    async with side.openai() as client:
        stream = await client.responses.create(model=side.model, input=PROMPT, max_output_tokens=MAX_OUT,
                                               temperature=0.7, stream=True)
        events = [e async for e in stream]
    assert _collapsed([e.type for e in events]) == RESPONSE_EVENTS
    first, last = events[0], events[-1]
    assert isinstance(first, ResponseCreatedEvent) and isinstance(last, ResponseCompletedEvent)
    assert first.response.id == last.response.id
    done = last.response
    _check_response(side, done)
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    # one event per token, unless a busy vLLM hands its API server several tokens at once
    assert 1 <= len(deltas) <= done.usage.output_tokens
    assert "".join(d.delta for d in deltas) == done.output_text


@vllm_only
async def test_responses_retrieve(side: Side) -> None:
    _require_vllm_store()
    async with side.openai() as client:
        made = await client.responses.create(model=side.model, input=PROMPT, max_output_tokens=MAX_OUT, store=True)
        got = await client.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError) as err:
            await client.responses.retrieve("resp_0000000000000000")
    assert isinstance(got, Response) and got.id == made.id and got.model == side.model
    assert got.status == made.status and got.output_text == made.output_text
    assert got.usage is not None and got.usage.output_tokens == made.usage.output_tokens
    assert err.value.status_code == 404


@vllm_only
async def test_responses_previous_response_id_chain(side: Side) -> None:
    """Three turns, each continuing the last by id: every turn's prompt holds the turns before it."""
    _require_vllm_store()
    turns: list[Response] = []
    async with side.openai() as client:
        for text in (PROMPT, "And then?", "Once more."):
            follow = {"previous_response_id": turns[-1].id} if turns else {}
            turns.append(await client.responses.create(model=side.model, input=text, max_output_tokens=MAX_OUT,
                                                       **follow))
        # the stored copies of the whole chain
        stored = [await client.responses.retrieve(t.id) for t in turns]
    assert len({t.id for t in turns}) == 3
    assert [t.previous_response_id for t in turns] == [None, turns[0].id, turns[1].id]
    for before, after in zip(turns, turns[1:]):
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
    assert [s.id for s in stored] == [t.id for t in turns]
    assert [s.output_text for s in stored] == [t.output_text for t in turns]


async def test_responses_null_previous_response_id_starts_afresh(side: Side) -> None:
    """`previous_response_id=None` makes the SDK send an explicit null: both engines take it as absent."""
    async with side.openai() as client:
        r = await client.responses.create(model=side.model, input=PROMPT, max_output_tokens=MAX_OUT,
                                          previous_response_id=None)
    _check_response(side, r)
    assert r.previous_response_id is None


@vllm_only
async def test_responses_unknown_previous_response_id_is_404(side: Side) -> None:
    _require_vllm_store()
    async with side.openai() as client:
        with pytest.raises(openai.NotFoundError) as err:
            await client.responses.create(model=side.model, input=PROMPT, max_output_tokens=MAX_OUT,
                                          previous_response_id="resp_0000000000000000")
    assert err.value.status_code == 404


@llama_only
async def test_responses_input_tokens(side: Side) -> None:
    async with side.openai() as client:
        count = await client.responses.input_tokens.count(model=side.model, input=PROMPT)
    assert isinstance(count, InputTokenCountResponse) and count.input_tokens == PROMPT_TOKENS


# llama-server itself, no gateway: what it does not do (the gateway cannot rely on the engine for these).
@llama_only
async def test_llama_refuses_previous_response_id_and_stores_nothing(engine: EngineHandle) -> None:
    async with openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="sk-unused", max_retries=0,
                                  timeout=60) as client:
        made = await client.responses.create(model=engine.model, input=PROMPT, max_output_tokens=MAX_OUT,
                                             store=True)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=engine.model, input="And then?", max_output_tokens=MAX_OUT,
                                          previous_response_id=made.id)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.retrieve(made.id)
    assert refused.value.body == {"code": 400, "message": "llama.cpp does not support 'previous_response_id'.",
                                  "type": "invalid_request_error"}
    assert missing.value.body == {"message": "File Not Found", "type": "not_found_error", "code": 404}


# -- Messages API --------------------------------------------------------------------------------------------
async def test_messages_create(side: Side) -> None:
    async with side.anthropic() as client:
        raw = await client.messages.with_raw_response.create(
            model=side.model, max_tokens=MAX_OUT, messages=[{"role": "user", "content": PROMPT}])
    side.check_backend_header(raw.headers)
    _check_message(side, await raw.parse())


async def test_messages_stream(side: Side) -> None:
    async with side.anthropic() as client:
        stream = await client.messages.create(model=side.model, max_tokens=MAX_OUT, stream=True,
                                              messages=[{"role": "user", "content": PROMPT}])
        events = [e async for e in stream]
    # the SDK's own accumulator over a second stream, on a client of its own: llama-server closes the connection
    # after a stream (OBSERVED.md, "Connections"), and a client reusing it at once races that close
    async with side.anthropic() as client:
        async with client.messages.stream(model=side.model, max_tokens=MAX_OUT,
                                          messages=[{"role": "user", "content": PROMPT}]) as helper:
            final = await helper.get_final_message()
    assert _collapsed([e.type for e in events]) == MESSAGE_EVENTS
    start, delta = events[0], events[-2]
    assert start.message.model == side.model and start.message.usage is not None
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert all(d.delta.type == "text_delta" for d in deltas)
    assert delta.delta.stop_reason in ("max_tokens", "end_turn")
    assert 1 <= len(deltas) <= delta.usage.output_tokens  # see test_responses_stream
    _check_message(side, final)


async def test_messages_count_tokens(side: Side) -> None:
    async with side.anthropic() as client:
        count = await client.messages.count_tokens(model=side.model,
                                                   messages=[{"role": "user", "content": PROMPT}])
        with_system = await client.messages.count_tokens(model=side.model, system="Be brief.",
                                                         messages=[{"role": "user", "content": PROMPT}])
    assert isinstance(count, MessageTokensCount) and count.input_tokens == PROMPT_TOKENS
    assert with_system.input_tokens > PROMPT_TOKENS


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_bad_request_is_400(side: Side, stream: bool) -> None:
    async with side.anthropic() as client:
        with pytest.raises(anthropic.BadRequestError) as err:
            await client.messages.create(model=side.model, max_tokens=MAX_OUT, messages=BAD_MESSAGES,
                                         stream=stream)
    assert err.value.status_code == 400


async def test_unserved_path_is_404(side: Side) -> None:
    """A path no engine serves: 404 from either engine (each in its own words) and from the gateway."""
    async with wire.new_session(headers={"Authorization": f"Bearer {side.key}"}) as http:
        reply = await wire.post(http, side.base + "/v1/no-such-api", {"model": side.model})
    assert reply.status == 404


# -- stored responses across replicas ---------------------------------------------------------------------------
async def test_responses_chain_through_two_replicas_sharing_redis(llama_server: EngineHandle,
                                                                  vllm_server: EngineHandle) -> None:
    """With the state left to the engines ([responses] state = "engine"): two replicas share Redis in front of vLLM
    (which stores responses) and llama-server (which does not), by round robin: a chain of 3 turns alternates
    replicas, and each follow-up reaches the engine that holds the response it continues; the replica that did not
    make a response finds it; another key gets a 404. (The gateway's own state: test_gateway_state.py.)"""
    import uuid

    from gateway.keys.principal import hash_key
    from tests.e2e.targets import backend, config
    from tests.gateway_harness import start_gateway

    _require_vllm_store()
    other = "sk-e2e-other-key"
    cfg = config([backend("vllm-real", "vllm", vllm_server.url), backend("llamacpp-real", "llamacpp",
                                                                         llama_server.url)])
    cfg["state"] = {"backend": "redis", "key_prefix": f"e2e-{uuid.uuid4().hex[:8]}:"}
    cfg["responses"] = {"state": "engine"}
    cfg["auth"]["keys"].append({"id": "other", "sha256": hash_key(other)})
    replicas = [await start_gateway(cfg), await start_gateway(cfg)]
    try:
        clients = [openai.AsyncOpenAI(base_url=r.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=60)
                   for r in replicas]
        # the first turn where vLLM made it (round robin alternates; llama-server's responses are not stored)
        for _ in range(4):
            raw = await clients[0].responses.with_raw_response.create(model=PUBLIC_MODEL, input=PROMPT,
                                                                      max_output_tokens=MAX_OUT)
            if raw.headers["x-shapegate-backend"] == "vllm-real":
                break
        assert raw.headers["x-shapegate-backend"] == "vllm-real"
        turns = [raw.parse()]
        for i, text in enumerate(("And then?", "Once more.")):
            raw = await clients[(i + 1) % 2].responses.with_raw_response.create(
                model=PUBLIC_MODEL, input=text, max_output_tokens=MAX_OUT, previous_response_id=turns[-1].id)
            assert raw.headers["x-shapegate-backend"] == "vllm-real"  # never llama-server, though its turn came
            turns.append(raw.parse())
        assert [t.previous_response_id for t in turns] == [None, turns[0].id, turns[1].id]
        assert turns[2].usage.input_tokens > turns[1].usage.input_tokens > turns[0].usage.input_tokens
        for t in turns:  # each replica reads each turn back, wherever it was made
            for c in clients:
                assert (await c.responses.retrieve(t.id)).output_text == t.output_text
        async with openai.AsyncOpenAI(base_url=replicas[1].url + "/v1", api_key=other, max_retries=0) as theirs:
            with pytest.raises(openai.NotFoundError):
                await theirs.responses.retrieve(turns[0].id)
        for c in clients:
            await c.close()
    finally:
        for r in replicas:
            await r.stop()
