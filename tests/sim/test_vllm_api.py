"""vLLM flavour over real HTTP: routes, readiness, errors, stream and usage quirks, metrics."""

import asyncio

import aiohttp
import pytest

from tests.kit import until
from tests.sim.support import chat_body, content_of, read_sse, sample, scrape


async def test_health_ping_version_and_load(sim, http):
    server = await sim("vllm")
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200 and await resp.read() == b""
    for method in ("GET", "POST"):
        async with http.request(method, server.url + "/ping") as resp:
            assert resp.status == 200
    async with http.get(server.url + "/version") as resp:
        assert "version" in await resp.json()
    async with http.get(server.url + "/load") as resp:
        assert await resp.json() == {"server_load": 0}


async def test_connection_refused_until_warm_then_health_ok(sim, http):
    server = await sim("vllm", warmup_s=0.4)
    with pytest.raises(aiohttp.ClientConnectorError):
        async with http.get(server.url + "/health"):
            pass
    await server.wait_ready(timeout=5)
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200 and await resp.read() == b""


async def test_models_list_every_served_name_with_max_model_len(sim, http):
    server = await sim("vllm", served_model_names=("alias-a",), max_model_len=2048)
    async with http.get(server.url + "/v1/models") as resp:
        data = (await resp.json())["data"]
    assert [m["id"] for m in data] == ["sim-model", "alias-a"]
    assert all(m["max_model_len"] == 2048 and m["owned_by"] == "vllm" for m in data)
    async with http.post(server.url + "/v1/chat/completions",
                         json=chat_body(model="alias-a", max_tokens=3)) as resp:
        assert resp.status == 200 and (await resp.json())["model"] == "alias-a"


async def test_unknown_model_is_404_not_found(sim, http):
    server = await sim("vllm")
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(model="nope")) as resp:
        assert resp.status == 404
        assert await resp.json() == {"error": {
            "message": "The model `nope` does not exist.", "type": "NotFoundError",
            "param": "model", "code": 404}}


async def test_chat_is_deterministic_and_honours_max_completion_tokens(sim, http):
    server = await sim("vllm")
    body = chat_body(max_tokens=50, max_completion_tokens=4, some_unknown_field={"x": 1})
    bodies = []
    for _ in range(2):
        async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            bodies.append(await resp.json())
    a, b = bodies
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["id"] != b["id"] and a["id"].startswith("chatcmpl-")
    assert a["object"] == "chat.completion"
    assert a["usage"]["completion_tokens"] == 4
    assert a["usage"]["total_tokens"] == a["usage"]["prompt_tokens"] + 4
    assert a["choices"][0]["finish_reason"] == "length" and a["choices"][0]["stop_reason"] is None


async def test_stream_chunks_follow_vllm(sim, http):
    server = await sim("vllm")
    async with http.post(server.url + "/v1/chat/completions",
                         json=chat_body(max_tokens=6, stream=True)) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in c for c in chunks)  # unset fields are absent, not null
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length" and "stop_reason" in last and last["delta"]["content"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


async def test_stream_options_need_include_usage(sim, http):
    server = await sim("vllm")
    for options in ({}, {"include_usage": False}, {"continuous_usage_stats": True}):
        body = chat_body(max_tokens=5, stream=True, stream_options=options)
        async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
            assert all("usage" not in e for e in (await read_sse(resp))[:-1]), options
    body = chat_body(max_tokens=5, stream=True, stream_options={"include_usage": True})
    async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
        events = await read_sse(resp)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 5
    assert events[-2]["system_fingerprint"].startswith("vllm-")
    body["stream_options"]["continuous_usage_stats"] = True
    async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
        events = (await read_sse(resp))[:-1]
    assert all("usage" in e for e in events)


async def test_stream_options_without_stream_is_400(sim, http):
    server = await sim("vllm")
    body = chat_body(stream_options={"include_usage": True})
    async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert "stream=True" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_context_too_long_is_400_before_any_stream(sim, http, stream):
    server = await sim("vllm", max_model_len=64)
    async with http.post(server.url + "/v1/chat/completions",
                         json=chat_body("word " * 200, stream=stream)) as resp:
        assert resp.status == 400
        assert resp.headers["Content-Type"].startswith("application/json")
        err = (await resp.json())["error"]
    assert err["param"] == "input_tokens" and "maximum context length is 64" in err["message"]
    # max_tokens past the context is capped at the room left, not refused
    async with http.post(server.url + "/v1/chat/completions",
                         json=chat_body(max_tokens=60, ignore_eos=True)) as resp:
        assert resp.status == 200
        usage = (await resp.json())["usage"]
    assert usage["total_tokens"] == 64 and usage["completion_tokens"] < 60


async def test_stop_string_sets_stop_reason(sim, http):
    server = await sim("vllm")
    async with http.post(server.url + "/v1/completions",
                         json={"prompt": "Once upon", "max_tokens": 30, "ignore_eos": True}) as resp:
        full = (await resp.json())["choices"][0]["text"]
    word = full.split()[4]
    async with http.post(server.url + "/v1/completions",
                         json={"prompt": "Once upon", "max_tokens": 30, "ignore_eos": True,
                               "stop": [word]}) as resp:
        choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == word
    assert word not in choice["text"] and full.startswith(choice["text"])


async def test_text_completion_stream(sim, http):
    server = await sim("vllm")
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(server.url + "/v1/completions", json=body) as resp:
        events = await read_sse(resp)
    assert events[0]["object"] == "text_completion" and events[0]["id"].startswith("cmpl-")
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 4
    async with http.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}) as resp:
        assert (await resp.json())["choices"][0]["text"] == content_of(events)


async def test_embeddings_are_deterministic(sim, http):
    server = await sim("vllm", serves=frozenset({"embeddings"}))
    body = {"model": "sim-model", "input": ["a", "b"]}
    async with http.post(server.url + "/v1/embeddings", json=body) as resp:
        first = await resp.json()
    async with http.post(server.url + "/v1/embeddings", json=body) as resp:
        assert await resp.json() == first
    assert [d["index"] for d in first["data"]] == [0, 1] and len(first["data"][0]["embedding"]) == 16


async def test_metrics_names_labels_and_prefix_cache(sim, http):
    server = await sim("vllm")
    prompt = "shared system prompt " * 20
    for _ in range(2):
        async with http.post(server.url + "/v1/chat/completions",
                             json=chat_body(prompt, max_tokens=3)) as resp:
            assert resp.status == 200
    fam = await scrape(http, server.url)
    lab = {"model_name": "sim-model", "engine": "0"}
    assert fam["vllm:num_requests_running"].type == "gauge"
    assert sample(fam, "vllm:num_requests_running", **lab) == 0
    assert sample(fam, "vllm:num_requests_waiting", **lab) == 0
    assert 0 <= sample(fam, "vllm:kv_cache_usage_perc", **lab) <= 1
    assert sample(fam, "vllm:generation_tokens", **lab) == 6
    queries = sample(fam, "vllm:prefix_cache_queries", **lab)
    hits = sample(fam, "vllm:prefix_cache_hits", **lab)
    assert queries == sample(fam, "vllm:prompt_tokens", **lab) and hits > 0.4 * queries
    assert hits % 16 == 0
    assert fam["vllm:time_to_first_token_seconds"].type == "histogram"
    assert sample(fam, "vllm:time_to_first_token_seconds",
                  "vllm:time_to_first_token_seconds_count", **lab) == 2
    assert sample(fam, "vllm:inter_token_latency_seconds",
                  "vllm:inter_token_latency_seconds_count", **lab) == 4
    assert sample(fam, "vllm:request_success", finished_reason="length", **lab) == 2


async def test_load_counts_in_flight_requests(sim, http):
    server = await sim("vllm", profile="mi350x-vllm")
    task = asyncio.create_task(http.post(server.url + "/v1/chat/completions",
                                         json=chat_body(max_tokens=100)))
    async def loaded() -> bool:
        async with http.get(server.url + "/load") as resp:
            return (await resp.json())["server_load"] == 1

    await until(loaded)
    (await task).release()


async def test_bad_bodies_are_400_in_vllm_shape(sim, http):
    server = await sim("vllm")
    url = server.url + "/v1/chat/completions"
    for data in (b"{not json", b"[1, 2]"):
        async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "BadRequestError"
    for body in (chat_body(n=2), chat_body(max_tokens=0), {"model": "sim-model", "messages": []}):
        async with http.post(url, json=body) as resp:
            assert resp.status == 400, body
