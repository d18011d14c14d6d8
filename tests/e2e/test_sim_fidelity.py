"""The simulator's llama.cpp and vLLM flavours against what the real engines were seen to do (quirks.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from benchmarks.loopback import free_port
from gateway.sim.runner import SimServer, start_sim
from tests.e2e import wire
from tests.e2e.quirks import QUIRKS, check_connection_after_reply
from tests.e2e.targets import sim_options
from tests.e2e.test_engines_runtime import LLAMA_FAMILIES, VLLM_REQUIRED

pytestmark = pytest.mark.e2e

CTX = {"llamacpp": 2048, "vllm": 4096}  # per slot for llama.cpp, like the real `-c 4096 --parallel 2`
# sim prompt words (about a token each in the simulator's vocabulary) that leave ~100 tokens of room
NEAR_FULL_WORDS = {"llamacpp": 1900, "vllm": 3950}


@pytest.fixture(params=sorted(QUIRKS))
async def sim(request: pytest.FixtureRequest) -> AsyncIterator[SimServer]:
    server = await start_sim(sim_options(request.param))
    yield server
    await server.close()


async def _post(sim: SimServer, body: dict[str, Any], path: str = "/v1/chat/completions") -> wire.Reply:
    async with wire.new_session() as http:
        return await wire.post(http, sim.url + path, body)


async def _stream(sim: SimServer, **extra: Any) -> wire.Stream:
    reply = await _post(sim, wire.chat_body(sim.model, stream=True, ignore_eos=True, **extra))
    assert reply.status == 200
    return wire.parse_sse(reply.body)


@pytest.mark.parametrize("sim_engine", sorted(QUIRKS))
async def test_startup(sim_engine: str) -> None:
    q = QUIRKS[sim_engine]
    server = await start_sim(sim_options(sim_engine, port=free_port(), warmup_s=0.3))
    try:
        async with wire.new_session() as http:
            if q.loading_503:
                loading = await wire.get(http, server.url + "/health")
                assert loading.status == 503 and loading.json()["error"]["message"] == "Loading model"
            else:
                with pytest.raises(aiohttp.ClientConnectorError):
                    await wire.get(http, server.url + "/health")
            await server.wait_ready(timeout=5)
            ready = await wire.get(http, server.url + "/health")
        assert ready.status == 200 and ready.body == q.health_ok_body
    finally:
        await server.close()


async def test_chat_stream_layout(sim: SimServer) -> None:
    q = QUIRKS[sim.engine]
    s = await _stream(sim, max_tokens=8)
    assert s.done and not s.other
    assert s.events[0]["choices"][0]["delta"] == q.first_chat_delta
    last = s.events[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert (last["choices"][0]["delta"] == {}) == q.finish_in_empty_delta
    assert ("timings" in last) == q.timings_on_last_chunk
    assert not any("usage" in e for e in s.events)
    if sim.engine == "vllm":
        assert last["system_fingerprint"].startswith(q.fingerprint_prefix)


USAGE_CASES = {
    "empty": ({}, lambda q: q.usage_with_empty_stream_options),
    "continuous-alone": ({"continuous_usage_stats": True}, lambda q: q.continuous_usage_alone_sends_usage),
    "include": ({"include_usage": True}, lambda q: True),
}


@pytest.mark.parametrize("case", sorted(USAGE_CASES))
async def test_stream_usage(sim: SimServer, case: str) -> None:
    q = QUIRKS[sim.engine]
    options, expected = USAGE_CASES[case]
    s = await _stream(sim, max_tokens=8, stream_options=options)
    with_usage = [e for e in s.events if "usage" in e]
    assert bool(with_usage) == expected(q)
    if with_usage:
        assert with_usage == [s.events[-1]] and s.events[-1]["choices"] == []
        assert ("timings" in s.events[-1]) == q.timings_on_last_chunk


async def test_completions(sim: SimServer) -> None:
    q = QUIRKS[sim.engine]
    plain = await _post(sim, wire.completion_body(sim.model, ignore_eos=True), "/v1/completions")
    assert plain.json()["id"].startswith(q.completion_id_prefix)
    for options in (None, {"include_usage": True}):
        extra = {} if options is None else {"stream_options": options}
        reply = await _post(sim, wire.completion_body(sim.model, stream=True, ignore_eos=True, **extra),
                            "/v1/completions")
        s = wire.parse_sse(reply.body)
        assert s.done and "text" in s.events[0]["choices"][0]
        finish = [e for e in s.events if e["choices"]][-1]
        assert finish["choices"][0]["finish_reason"] == "length"
        assert (finish["choices"][0]["text"] == "") == q.finish_in_empty_delta
        # llama.cpp: usage on the finish chunk, asked for or not; vLLM: a separate chunk, when asked
        assert ("usage" in finish) == q.completions_stream_usage_by_default
        if options is None:
            assert any("usage" in e for e in s.events) == q.completions_stream_usage_by_default
        else:
            assert "usage" in s.events[-1]


async def test_stream_options_without_stream(sim: SimServer) -> None:
    reply = await _post(sim, wire.chat_body(sim.model, stream_options={"include_usage": True}))
    assert reply.status == QUIRKS[sim.engine].stream_options_without_stream_status


async def test_unknown_model(sim: SimServer) -> None:
    q = QUIRKS[sim.engine]
    reply = await _post(sim, wire.chat_body("no-such-model"))
    assert reply.status == q.unknown_model_status
    if q.unknown_model_error_type is None:
        assert reply.json()["model"] == sim.model  # the alias, not the name asked for
    else:
        assert (reply.json()["error"]["type"], reply.json()["error"]["param"]) == (q.unknown_model_error_type, "model")


@pytest.mark.parametrize("stream", [False, True])
async def test_overlong_prompt(sim: SimServer, stream: bool) -> None:
    q = QUIRKS[sim.engine]
    reply = await _post(sim, wire.chat_body(sim.model, content=wire.overlong_text(), stream=stream))
    assert reply.status == 400 and reply.content_type.startswith("application/json")
    error = reply.json()["error"]
    assert error["type"] == q.overlong_error_type and error.get("param") == q.overlong_param
    if q.overlong_param is None:
        assert error["n_ctx"] == CTX[sim.engine] < error["n_prompt_tokens"]
    else:
        assert f"maximum context length is {CTX[sim.engine]} tokens" in error["message"]
        assert f"at least {CTX[sim.engine] + 1} input tokens" in error["message"]


async def test_max_tokens_past_the_context(sim: SimServer) -> None:
    body = wire.chat_body(sim.model, content=wire.overlong_text(NEAR_FULL_WORDS[sim.engine]), max_tokens=400,
                          ignore_eos=True)
    reply = await _post(sim, body)
    assert (reply.status == 200) == QUIRKS[sim.engine].max_tokens_capped_at_context, reply.body[:300]
    usage = reply.json()["usage"]
    assert usage["total_tokens"] == CTX[sim.engine] and usage["completion_tokens"] < 400
    assert reply.json()["choices"][0]["finish_reason"] == "length"


async def test_fingerprint(sim: SimServer) -> None:
    reply = await _post(sim, wire.chat_body(sim.model))
    assert reply.json()["system_fingerprint"].startswith(QUIRKS[sim.engine].fingerprint_prefix)


async def test_metrics(sim: SimServer) -> None:
    q = QUIRKS[sim.engine]
    await _post(sim, wire.chat_body(sim.model))
    async with wire.new_session() as http:
        families = await wire.metric_families(http, sim.url)
    ours = {name: f.type for name, f in families.items() if name.startswith(q.metric_prefix)}
    if sim.engine == "llamacpp":
        assert ours == LLAMA_FAMILIES and set(families) == set(ours)
    else:
        assert {n: ours.get(n) for n in VLLM_REQUIRED} == VLLM_REQUIRED
    assert ("histogram" in ours.values()) == q.has_histograms
    assert (families[q.running_gauge].type, families[q.waiting_gauge].type) == ("gauge", "gauge")


@pytest.mark.parametrize("stream", [False, True])
async def test_connection_after_reply(sim: SimServer, stream: bool) -> None:
    """llama-server closes the connection after a streamed reply, although its headers say Keep-Alive."""
    q = QUIRKS[sim.engine]
    head, closed = await wire.raw_exchange(sim.port, wire.chat_body(sim.model, stream=stream))
    check_connection_after_reply(q, head, closed, stream)
