"""llama.cpp flavour over real HTTP: Loading model, props/slots, timings, plain-JSON errors, metrics."""

import asyncio

import pytest

from tests.kit import until
from tests.sim.support import chat_body, read_sse, sample, scrape

LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


async def test_loading_model_503_on_nearly_every_route(sim, http):
    server = await sim("llamacpp", warmup_s=0.4)
    for method, route in (("GET", "/health"), ("GET", "/props"), ("GET", "/slots"),
                          ("GET", "/metrics"), ("POST", "/v1/chat/completions")):
        async with http.request(method, server.url + route, json=chat_body()) as resp:
            assert resp.status == 503, route
            assert await resp.json() == LOADING
    async with http.get(server.url + "/v1/models") as resp:
        assert resp.status == 200 and (await resp.json())["data"][0]["meta"] is None
    await server.wait_ready(timeout=5)
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200 and await resp.json() == {"status": "ok"}
    async with http.get(server.url + "/v1/models") as resp:
        meta = (await resp.json())["data"][0]["meta"]
    assert meta["n_ctx_train"] == 4096 and meta["n_params"] > 0


async def test_props_and_slots(sim, http):
    server = await sim("llamacpp", slots=2)
    async with http.get(server.url + "/props") as resp:
        props = await resp.json()
    assert props["total_slots"] == 2
    assert props["default_generation_settings"]["n_ctx"] == 4096  # -c 8192 split over 2 slots
    async with http.get(server.url + "/slots") as resp:
        slots = await resp.json()
    assert [s["id"] for s in slots] == [0, 1] and not any(s["is_processing"] for s in slots)
    async with http.get(server.url + "/slots?fail_on_no_slot=1") as resp:
        assert resp.status == 200


async def test_fail_on_no_slot_and_deferred_requests(sim, http):
    server = await sim("llamacpp", profile="r9700-llamacpp-vulkan", slots=1)
    body = chat_body(max_tokens=60, ignore_eos=True)
    tasks = [asyncio.create_task(http.post(server.url + "/v1/chat/completions", json=body))
             for _ in range(2)]
    async def no_slot() -> bool:
        async with http.get(server.url + "/slots?fail_on_no_slot=1") as resp:
            return resp.status == 503

    await until(no_slot)  # once the first request holds the only slot
    async with http.get(server.url + "/slots?fail_on_no_slot=1") as resp:
        assert resp.status == 503
        err = (await resp.json())["error"]
    assert err == {"code": 503, "message": "no slot available", "type": "unavailable_error"}
    async with http.get(server.url + "/slots") as resp:
        (slot,) = await resp.json()
    assert slot["is_processing"] and slot["next_token"][0]["n_decoded"] > 0
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200  # busy is not unhealthy
    fam = await scrape(http, server.url)
    assert sample(fam, "llamacpp:requests_processing") == 1
    assert sample(fam, "llamacpp:requests_deferred") == 1
    for task in tasks:
        (await task).release()


async def test_any_model_name_is_accepted_and_answered_with_the_alias(sim, http):
    server = await sim("llamacpp")
    async with http.post(server.url + "/v1/chat/completions",
                         json=chat_body(model="whatever.gguf", max_tokens=2)) as resp:
        assert resp.status == 200 and (await resp.json())["model"] == "sim-model"


async def test_stream_role_chunk_null_content_finish_chunk_and_timings(sim, http):
    server = await sim("llamacpp")
    async with http.post(server.url + "/v1/chat/completions",
                         json=chat_body(max_tokens=5, stream=True)) as resp:
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    finish = chunks[-1]
    assert finish["choices"][0] == {"finish_reason": "length", "index": 0, "delta": {}}
    assert finish["timings"]["predicted_n"] == 5
    assert all("timings" not in c for c in chunks[:-1])
    body = chat_body(max_tokens=5, stream=True, stream_options={"include_usage": True})
    async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
        events = await read_sse(resp)
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert "timings" in usage and "timings" not in events[-3]


@pytest.mark.parametrize("stream", [False, True])
async def test_context_too_long_is_plain_json_even_when_streaming(sim, http, stream):
    server = await sim("llamacpp", max_model_len=64)
    async with http.post(server.url + "/v1/chat/completions",
                         json=chat_body("word " * 100, stream=stream)) as resp:
        assert resp.status == 400
        assert resp.headers["Content-Type"].startswith("application/json")
        err = (await resp.json())["error"]
    assert err["type"] == "exceed_context_size_error" and err["code"] == 400
    assert err["n_ctx"] == 64 and err["n_prompt_tokens"] > 64
    assert "param" not in err


async def test_max_tokens_and_n_predict(sim, http):
    server = await sim("llamacpp")
    for extra, expected in (({"max_tokens": 3}, 3), ({"n_predict": 4}, 4)):
        async with http.post(server.url + "/v1/chat/completions",
                             json=chat_body(**extra)) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == expected


async def test_slot_prompt_cache_shows_in_timings(sim, http):
    server = await sim("llamacpp")
    body = chat_body("a conversation that continues " * 5, max_tokens=3)
    timings = []
    for _ in range(2):
        async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
            reply = await resp.json()
        timings.append(reply["timings"])
    n = reply["usage"]["prompt_tokens"]
    assert timings[0]["cache_n"] == 0 and timings[0]["prompt_n"] == n
    assert timings[1]["cache_n"] == n - 1 and timings[1]["prompt_n"] == 1
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert reply["system_fingerprint"]


async def test_metrics_have_llamacpp_names_and_no_labels(sim, http):
    server = await sim("llamacpp")
    async with http.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}) as resp:
        assert resp.status == 200
    async with http.get(server.url + "/metrics") as resp:
        assert resp.headers["Process-Start-Time-Unix"]
    fam = await scrape(http, server.url)
    assert all(n.startswith("llamacpp:") for n in fam)
    assert all(not s.labels for f in fam.values() for s in f.samples)
    assert not any(f.type == "histogram" for f in fam.values())
    for name in ("llamacpp:requests_processing", "llamacpp:requests_deferred",
                 "llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds"):
        assert fam[name].type == "gauge", name
    assert sample(fam, "llamacpp:tokens_predicted") == 3
    assert sample(fam, "llamacpp:prompt_tokens") > 0
    assert sample(fam, "llamacpp:n_decode") >= 3
    # The throughput gauges cover the time since the previous scrape, which this one reset.
    again = await scrape(http, server.url)
    assert sample(again, "llamacpp:predicted_tokens_seconds") == 0
