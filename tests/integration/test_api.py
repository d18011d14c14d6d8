"""The public API through the official openai client: chat, completions, streams, models, rewrite, headers."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.gateway_harness import USER_KEY

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
async def c(gateway):
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=USER_KEY, max_retries=0) as client:
        yield client


async def test_chat_non_stream_rewrites_model_both_ways(gateway, engines, c):
    seen_models = set()
    for _ in range(4):
        raw = await c.chat.completions.with_raw_response.create(
            model="m1", messages=[{"role": "user", "content": "hello"}], max_tokens=5, extra_body={"top_k": 7, "cache_prompt": True})
        r = raw.parse()
        assert r.model == "m1"
        assert r.choices[0].message.content == "w0 w1 w2 w3 w4"
        assert r.usage.completion_tokens == 5
        assert raw.headers["x-shapegate-backend"] in ("vllm-a", "llama-b")
        assert raw.headers["x-request-id"]
        seen_models.add(raw.headers["x-shapegate-backend"])
    assert seen_models == {"vllm-a", "llama-b"}
    upstream_models = {b["model"] for e in engines for b in e.knobs.seen}
    assert upstream_models == {"native-m1", "m1.gguf"}
    # Unknown fields pass through untouched.
    assert all(b.get("top_k") == 7 for e in engines for b in e.knobs.seen)


async def test_forward_bytes_unchanged_when_nothing_changes(gateway, engines, c):
    body = b'{"model":"m2","messages":[{"role":"user","content":"x"}],"max_tokens":2,"weird":{"a":[1,2]}}'
    async with aiohttp.ClientSession() as s:
        async with s.post(gateway.url + "/v1/chat/completions", data=body,
                          headers={"Authorization": f"Bearer {USER_KEY}", "Content-Type": "application/json",
                                   "x-request-id": "req-123", "traceparent": TRACEPARENT}) as r:
            assert r.status == 200
            assert r.headers["x-request-id"] == "req-123"
            assert r.headers["x-shapegate-backend"] == "vllm-a"
    assert engines[0].knobs.seen[-1] == {"model": "m2", "messages": [{"role": "user", "content": "x"}],
                                         "max_tokens": 2, "weird": {"a": [1, 2]}}
    h = engines[0].knobs.headers_seen[-1]
    assert h["x-request-id"] == "req-123" and h["traceparent"] == TRACEPARENT
    assert "Authorization" not in h  # the client's gateway key never reaches an engine


async def test_stream_relays_chunks_and_strips_unrequested_usage(gateway, engines, c):
    for _ in range(2):  # both backends
        stream = await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True)
        chunks = [ch async for ch in stream]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == "w0 w1 w2 w3 w4 w5 "
        assert all(ch.model == "m1" for ch in chunks)
        assert all(ch.choices for ch in chunks), "usage chunk leaked to a client that did not ask"
    # The gateway asked upstream for usage on its own account.
    assert all(b["stream_options"]["include_usage"] is True for e in engines for b in e.knobs.seen)


async def test_stream_keeps_usage_when_client_asks(gateway, c):
    stream = await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=3, stream=True, stream_options={"include_usage": True})
    chunks = [ch async for ch in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


async def test_completions_stream_and_not(gateway, c):
    r = await c.completions.create(model="m1", prompt="once upon", max_tokens=3)
    assert r.choices[0].text == "w0 w1 w2" and r.model == "m1"
    stream = await c.completions.create(model="m1", prompt="once upon", max_tokens=3, stream=True)
    text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
    assert text == "w0 w1 w2 "


async def test_llamacpp_gets_max_tokens_for_max_completion_tokens(gateway, engines, c):
    for _ in range(2):
        await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "a"}],
                                        max_completion_tokens=4)
    llama_bodies = engines[1].knobs.seen
    assert llama_bodies and all(b["max_tokens"] == 4 for b in llama_bodies)


async def test_models_list_and_embeddings(gateway, c):
    models = await c.models.list()
    assert sorted(m.id for m in models.data) == ["m1", "m2"]
    e = await c.embeddings.create(model="m2", input="abc")
    assert e.data[0].embedding == [0.1, 0.2, 0.3]


async def test_health_and_ready(gateway, c):
    async with aiohttp.ClientSession() as s:
        async with s.get(gateway.url + "/healthz") as r:
            assert r.status == 200
        async with s.get(gateway.url + "/readyz") as r:
            assert r.status == 200 and (await r.json())["ready"] is True


async def test_llamacpp_stream_without_done_gets_done(engines, gateway, c):
    for e in engines:
        e.knobs.done = False
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(gateway.url + "/v1/chat/completions", json={
                    "model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True},
                    headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                body = await r.read()
            assert body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("header", ["Authorization", "x-api-key"])
async def test_both_key_headers_accepted(gateway, header, c):
    value = f"Bearer {USER_KEY}" if header == "Authorization" else USER_KEY
    async with aiohttp.ClientSession() as s:
        async with s.get(gateway.url + "/v1/models", headers={header: value}) as r:
            assert r.status == 200
