"""Every error a client can meet, as the right status, OpenAI shape and openai exception; disconnects and limits."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import USER_KEY, gateway_config, start_gateway

MSG = [{"role": "user", "content": "hi"}]


def oai(gw, key=USER_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def assert_openai_shape(body: dict) -> dict:
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


async def test_401_bad_or_missing_key(gateway):
    async with oai(gateway, "sk-wrong") as c:
        with pytest.raises(openai.AuthenticationError) as ei:
            await c.chat.completions.create(model="m1", messages=MSG)
    assert ei.value.status_code == 401
    assert ei.value.code == "invalid_api_key"
    assert ei.value.request_id
    async with aiohttp.ClientSession() as s:
        async with s.post(gateway.url + "/v1/chat/completions", json={"model": "m1", "messages": MSG}) as r:
            assert r.status == 401
            assert assert_openai_shape(await r.json())["type"] == "authentication_error"
        async with s.get(gateway.url + "/stats", headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
            assert r.status == 403, "a non-admin key cannot read admin routes"


async def test_400_malformed_json_and_missing_fields(gateway):
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {USER_KEY}"}) as s:
        async with s.post(gateway.url + "/v1/chat/completions", data=b"{not json",
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            assert assert_openai_shape(await r.json())["code"] == "invalid_json"
        async with s.post(gateway.url + "/v1/chat/completions", json=[1, 2]) as r:
            assert r.status == 400
    async with oai(gateway) as c:
        with pytest.raises(openai.BadRequestError) as ei:
            await c.chat.completions.create(model="m1", messages=[])
        assert ei.value.param == "messages"
        with pytest.raises(openai.BadRequestError) as ei:
            await c.completions.create(model="", prompt="x")
        assert ei.value.param == "model"
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model="m1", messages=MSG, extra_body={"stream": "yes"})


async def test_404_unknown_model(gateway):
    async with oai(gateway) as c:
        with pytest.raises(openai.NotFoundError) as ei:
            await c.chat.completions.create(model="nope", messages=MSG)
    assert ei.value.code == "model_not_found" and ei.value.param == "model"


async def test_404_unknown_route_is_openai_shaped(gateway):
    async with aiohttp.ClientSession() as s:
        async with s.get(gateway.url + "/v1/nothing", headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
            assert r.status == 404
            assert_openai_shape(await r.json())


async def test_404_names_the_path_it_likely_meant(gateway):
    """A base URL without /v1 (or with it twice, or a trailing slash): the 404 says where the API is."""
    cases = {
        ("POST", "/chat/completions"): "Unknown path /chat/completions; did you mean /v1/chat/completions?",
        ("GET", "/models"): "Unknown path /models; did you mean /v1/models?",
        ("POST", "/v1/v1/completions"): "Unknown path /v1/v1/completions; did you mean /v1/completions?",
        ("POST", "/v1/chat/completions/"): "Unknown path /v1/chat/completions/; did you mean /v1/chat/completions?",
        ("GET", "/nowhere"): "Unknown path /nowhere; the API is under /v1 (e.g. /v1/chat/completions, /v1/models).",
    }
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {USER_KEY}"}) as s:
        for (method, path), message in cases.items():
            async with s.request(method, gateway.url + path, json={"model": "m1", "messages": MSG}) as r:
                assert r.status == 404, path
                err = assert_openai_shape(await r.json())
                assert (err["message"], err["type"], err["code"]) == (message, "invalid_request_error", "not_found")
    # What an OpenAI SDK shows when its base_url lacks /v1.
    async with openai.AsyncOpenAI(base_url=gateway.url, api_key=USER_KEY, max_retries=0) as c:
        with pytest.raises(openai.NotFoundError) as ei:
            await c.chat.completions.create(model="m1", messages=MSG)
    assert "did you mean /v1/chat/completions?" in str(ei.value)


async def test_413_body_over_limit_refused_without_reading_it(engines):
    gw = await start_gateway(gateway_config([{"id": "a", "engine": "vllm", "url": engines[0].url,
                                              "models": ["m"]}], server={"max_body_bytes": 1024 * 1024}))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        size = 10 * 1024 * 1024
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {USER_KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n").encode() + b"{" * 65536)
        await writer.drain()
        # The answer comes while 99 % of the body is still unsent.
        status_line = await asyncio.wait_for(reader.readline(), 5)
        assert b" 413 " in status_line
        writer.close()
        # A chunked upload with no Content-Length is cut off at the limit too.
        async def body():
            for _ in range(160):
                yield b" " * 65536
        async with aiohttp.ClientSession() as s:
            try:
                async with s.post(gw.url + "/v1/chat/completions", data=body(),
                                  headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                    assert r.status == 413
                    assert_openai_shape(await r.json())
            except aiohttp.ClientOSError:
                pass  # the server may close before the client finished sending: also a refusal
        assert not engines[0].knobs.seen
    finally:
        await gw.stop()


async def test_503_with_retry_after_when_no_backend_usable():
    dead = await FakeEngine(Knobs(health_status=503)).start()
    gw = await start_gateway(gateway_config([{"id": "a", "engine": "llamacpp", "url": dead.url, "models": ["m"]}]),
                             wait_ready=False)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MSG},
                              headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                assert r.status == 503
                assert int(r.headers["Retry-After"]) <= 120
                assert assert_openai_shape(await r.json())["code"] == "no_backend_available"
            async with s.get(gw.url + "/readyz") as r:
                assert r.status == 503
    finally:
        await gw.stop()
        await dead.stop()


async def test_502_when_every_backend_fails_and_no_url_leaks():
    bad = [await FakeEngine(Knobs(fail_status=500)).start() for _ in range(2)]
    gw = await start_gateway(gateway_config([{"id": f"b{i}", "engine": "vllm", "url": e.url, "models": ["m"]}
                                             for i, e in enumerate(bad)]))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MSG},
                              headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                text = await r.text()
                assert r.status == 500  # the engines' own 500, normalised
                assert "127.0.0.1" not in text and str(bad[0].port) not in text
        assert all(len(e.knobs.seen) == 1 for e in bad), "each backend tried once before giving up"
        for e in bad:
            await e.stop()
        async with oai(gw) as c:
            with pytest.raises(openai.InternalServerError) as ei:
                await c.chat.completions.create(model="m", messages=MSG)
        assert ei.value.status_code in (502, 503)
        assert "127.0.0.1" not in str(ei.value.body)
    finally:
        await gw.stop()


async def test_504_when_engine_hangs_before_first_byte():
    hang = await FakeEngine(Knobs(hang=True)).start()
    gw = await start_gateway(gateway_config([{"id": "h", "engine": "vllm", "url": hang.url, "models": ["m"]}],
                                            upstream={"first_byte_timeout_s": 0.3}))
    try:
        async with oai(gw) as c:
            with pytest.raises(openai.InternalServerError) as ei:
                await c.chat.completions.create(model="m", messages=MSG)
        assert ei.value.status_code == 504 and ei.value.code == "upstream_timeout"
    finally:
        await gw.stop()
        await hang.stop()


@pytest.mark.parametrize("engine,body,expect_param", [
    ("llamacpp", b'{"error":{"code":400,"message":"request (9000 tokens) exceeds the available context size '
                 b'(2048 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,'
                 b'"n_ctx":2048}}', "messages"),
    ("sglang", b'{"object":"error","message":"The input (9000 tokens) is longer than the model\'s context length '
               b'(2048 tokens).","type":"BadRequestError","param":null,"code":400}', "messages"),
    ("vllm", b'{"error":{"message":"This model\'s maximum context length is 2048 tokens. However, your request has '
             b'9000 input tokens.","type":"BadRequestError","param":"input_tokens","code":400}}', "messages"),
])
async def test_engine_errors_normalised(engine, body, expect_param):
    e = await FakeEngine(Knobs(fail_status=400, fail_body=body)).start()
    gw = await start_gateway(gateway_config([{"id": "x", "engine": engine, "url": e.url, "models": ["m"]}]))
    try:
        async with oai(gw) as c:
            with pytest.raises(openai.BadRequestError) as ei:
                await c.chat.completions.create(model="m", messages=MSG)
        assert ei.value.code == "context_length_exceeded"
        assert ei.value.param == expect_param
        assert len(e.knobs.seen) == 1, "a client error is never retried"
    finally:
        await gw.stop()
        await e.stop()


async def test_client_disconnect_mid_stream_cancels_upstream():
    slow = await FakeEngine(Knobs(chunk_delay=0.05)).start()
    gw = await start_gateway(gateway_config([{"id": "s", "engine": "vllm", "url": slow.url, "models": ["m"]}]))
    try:
        async with aiohttp.ClientSession() as s:
            r = await s.post(gw.url + "/v1/chat/completions",
                             json={"model": "m", "messages": MSG, "stream": True, "max_tokens": 200},
                             headers={"Authorization": f"Bearer {USER_KEY}"})
            got = 0
            async for _ in r.content.iter_any():
                got += 1
                if got >= 3:
                    break
            r.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 3
        while (slow.knobs.active or gw.state.pool.get("s").in_flight) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert slow.knobs.aborted == 1, "the engine saw the request cancelled"
        assert slow.knobs.active == 0 and gw.state.pool.get("s").in_flight == 0
    finally:
        await gw.stop()
        await slow.stop()


async def test_engine_dying_mid_stream_gives_error_event_and_done():
    drop = await FakeEngine(Knobs(drop_after=3)).start()
    gw = await start_gateway(gateway_config([{"id": "d", "engine": "vllm", "url": drop.url, "models": ["m"]}]))
    try:
        async with oai(gw) as c:
            stream = await c.chat.completions.create(model="m", messages=MSG, stream=True, max_tokens=10)
            got = []
            with pytest.raises(openai.APIError):
                async for ch in stream:
                    got.append(ch)
        assert got, "output relayed before the failure"
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions",
                              json={"model": "m", "messages": MSG, "stream": True, "max_tokens": 10},
                              headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                raw = await r.read()
        assert b'data: {"error"' in raw and raw.endswith(b"data: [DONE]\n\n")
    finally:
        await gw.stop()
        await drop.stop()
