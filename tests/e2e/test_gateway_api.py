"""The OpenAI surface through shapegate with the official client, the same on each real engine and its simulator."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from tests.e2e import wire
from tests.e2e.targets import PUBLIC_MODEL, Target, backend, config, gateway_metrics, labelled, open_target, stats
from tests.gateway_harness import USER_KEY, start_gateway

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Say something."}]
# Both real engines load the same vocabulary: "Say something." in ChatML is 27 tokens on each.
REAL_CHAT_PROMPT_TOKENS = 27
# explicit sampling (the engines' defaults differ) and a fixed length (the simulator stops early otherwise)
SAMPLING: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 0.7, "top_p": 1.0,
                            "extra_body": {"ignore_eos": True}}
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def _wire_body(route: str, **extra: Any) -> dict[str, Any]:
    body = {**{k: v for k, v in SAMPLING.items() if k != "extra_body"}, **SAMPLING["extra_body"], **extra}
    if route == "chat":
        return {"model": PUBLIC_MODEL, "messages": MESSAGES, **body}
    return {"model": PUBLIC_MODEL, "prompt": "The gateway", **body}


def _session() -> aiohttp.ClientSession:
    return wire.new_session(headers={"Authorization": f"Bearer {USER_KEY}"})


async def _create(client: openai.AsyncOpenAI, route: str, **extra: Any) -> Any:
    if route == "chat":
        return await client.chat.completions.create(model=PUBLIC_MODEL, messages=MESSAGES, **SAMPLING, **extra)
    return await client.completions.create(model=PUBLIC_MODEL, prompt="The gateway", **SAMPLING, **extra)


async def test_chat_non_stream(target: Target) -> None:
    async with target.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model=PUBLIC_MODEL, messages=MESSAGES,
                                                                      **SAMPLING)
    done = raw.parse()
    assert raw.headers["x-shapegate-backend"] == target.name
    assert done.model == PUBLIC_MODEL
    assert done.choices[0].finish_reason == "length" and done.choices[0].message.content
    assert done.usage is not None and done.usage.completion_tokens == MAX_TOKENS
    if target.real:
        assert done.usage.prompt_tokens == REAL_CHAT_PROMPT_TOKENS
    assert done.usage.prompt_tokens > 0


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_stream_on_the_wire(target: Target, route: str) -> None:
    """Each engine's own stream layout passes through; only the model name changes; [DONE] ends it."""
    q = target.quirks
    async with _session() as http:
        reply = await wire.post(http, target.url + ROUTES[route], _wire_body(route, stream=True))
    assert reply.status == 200 and reply.content_type.startswith("text/event-stream")
    s = wire.parse_sse(reply.body)
    assert s.done and not s.other
    assert {e["model"] for e in s.events} == {PUBLIC_MODEL}
    # usage the client did not ask for never shows (llama.cpp's completions carry it by default)
    assert all(e.get("usage") is None for e in s.events)
    last = s.events[-1]["choices"][0]
    assert last["finish_reason"] == "length"
    if route == "chat":
        assert s.events[0]["choices"][0]["delta"] == q.first_chat_delta
        assert (last["delta"] == {}) == q.finish_in_empty_delta
    else:
        assert s.events[0]["id"].startswith(q.completion_id_prefix)
    # llama.cpp's `timings` (on its finish or usage chunk) are its own, not OpenAI's: the gateway drops them
    # unless [server] engine_private_fields keeps them (false by default).
    assert not any("timings" in e for e in s.events)


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_non_stream_completions(target: Target, route: str) -> None:
    async with target.client() as client:
        done = await _create(client, route)
    assert done.model == PUBLIC_MODEL and done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == MAX_TOKENS


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}, {"include_usage": True}],
                         ids=["absent", "empty", "false", "true"])
async def test_stream_usage_only_when_asked(target: Target, route: str, options: dict[str, bool] | None) -> None:
    extra = {"stream": True} if options is None else {"stream": True, "stream_options": options}
    async with target.client() as client:
        stream = await _create(client, route, **extra)
        chunks = [c async for c in stream]
    assert {c.model for c in chunks} == {PUBLIC_MODEL}
    with_usage = [c for c in chunks if c.usage is not None]
    if not (options or {}).get("include_usage"):
        assert with_usage == []
        return
    # exactly one chunk, the last; a separate choices-less chunk, except on llama.cpp's completions
    assert with_usage == [chunks[-1]]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    if target.real and route == "chat":
        assert chunks[-1].usage.prompt_tokens == REAL_CHAT_PROMPT_TOKENS
    separate = route == "chat" or not target.quirks.completions_stream_usage_by_default
    assert (chunks[-1].choices == []) == separate


async def test_gateway_counts_tokens_the_client_did_not_ask_for(target: Target) -> None:
    async with target.client() as client:
        stream = await _create(client, "chat", stream=True)
        assert all([c.usage is None async for c in stream])
        done = await _create(client, "chat")
    prompt = done.usage.prompt_tokens
    async with _session() as http:
        fams = await gateway_metrics(http, target.url)
        report = await stats(http, target.url)
    by_backend = {"backend": target.name}
    assert labelled(fams, "shapegate_completion_tokens", "shapegate_completion_tokens_total",
                    **by_backend) == 2 * MAX_TOKENS
    assert labelled(fams, "shapegate_prompt_tokens", "shapegate_prompt_tokens_total", **by_backend) == 2 * prompt
    (row,) = report["backends"]
    assert row["overall"]["requests"] == 2 and row["overall"]["prompt_tokens_p50"] == prompt
    assert row["overall"]["ttft_ms"]["p50"] is not None and row["overall"]["itl_ms"]["p50"] is not None


@pytest.mark.parametrize("stream", [False, True])
async def test_overlong_prompt_is_context_length_exceeded(target: Target, stream: bool) -> None:
    async with target.client() as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(
                model=PUBLIC_MODEL, messages=[{"role": "user", "content": wire.overlong_text()}],
                max_tokens=MAX_TOKENS, stream=stream)
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
    assert err.value.param == "messages"


@pytest.mark.parametrize("stream", [False, True])
async def test_unknown_public_model_is_404_from_the_gateway(target: Target, stream: bool) -> None:
    async with target.client() as client:
        with pytest.raises(openai.NotFoundError) as err:
            await client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2,
                                                 stream=stream)
    assert err.value.code == "model_not_found" and err.value.param == "model"
    assert "x-shapegate-backend" not in err.value.response.headers  # never reached an engine


async def test_streams_and_replies_alternate_on_pooled_connections(target: Target) -> None:
    """llama-server drops the connection after each stream; the next request must not notice."""
    async with target.client() as client:
        for i in range(6):
            if i % 2:
                assert (await _create(client, "chat")).usage.completion_tokens == MAX_TOKENS
            else:
                chunks = [c async for c in await _create(client, "chat", stream=True)]
                assert chunks[-1].choices[0].finish_reason == "length"
    async with _session() as http:
        fams = await gateway_metrics(http, target.url)
    assert labelled(fams, "shapegate_requests", "shapegate_requests_total", backend=target.name,
                    status="200", model=PUBLIC_MODEL) == 6
    assert labelled(fams, "shapegate_upstream_retries", "shapegate_upstream_retries_total",
                    backend=target.name) is None


@pytest.mark.parametrize("target_engine", ["llamacpp-real", "llamacpp-sim"], indirect=True)
async def test_llama_alias_is_rewritten_when_configured_under_another_name(
        target_engine: tuple[str, Any]) -> None:
    name, handle = target_engine
    async with open_target(name, handle) as t:
        cfg = config([backend(name, "llamacpp", t.engine_url, native="model.gguf")])
        gw = await start_gateway(cfg)
        try:
            async with _session() as http:
                reply = await wire.post(http, gw.url + "/v1/chat/completions", _wire_body("chat"))
        finally:
            await gw.stop()
    assert reply.status == 200 and reply.json()["model"] == PUBLIC_MODEL
