"""SGLang flavour over real HTTP: starting window, flat errors, in-band context error, loads, metrics."""

import asyncio

import pytest

from gateway.sim.tokens import EOS_ID
from tests.kit import until
from tests.sim.support import chat_body, read_sse, sample, scrape


async def test_starting_window_health_503_ping_200_then_ready(sim, http):
    server = await sim("sglang", warmup_s=0.4)
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 503
    async with http.get(server.url + "/ping") as resp:
        assert resp.status == 200
    # A request sent while starting is held and served once the engine is up.
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=2)) as resp:
        assert resp.status == 200
    assert server.state.ready.is_set()
    for route in ("/health", "/health_generate"):
        async with http.get(server.url + route) as resp:
            assert resp.status == 200
    # The idle-engine probe ran a one-token generation that is not counted as traffic.
    fam = await scrape(http, server.url)
    assert sample(fam, "sglang:num_requests", model_name="sim-model") == 1


async def test_models_and_model_by_name(sim, http):
    server = await sim("sglang")
    async with http.get(server.url + "/v1/models") as resp:
        (card,) = (await resp.json())["data"]
    assert card["id"] == "sim-model" and card["max_model_len"] == 4096
    async with http.get(server.url + "/v1/models/sim-model") as resp:
        assert (await resp.json())["id"] == "sim-model"
    async with http.get(server.url + "/v1/models/other") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
    async with http.get(server.url + "/model_info") as resp:
        assert (await resp.json())["is_generation"] is True


async def test_unknown_model_is_flat_404(sim, http):
    server = await sim("sglang")
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(model="nope")) as resp:
        assert resp.status == 404
        body = await resp.json()
    assert body["object"] == "error" and body["code"] == 404 and "error" not in body


async def test_context_too_long_flat_400_or_in_band_when_streamed(sim, http):
    server = await sim("sglang", max_model_len=64)
    long_prompt = chat_body("word " * 200)
    async with http.post(server.url + "/v1/chat/completions", json=long_prompt) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["object"] == "error" and body["code"] == 400
    assert "is longer than the model's context length (64 tokens)" in body["message"]
    async with http.post(server.url + "/v1/chat/completions", json={**long_prompt, "stream": True}) as resp:
        assert resp.status == 200  # the stream opened before validation
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    err = events[0]["error"]
    assert err["object"] == "error" and err["code"] == 400
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=60)) as resp:
        assert resp.status == 400
        assert "Requested token count exceeds" in (await resp.json())["message"]


async def test_stream_separate_finish_chunk_with_matched_stop(sim, http):
    server = await sim("sglang")
    async with http.post(server.url + "/v1/chat/completions",
                         json=chat_body(stream=True, max_tokens=1000)) as resp:
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = chunks[-1]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "stop"
    assert finish["matched_stop"] == EOS_ID  # natural end: the EOS token id
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert not any(c.get("usage") for c in chunks)  # include_usage defaults to false


async def test_usage_chunk_only_when_asked(sim, http):
    server = await sim("sglang")
    body = chat_body(stream=True, max_tokens=3, stream_options={"include_usage": True})
    async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
        events = await read_sse(resp)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3
    assert events[-3]["choices"][0]["matched_stop"] is None  # ended by length
    body["stream_options"] = {}
    async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
        events = await read_sse(resp)
    assert not any(e.get("usage") for e in events[:-1])


async def test_radix_cache_reports_cached_tokens(sim, http):
    server = await sim("sglang", report_cached_tokens=True)
    prompt = "a long shared conversation prefix " * 10
    usages = []
    for suffix in ("one", "two"):
        async with http.post(server.url + "/v1/chat/completions",
                             json=chat_body(prompt + suffix, max_tokens=2)) as resp:
            usages.append((await resp.json())["usage"])
    assert usages[0]["prompt_tokens_details"] is None
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert usages[1]["prompt_tokens"] - 10 <= cached < usages[1]["prompt_tokens"]
    fam = await scrape(http, server.url)
    assert sample(fam, "sglang:cached_tokens", model_name="sim-model") == cached
    async with http.post(server.url + "/flush_cache") as resp:
        assert resp.status == 200
    async with http.post(server.url + "/v1/chat/completions",
                         json=chat_body(prompt + "two", max_tokens=2)) as resp:
        assert (await resp.json())["usage"]["prompt_tokens_details"] is None


async def test_loads_and_get_load_while_busy(sim, http):
    server = await sim("sglang", profile="mi350x-sglang")
    task = asyncio.create_task(http.post(server.url + "/v1/chat/completions",
                                         json=chat_body(max_tokens=200, ignore_eos=True)))
    async def running() -> bool:
        async with http.get(server.url + "/v1/loads") as resp:
            return (await resp.json())["loads"][0]["num_running_reqs"] == 1

    await until(running)
    async with http.get(server.url + "/v1/loads") as resp:
        loads = (await resp.json())["loads"]
    (rank,) = loads
    assert rank["dp_rank"] == 0 and rank["num_running_reqs"] == 1 and rank["num_waiting_reqs"] == 0
    assert rank["num_used_tokens"] > 0 and 0 < rank["token_usage"] < 1
    assert {"max_total_num_tokens", "cache_hit_rate", "gen_throughput",
            "max_running_requests", "num_total_tokens"} <= set(rank)
    async with http.get(server.url + "/get_load") as resp:
        (old,) = await resp.json()
    assert old["num_reqs"] == 1 and "num_waiting_reqs" in old
    (await task).release()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_metric_names(sim, http, route):
    server = await sim("sglang")
    body = chat_body(max_tokens=4) if "chat" in route else {"prompt": "hi", "max_tokens": 4}
    async with http.post(server.url + route, json=body) as resp:
        assert resp.status == 200
    fam = await scrape(http, server.url)
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:num_used_tokens", "sglang:gen_throughput"):
        assert fam[name].type == "gauge", name
    for name in ("sglang:prompt_tokens", "sglang:generation_tokens", "sglang:cached_tokens",
                 "sglang:num_requests", "sglang:num_aborted_requests"):
        assert fam[name].type == "counter", name
    for name in ("sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                 "sglang:e2e_request_latency_seconds", "sglang:queue_time_seconds"):
        assert fam[name].type == "histogram", name
    assert sample(fam, "sglang:generation_tokens", model_name="sim-model") == 4
    assert sample(fam, "sglang:inter_token_latency_seconds",
                  "sglang:inter_token_latency_seconds_count", model_name="sim-model") == 3
