"""The real engines' OpenAI surface, byte for byte: health, chat/completions, usage, errors, client compatibility."""

from __future__ import annotations

import openai
import pytest

from tests.e2e import wire
from tests.e2e.engines import EngineHandle, Probe, start_llama_server
from tests.e2e.quirks import QUIRKS, check_connection_after_reply

pytestmark = pytest.mark.e2e

# "Say something." in the ChatML template is 27 tokens of the tiny vocabulary: both engines load
# the same vocabulary (GGUF / tokenizer.json), so both must count the same.
CHAT_PROMPT_TOKENS = 27
MAX_TOKENS = 8
LOADING_503 = b'{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'


def _phases(probes: list[Probe]) -> list[int | str]:
    """Start-up answers with repeats collapsed: e.g. ["refused", 503, 200]."""
    out: list[int | str] = []
    for p in probes:
        phase: int | str = "refused" if p.status is None else p.status
        if not out or out[-1] != phase:
            out.append(phase)
    return out


def _printable(text: str) -> bool:
    return all(ch == "\n" or " " <= ch <= "~" for ch in text)


async def test_health_when_ready(engine: EngineHandle) -> None:
    async with wire.new_session() as http:
        reply = await wire.get(http, engine.url + "/health")
    assert reply.status == 200
    assert reply.body == QUIRKS[engine.engine].health_ok_body


async def test_vllm_startup_refused_then_200(vllm_server: EngineHandle) -> None:
    # no "loading" phase: connection refused until the engine is built, then 200 with an empty body
    assert _phases(vllm_server.probes) == ["refused", 200]
    assert vllm_server.probes[-1].body == b""


async def test_llama_startup_refused_503_then_200(llama_server: EngineHandle) -> None:
    handles: list[EngineHandle] = []
    probes = llama_server.probes
    try:
        # the 503 window of a tiny model is milliseconds long: retry a fresh start if the poll missed it
        while 503 not in _phases(probes) and len(handles) < 3:
            handles.append(await start_llama_server())
            probes = handles[-1].probes
    finally:
        for h in handles:
            await h.close()
    phases = _phases(probes)
    assert phases[-1] == 200 and probes[-1].body == b'{"status":"ok"}'
    assert 503 in phases, f"never saw the loading phase: {phases}"
    # only ever forwards: refused (not bound yet) -> 503 loading -> 200 ready
    order = ["refused", 503, 200]
    assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases), phases
    assert {p.body for p in probes if p.status == 503} == {LOADING_503}


async def test_chat_non_stream(engine: EngineHandle) -> None:
    q = QUIRKS[engine.engine]
    async with wire.new_session() as http:
        reply = await wire.post(http, engine.url + "/v1/chat/completions", wire.chat_body(engine.model))
    assert reply.status == 200 and reply.content_type.startswith("application/json")
    body = reply.json()
    assert body["object"] == "chat.completion" and body["model"] == engine.model
    assert body["system_fingerprint"].startswith(q.fingerprint_prefix)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] and _printable(choice["message"]["content"])
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (CHAT_PROMPT_TOKENS, MAX_TOKENS)
    assert usage["total_tokens"] == CHAT_PROMPT_TOKENS + MAX_TOKENS
    assert ("timings" in body) == q.timings_on_last_chunk


async def test_chat_stream_layout(engine: EngineHandle) -> None:
    q = QUIRKS[engine.engine]
    async with wire.new_session() as http:
        reply = await wire.post(http, engine.url + "/v1/chat/completions", wire.chat_body(engine.model, stream=True))
    assert reply.status == 200 and reply.content_type.startswith("text/event-stream")
    s = wire.parse_sse(reply.body)
    assert s.done and not s.other
    assert {e["object"] for e in s.events} == {"chat.completion.chunk"}
    assert len({e["id"] for e in s.events}) == 1
    first = s.events[0]["choices"][0]
    assert first["delta"] == q.first_chat_delta and first["finish_reason"] is None
    assert not any("usage" in e for e in s.events), "usage must need stream_options.include_usage"
    last = s.events[-1]["choices"][0]
    assert last["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in s.events[:-1])
    if q.finish_in_empty_delta:
        assert last["delta"] == {}
    else:
        assert last["delta"].get("content")
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in s.events)
    assert text and _printable(text)
    assert [("timings" in e) for e in s.events] == [False] * (len(s.events) - 1) + [q.timings_on_last_chunk]


@pytest.mark.parametrize("stream_options", [{"include_usage": True}, {}, {"include_usage": False}])
async def test_chat_stream_usage(engine: EngineHandle, stream_options: dict[str, bool]) -> None:
    q = QUIRKS[engine.engine]
    body = wire.chat_body(engine.model, stream=True, stream_options=stream_options)
    async with wire.new_session() as http:
        reply = await wire.post(http, engine.url + "/v1/chat/completions", body)
    s = wire.parse_sse(reply.body)
    assert reply.status == 200 and s.done
    wants_usage = stream_options.get("include_usage", q.usage_with_empty_stream_options)
    with_usage = [e for e in s.events if "usage" in e]
    if not wants_usage:
        assert with_usage == []
        return
    # one extra chunk after the finish chunk: no choices, the usage, and (llama.cpp) the timings
    assert with_usage == [s.events[-1]]
    assert s.events[-1]["choices"] == []
    usage = s.events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (CHAT_PROMPT_TOKENS, MAX_TOKENS)
    assert s.events[-2]["choices"][0]["finish_reason"] == "length"
    assert ("timings" in s.events[-1]) == q.timings_on_last_chunk
    assert "timings" not in s.events[-2]


async def test_continuous_usage_alone(engine: EngineHandle) -> None:
    body = wire.chat_body(engine.model, stream=True, stream_options={"continuous_usage_stats": True})
    async with wire.new_session() as http:
        reply = await wire.post(http, engine.url + "/v1/chat/completions", body)
    s = wire.parse_sse(reply.body)
    assert reply.status == 200 and s.done
    assert any("usage" in e for e in s.events) == QUIRKS[engine.engine].continuous_usage_alone_sends_usage


# prompt words that leave under 100 tokens of room: 1,966 of 2,048 (llama.cpp), 4,036 of 4,096 (vLLM)
NEAR_FULL_WORDS = {"llamacpp": 650, "vllm": 1340}


async def test_max_tokens_past_the_context(engine: EngineHandle) -> None:
    body = wire.chat_body(engine.model, content=wire.overlong_text(NEAR_FULL_WORDS[engine.engine]),
                          max_tokens=400, ignore_eos=True)
    async with wire.new_session() as http:
        reply = await wire.post(http, engine.url + "/v1/chat/completions", body)
    assert QUIRKS[engine.engine].max_tokens_capped_at_context
    assert reply.status == 200, reply.body[:300]
    usage, choice = reply.json()["usage"], reply.json()["choices"][0]
    ctx = 2048 if engine.engine == "llamacpp" else 4096
    assert usage["total_tokens"] == ctx and usage["completion_tokens"] < 400
    assert choice["finish_reason"] == "length"


async def test_stream_options_without_stream(engine: EngineHandle) -> None:
    body = wire.chat_body(engine.model, stream_options={"include_usage": True})
    async with wire.new_session() as http:
        reply = await wire.post(http, engine.url + "/v1/chat/completions", body)
    assert reply.status == QUIRKS[engine.engine].stream_options_without_stream_status, reply.body[:300]


async def test_completions(engine: EngineHandle) -> None:
    q = QUIRKS[engine.engine]
    async with wire.new_session() as http:
        plain = await wire.post(http, engine.url + "/v1/completions", wire.completion_body(engine.model))
        streamed = await wire.post(http, engine.url + "/v1/completions", wire.completion_body(engine.model, stream=True))
    body = plain.json()
    assert plain.status == 200 and body["object"] == "text_completion"
    assert body["id"].startswith(q.completion_id_prefix)
    assert body["choices"][0]["finish_reason"] == "length" and _printable(body["choices"][0]["text"])
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    s = wire.parse_sse(streamed.body)
    assert streamed.status == 200 and s.done and not s.other
    assert {e["object"] for e in s.events} == {"text_completion"}
    assert "text" in s.events[0]["choices"][0]  # no role chunk on the legacy route
    last = s.events[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert (last["choices"][0]["text"] == "") == q.finish_in_empty_delta
    assert ("usage" in last) == q.completions_stream_usage_by_default
    assert not any("usage" in e for e in s.events[:-1])


@pytest.mark.parametrize("stream", [False, True])
async def test_overlong_prompt_rejected_before_stream(engine: EngineHandle, stream: bool) -> None:
    q = QUIRKS[engine.engine]
    body = wire.chat_body(engine.model, content=wire.overlong_text(), stream=stream)
    async with wire.new_session() as http:
        reply = await wire.post(http, engine.url + "/v1/chat/completions", body)
    # plain JSON even for stream: true; the error comes before any SSE
    assert reply.status == 400 and reply.content_type.startswith("application/json")
    error = reply.json()["error"]
    assert error["type"] == q.overlong_error_type and error["code"] == 400
    if q.overlong_param is None:
        assert "param" not in error
        assert error["n_ctx"] == 2048 < error["n_prompt_tokens"]  # per-slot context: 4096 / 2 slots
    else:
        assert error["param"] == q.overlong_param
        assert "maximum context length is 4096 tokens" in error["message"]


async def test_unknown_model(engine: EngineHandle) -> None:
    q = QUIRKS[engine.engine]
    async with wire.new_session() as http:
        reply = await wire.post(http, engine.url + "/v1/chat/completions", wire.chat_body("no-such-model"))
    assert reply.status == q.unknown_model_status
    if q.unknown_model_error_type is None:
        assert reply.json()["model"] == engine.model  # the reply names the served alias
    else:
        error = reply.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (q.unknown_model_error_type, "model", 404)
        assert "does not exist" in error["message"]


async def test_openai_client(engine: EngineHandle) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    async with openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0) as client:
        done = await client.chat.completions.create(model=engine.model, messages=messages, max_tokens=MAX_TOKENS)
        assert done.choices[0].finish_reason == "length" and done.usage is not None
        assert done.usage.completion_tokens == MAX_TOKENS
        stream = await client.chat.completions.create(model=engine.model, messages=messages, max_tokens=MAX_TOKENS,
                                                      stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    # llama-server closes the connection after a stream (test_keep_alive_after_response): a client that
    # reuses it at once races that close, so the next request goes on a client of its own.
    async with openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=engine.model, max_tokens=MAX_TOKENS,
                                                 messages=[{"role": "user", "content": wire.overlong_text()}])
        assert err.value.status_code == 400


@pytest.mark.parametrize("stream", [False, True])
async def test_keep_alive_after_response(engine: EngineHandle, stream: bool) -> None:
    """llama-server closes the connection after a streamed reply although it answered `Keep-Alive`:
    a pooled client connection reused at once fails on its next write."""
    q = QUIRKS[engine.engine]
    head, closed = await wire.raw_exchange(engine.port, wire.chat_body(engine.model, stream=stream))
    check_connection_after_reply(q, head, closed, stream)
