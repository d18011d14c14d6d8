"""The real engines under load: metrics families, llama.cpp slots/props, queueing past capacity, client disconnects."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest

from tests.e2e import wire
from tests.e2e.engines import EngineHandle
from tests.e2e.quirks import QUIRKS

pytestmark = pytest.mark.e2e

# A first stream line later than this: the engine's API server sat on the stream (an engine stall, not the case under
# test); such an attempt goes again, up to STREAM_TRIES in all.
STALLED_S = 3.0
STREAM_TRIES = 4
LLAMA_FAMILIES = {
    "llamacpp:prompt_tokens": "counter",
    "llamacpp:prompt_tokens_cached": "counter",
    "llamacpp:prompt_seconds": "counter",
    "llamacpp:tokens_predicted": "counter",
    "llamacpp:tokens_predicted_seconds": "counter",
    "llamacpp:n_decode": "counter",
    "llamacpp:n_tokens_max": "counter",
    "llamacpp:spec_decode_num_draft_tokens": "counter",
    "llamacpp:spec_decode_num_accepted_tokens": "counter",
    "llamacpp:spec_decode_num_drafts": "counter",
    "llamacpp:prompt_tokens_seconds": "gauge",
    "llamacpp:predicted_tokens_seconds": "gauge",
    "llamacpp:requests_processing": "gauge",
    "llamacpp:requests_deferred": "gauge",
    "llamacpp:n_busy_slots_per_decode": "gauge",  # declared gauge in this build
}
VLLM_REQUIRED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}


async def test_metrics_families(engine: EngineHandle) -> None:
    q = QUIRKS[engine.engine]
    async with wire.new_session() as http:
        # one request first, so counters and histograms have samples
        await wire.post(http, engine.url + "/v1/chat/completions", wire.chat_body(engine.model))
        families = await wire.metric_families(http, engine.url)
    ours = {name: f.type for name, f in families.items() if name.startswith(q.metric_prefix)}
    if engine.engine == "llamacpp":
        assert ours == LLAMA_FAMILIES and set(families) == set(ours)  # nothing else, no labels
        assert all(not s.labels for f in families.values() for s in f.samples)
    else:
        assert {n: ours.get(n) for n in VLLM_REQUIRED} == VLLM_REQUIRED
        assert len(families) >= 80
        ttft = families["vllm:time_to_first_token_seconds"]
        assert {s.labels.get("model_name") for s in ttft.samples} == {engine.model}
        assert wire.sample_value(families, "vllm:time_to_first_token_seconds",
                                 "vllm:time_to_first_token_seconds_count") >= 1
    assert ("histogram" in ours.values()) == q.has_histograms


async def test_llama_props_and_slots(llama_server: EngineHandle) -> None:
    async with wire.new_session() as http:
        props = (await wire.get(http, llama_server.url + "/props")).json()
        slots = await wire.get(http, llama_server.url + "/slots")
        no_slot = await wire.get(http, llama_server.url + "/slots?fail_on_no_slot=1")
        models = (await wire.get(http, llama_server.url + "/v1/models")).json()
    assert props["total_slots"] == 2
    assert props["default_generation_settings"]["n_ctx"] == 2048  # -c 4096 split over --parallel 2
    assert props["model_alias"] == llama_server.model
    assert props["build_info"].startswith("b11434")
    assert props["endpoint_metrics"] is True and props["endpoint_slots"] is True
    assert (props["bos_token"], props["eos_token"]) == ("<|endoftext|>", "<|im_end|>")
    assert slots.status == 200
    assert [(s["id"], s["n_ctx"], s["is_processing"]) for s in slots.json()] == [(0, 2048, False), (1, 2048, False)]
    assert no_slot.status == 200  # idle slots exist, so the admission probe passes
    assert models["data"][0]["id"] == llama_server.model
    assert models["data"][0]["meta"]["n_ctx_train"] == 4096


async def _busy_slots(http: aiohttp.ClientSession, url: str) -> int:
    return sum(s["is_processing"] for s in (await wire.get(http, url + "/slots")).json())


async def test_llama_disconnect_frees_slot(llama_server: EngineHandle) -> None:
    url = llama_server.url
    body = wire.chat_body(llama_server.model, stream=True, max_tokens=2000)
    async with wire.new_session() as http:
        before = wire.sample_value(await wire.metric_families(http, url), "llamacpp:tokens_predicted",
                                   "llamacpp:tokens_predicted_total")
        async with wire.new_session() as client:
            resp = await client.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                                     headers={"content-type": "application/json"})
            for _ in range(4):
                await resp.content.readline()
            assert await _busy_slots(http, url) == 1
            resp.close()  # drop the connection mid-stream
        dropped = time.monotonic()
        while await _busy_slots(http, url) and time.monotonic() - dropped < 5.0:
            await asyncio.sleep(0.01)
        freed_after = time.monotonic() - dropped
        after = wire.sample_value(await wire.metric_families(http, url), "llamacpp:tokens_predicted",
                                  "llamacpp:tokens_predicted_total")
    assert freed_after < 2.0, f"slot still busy {freed_after:.2f} s after the client left"
    # the generation was cancelled, not run to its 2,000 tokens
    assert 0 < after - before < 2000


async def test_vllm_disconnect_aborts_request(vllm_server: EngineHandle) -> None:
    url = vllm_server.url
    body = wire.chat_body(vllm_server.model, stream=True, max_tokens=3000)  # ~5-10 s if left running
    stalls: list[float] = []
    async with wire.new_session() as http:
        for _ in range(STREAM_TRIES):
            await wire.wait_quiet(http, url, QUIRKS["vllm"].running_gauge)
            before = await wire.metric_families(http, url)
            sent = time.monotonic()
            async with wire.new_session() as client:
                resp = await client.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                                         headers={"content-type": "application/json"})
                await resp.content.readline()
                first_line = time.monotonic() - sent
                resp.close()
            dropped = time.monotonic()
            while time.monotonic() - dropped < 5.0:
                after = await wire.metric_families(http, url)
                if wire.sample_value(after, "vllm:num_requests_running") == 0:
                    break
                await asyncio.sleep(0.05)
            stopped_after = time.monotonic() - dropped
            # On 2 cores vLLM's API server sometimes sends nothing until its engine core has generated the whole
            # request: the client then leaves after the end, and the attempt says nothing about disconnects.
            if first_line < STALLED_S:
                break
            stalls.append(round(first_line, 1))
        else:
            pytest.fail(f"vLLM's API server held back the stream on every attempt (first line after {stalls} s)")

    def aborted(fams: dict[str, Any]) -> float:
        return sum(s.value for s in fams["vllm:request_success"].samples
                   if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort")

    def generated(fams: dict[str, Any]) -> float:
        return wire.sample_value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total")

    assert stopped_after < 2.0, f"vLLM still running the request {stopped_after:.2f} s after the client left"
    assert generated(after) - generated(before) < 3000
    # an aborted request is counted nowhere: not as finished_reason="abort", not in the latency histograms
    assert aborted(after) == aborted(before)


# Real engines on a shared 2-core machine: a scrape can miss the short window in which the queue
# exists, so a miss is tried again rather than taken as a verdict.
@pytest.mark.flaky(reruns=2)
async def test_queueing_beyond_capacity(engine: EngineHandle) -> None:
    """Four streams on two slots / max-num-seqs 2: the extra two wait silently, nobody is rejected."""
    q = QUIRKS[engine.engine]
    # llama.cpp is fast here (~4,000 tok/s): its streams must last long enough for a scrape to see
    # the queue even on a loaded machine, within the 2,048-token slot context.
    max_tokens = 1800 if engine.engine == "llamacpp" else 2500
    statuses, results, peak, health, informative = await _four_streams(engine, q, max_tokens)
    # nobody was turned away: every answer so far is 200, the others were still waiting
    assert [r for r in results if isinstance(r, Exception)] == []  # cut short is a CancelledError
    assert statuses and set(statuses) == {200}
    assert health <= {200}
    assert informative, f"no /metrics scrape saw the engine holding three or more of the four requests: {peak}"
    assert (peak[0], peak[1] >= 1) == (2, True), peak


async def _four_streams(engine: EngineHandle, q, max_tokens: int):
    """Four streams at once, scraping /metrics until the queue shows or they end. `informative`: some
    scrape saw the engine holding three or more requests (running + waiting), so the queue existed."""
    statuses: list[int] = []
    async with wire.new_session() as http:
        await wire.wait_quiet(http, engine.url, q.running_gauge)

        async def one() -> None:
            body = wire.chat_body(engine.model, stream=True, max_tokens=max_tokens, ignore_eos=True)
            async with http.post(engine.url + "/v1/chat/completions", data=orjson.dumps(body),
                                 headers={"content-type": "application/json"}) as resp:
                statuses.append(resp.status)
                async for _ in resp.content:
                    pass

        tasks = [asyncio.create_task(one()) for _ in range(4)]
        peak_running = peak_waiting = 0.0
        informative = False
        health: set[int] = set()
        try:
            # until the queue was seen (then the streams are cut short) or every stream ended
            while not all(t.done() for t in tasks) and not (peak_running == 2 and peak_waiting >= 1):
                fams = await wire.metric_families(http, engine.url)
                running, waiting = wire.sample_value(fams, q.running_gauge), wire.sample_value(fams, q.waiting_gauge)
                informative = informative or running + waiting >= 3
                peak_running, peak_waiting = max(peak_running, running), max(peak_waiting, waiting)
                health.add((await wire.get(http, engine.url + "/health")).status)
                await asyncio.sleep(0.02)
        finally:
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
    return statuses, results, (peak_running, peak_waiting), health, informative
