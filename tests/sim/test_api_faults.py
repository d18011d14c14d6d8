"""Fault knobs on the Responses, Messages and transcription routes: injected errors, drops, mid-stream errors."""

import asyncio

import aiohttp
import pytest

from gateway.sim.faults import FaultSpec
from tests.sim.support import read_events

RESPONSES = {"model": "sim-model", "input": "hi", "stream": True, "max_output_tokens": 20}
MESSAGES = {"model": "sim-model", "max_tokens": 20, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}


async def test_injected_errors_in_each_api_shape(sim, http):
    server = await sim("vllm", faults=FaultSpec(error_rate=1.0, error_status=503, retry_after_s=3),
                       serves=frozenset({"transcriptions"}))
    async with http.post(server.url + "/v1/messages", json=MESSAGES) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "3"
        body = await resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "ServiceUnavailableError"
    async with http.post(server.url + "/v1/responses", json=RESPONSES) as resp:
        assert resp.status == 503 and (await resp.json())["error"]["code"] == 503
    data = aiohttp.FormData()
    data.add_field("file", b"\0" * 1000, filename="a.wav")
    data.add_field("model", "sim-model")
    async with http.post(server.url + "/v1/audio/transcriptions", data=data) as resp:
        assert resp.status == 503
    server.reset_faults()
    async with http.post(server.url + "/v1/messages", json={**MESSAGES, "stream": False}) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("engine,path,body", [("vllm", "/v1/responses", RESPONSES),
                                              ("llamacpp", "/v1/responses", RESPONSES),
                                              ("sglang", "/v1/responses", RESPONSES),
                                              ("vllm", "/v1/messages", MESSAGES),
                                              ("llamacpp", "/v1/messages", MESSAGES)])
async def test_drop_after_n_events_aborts_the_request(sim, http, engine, path, body):
    server = await sim(engine, faults=FaultSpec(drop_after_chunks=4))
    seen = 0
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(server.url + path, json=body) as resp:
            async for line in resp.content:
                seen += line.startswith(b"data: ")
    assert seen == 4
    await asyncio.sleep(0.05)
    assert not server.state.sched.running


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp"])
async def test_mid_stream_error_in_a_responses_stream(sim, http, engine):
    server = await sim(engine, faults=FaultSpec(error_after_chunks=3))
    async with http.post(server.url + "/v1/responses", json=RESPONSES) as resp:
        assert resp.status == 200
        events = await read_events(resp)
    assert len(events) == 4
    name, data = events[-1]
    if engine == "llamacpp":
        assert name is None and data["error"]["type"] == "server_error"
    else:
        assert name == "error" and data["type"] == "error" and data["sequence_number"] == 3
        assert "Simulated" in data["message"]


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
async def test_mid_stream_error_in_a_messages_stream(sim, http, engine):
    server = await sim(engine, faults=FaultSpec(error_after_chunks=2))
    async with http.post(server.url + "/v1/messages", json=MESSAGES) as resp:
        events = await read_events(resp)
    assert [name for name, _ in events] == ["message_start", "content_block_start", "error"]
    error = events[-1][1]
    if engine == "vllm":
        assert error == {"type": "error", "error": {"type": "internal_error",
                                                    "message": "Simulated mid-stream engine error"}}
    else:
        assert error["code"] == 500 and error["type"] == "server_error"
