"""Fault knobs: injected errors, hangs, dropped connections, mid-stream errors, slow start, unhealthy."""

import asyncio
import time

import aiohttp
import pytest

from gateway.sim.faults import FaultSpec
from tests.sim.support import chat_body, read_sse

ENGINES = ["vllm", "sglang", "llamacpp"]


def error_message(engine: str, body: dict) -> str:
    return body["message"] if engine == "sglang" else body["error"]["message"]


@pytest.mark.parametrize("engine", ENGINES)
async def test_error_rate_with_status_and_retry_after(sim, http, engine):
    server = await sim(engine, faults=FaultSpec(error_rate=1.0, error_status=503, retry_after_s=2))
    async with http.post(server.url + "/v1/chat/completions", json=chat_body()) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "2"
        body = await resp.json()
    assert "Simulated fault" in error_message(engine, body)
    code = body["code"] if engine == "sglang" else body["error"]["code"]
    assert code == 503
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200  # errors hit inference routes only


async def test_error_next_fails_exactly_n_requests(sim, http):
    server = await sim("vllm")
    async with http.post(server.url + "/sim/faults", json={"error_next": 2}) as resp:
        assert (await resp.json())["error_next"] == 2
    statuses = []
    for _ in range(3):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as resp:
            statuses.append(resp.status)
    assert statuses == [500, 500, 200]


async def test_partial_error_rate_is_seeded(sim, http):
    runs = []
    for _ in range(2):
        server = await sim("vllm", seed=3, faults=FaultSpec(error_rate=0.5))
        statuses = []
        for _ in range(12):
            async with http.post(server.url + "/v1/completions",
                                 json={"prompt": "x", "max_tokens": 1}) as resp:
                statuses.append(resp.status)
        runs.append(statuses)
    assert runs[0] == runs[1] and {200, 500} == set(runs[0])


async def test_hang_before_first_byte(sim, http):
    server = await sim("sglang", faults=FaultSpec(hang_s=-1))
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(server.url + "/v1/chat/completions", json=chat_body(),
                             timeout=aiohttp.ClientTimeout(total=0.3)):
            pass
    server.set_faults(hang_s=0.3)
    start = time.perf_counter()
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=2)) as resp:
        assert resp.status == 200
    assert time.perf_counter() - start >= 0.3


@pytest.mark.parametrize("engine", ENGINES)
async def test_drop_connection_after_n_chunks(sim, http, engine):
    server = await sim(engine, faults=FaultSpec(drop_after_chunks=3))
    events = []
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(server.url + "/v1/chat/completions",
                             json=chat_body(max_tokens=20, stream=True)) as resp:
            async for line in resp.content:
                if line.startswith(b"data: "):
                    events.append(line)
    assert len(events) == 3
    await asyncio.sleep(0.05)
    assert not server.state.sched.running  # the dropped request was aborted


@pytest.mark.parametrize("engine,done", [("vllm", True), ("sglang", True), ("llamacpp", False)])
async def test_mid_stream_error_event(sim, http, engine, done):
    server = await sim(engine, faults=FaultSpec(error_after_chunks=2))
    async with http.post(server.url + "/v1/chat/completions",
                         json=chat_body(max_tokens=20, stream=True)) as resp:
        assert resp.status == 200
        events = await read_sse(resp)
    error = events[2]["error"]
    assert error["code"] == 500
    if engine == "sglang":
        assert error["object"] == "error"
    assert (events[-1] == "[DONE]") is done
    assert len(events) == (4 if done else 3)


async def test_slow_start_adds_to_ttft(sim, http):
    server = await sim("vllm")
    server.set_faults(slow_start_s=0.25)
    start = time.perf_counter()
    async with http.post(server.url + "/v1/chat/completions",
                         json=chat_body(max_tokens=2, stream=True)) as resp:
        async for line in resp.content:
            if b'"content":"' in line and b'"content":""' not in line:
                break
    assert 0.25 <= time.perf_counter() - start < 1.0


async def test_unhealthy_fails_health_the_engine_way(sim, http):
    for engine in ENGINES:
        server = await sim(engine, faults=FaultSpec(unhealthy=True))
        async with http.get(server.url + "/health") as resp:
            assert resp.status == 503
            body = await resp.read()
        if engine == "llamacpp":
            assert b"unavailable_error" in body
        else:
            assert body == b""
        if engine == "sglang":
            async with http.get(server.url + "/ping") as resp:
                assert resp.status == 200


async def test_admin_route_get_update_validate_reset(sim, http):
    server = await sim("llamacpp")
    url = server.url + "/sim/faults"
    async with http.get(url) as resp:
        assert await resp.json() == FaultSpec().model_dump()
    async with http.post(url, json={"error_rate": 0.5, "unhealthy": True}) as resp:
        spec = await resp.json()
    assert spec["error_rate"] == 0.5 and spec["unhealthy"] is True
    async with http.post(url, json={"drop_after_chunks": 4}) as resp:
        spec = await resp.json()
    assert spec["error_rate"] == 0.5 and spec["drop_after_chunks"] == 4  # merged
    for bad in ({"error_rate": 2}, {"no_such_knob": 1}, {"unhealthy": "yes"}, [1]):
        async with http.post(url, json=bad) as resp:
            assert resp.status == 400, bad
    async with http.post(url, json={"reset": True, "slow_start_s": 0.1}) as resp:
        assert (await resp.json())["error_rate"] == 0.0
    async with http.delete(url) as resp:
        assert await resp.json() == FaultSpec().model_dump()
    server.set_faults(unhealthy=True)
    async with http.post(url + "/reset") as resp:
        assert (await resp.json())["unhealthy"] is False
