"""What a hostile client or a misconfigured engine must not get through the gateway: a body smuggled on a request
that has none, the gateway's own engine key, another key's (or a revoked key's) stored responses, an error in
another API's shape. Real gateways on loopback, a lax engine that reads no body on GET or DELETE."""

from __future__ import annotations

import asyncio
import time

import anthropic
import openai
import orjson
import pytest

from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.integration.test_dashboard_revocation import COOKIE_NAME, fresh, sign_in
from tests.lax_engine import LaxEngine

MODEL = "m"
ENGINE_KEY = "sk-engine-secret-0123456789abcdef"
KEY_ENV = "SHAPEGATE_TEST_ENGINE_KEY"
AUTH = {"Authorization": f"Bearer {USER_KEY}"}
SMUGGLED = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 64\r\n\r\n" + orjson.dumps({"model": MODEL, "messages": [
                {"role": "user", "content": "smuggled"}]}).ljust(64))


@pytest.fixture
async def lax():
    e = await LaxEngine(model=MODEL).start()
    yield e
    await e.stop()


async def _send(url: str, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, bytes]:
    async with fresh() as s, s.request(method, url + path, data=body, headers={**AUTH, **(headers or {})}) as r:
        return r.status, await r.read()


# -- a body on a request that has none by its API ---------------------------------------------------------------
NO_BODY_ROUTES = [("GET", "/v1/responses/{id}"), ("DELETE", "/v1/responses/{id}"), ("POST", "/v1/responses/{id}/cancel"),
                  ("GET", "/v1/responses/{id}?stream=false")]


@pytest.mark.parametrize("method,path", NO_BODY_ROUTES)
async def test_a_body_on_a_no_body_route_is_never_relayed(lax, method, path):
    """With the state kept by the engines the request goes to the engine that made the response: without the
    client's body, which the lax engine would otherwise read as a second request on the pooled connection."""
    gw = await start_gateway(gateway_config([{"id": "lax", "engine": "vllm", "url": lax.url, "models": [MODEL]}],
                                            responses={"state": "engine"}))
    try:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
            made = await c.responses.create(model=MODEL, input="x")
        before = len(lax.seen)
        status, _ = await _send(gw.url, method, path.format(id=made.id), SMUGGLED)
        assert status in (200, 400)  # (a cancel of a finished response is the engine's 400)
        status, body = await _send(gw.url, "POST", "/v1/chat/completions", orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "honest"}]}), {"Content-Type": "application/json"})
        assert status == 200 and b"chat for honest" in body  # the next request got its own reply
        after = lax.seen[before:]
        assert [s.path.split("?")[0] for s in after if s.path.startswith("/v1/")] == \
            [path.format(id=made.id).split("?")[0], "/v1/chat/completions"]
        assert after[0].headers.get("content-length", "0") == "0" and not any(b"smuggled" in s.body for s in after)
    finally:
        await gw.stop()


@pytest.mark.parametrize("method,path", NO_BODY_ROUTES)
async def test_with_the_state_kept_by_the_gateway_no_body_route_reaches_an_engine(lax, method, path):
    gw = await start_gateway(gateway_config([{"id": "lax", "engine": "vllm", "url": lax.url, "models": [MODEL]}]))
    try:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
            made = await c.responses.create(model=MODEL, input="x")
        before = len(lax.requests())
        status, _ = await _send(gw.url, method, path.format(id=made.id), SMUGGLED)
        assert status in (200, 400)
        assert len(lax.requests()) == before
    finally:
        await gw.stop()


# -- the gateway's own engine key -----------------------------------------------------------------------------------
@pytest.fixture
def engine_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, ENGINE_KEY)
    return ENGINE_KEY


async def _three_ways(gw) -> list[tuple[int, bytes]]:
    """A chat, a streamed chat and a Messages request: (status, body) each."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    out = [await _send(gw.url, "POST", "/v1/chat/completions", orjson.dumps(chat)),
           await _send(gw.url, "POST", "/v1/chat/completions", orjson.dumps({**chat, "stream": True})),
           await _send(gw.url, "POST", "/v1/messages", orjson.dumps({**chat, "max_tokens": 4}),
                       {"anthropic-version": "2023-06-01"})]
    return out


async def test_an_engine_refusing_the_gateways_key_is_the_gateways_fault_and_its_text_never_relayed(lax, engine_key):
    lax.key = "the-engine-wants-another-key"  # it refuses, and quotes what it got (the gateway's key)
    gw = await start_gateway(gateway_config([{"id": "lax", "engine": "vllm", "url": lax.url, "models": [MODEL],
                                              "api_key_env": KEY_ENV}]))
    try:
        chat, streamed, msg = await _three_ways(gw)
        for status, body in (chat, streamed, msg):
            assert status == 502 and ENGINE_KEY.encode() not in body and b"Invalid API key" not in body
        assert orjson.loads(chat[1])["error"]["code"] == "upstream_auth_failed"
        assert orjson.loads(msg[1])["type"] == "error" and orjson.loads(msg[1])["error"]["type"] == "api_error"
        b = gw.state.pool.get("lax")
        assert b.misconfigured and KEY_ENV in b.misconfigured and ENGINE_KEY not in b.misconfigured
        status, stats = await _send(gw.url, "GET", "/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        backends = orjson.loads(stats)["backends"]
        assert next(x for x in backends if x["id"] == "lax")["misconfigured"] == b.misconfigured
    finally:
        await gw.stop()


async def test_a_refusing_backend_is_failed_over_and_left_alone(lax, engine_key):
    lax.key = "another"
    good = await FakeEngine(Knobs()).start()
    gw = await start_gateway(gateway_config([
        {"id": "lax", "engine": "vllm", "url": lax.url, "models": [MODEL], "api_key_env": KEY_ENV},
        {"id": "good", "engine": "vllm", "url": good.url, "models": [MODEL]}], routing={"policy": "round_robin"}))
    try:
        results = [await _send(gw.url, "POST", "/v1/chat/completions", orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})) for _ in range(6)]
        assert [s for s, _ in results] == [200] * 6
        assert len([s for s in lax.requests() if s.path == "/v1/chat/completions"]) == 1  # tried once, then left
    finally:
        await gw.stop()
        await good.stop()


async def test_an_engine_echoing_the_gateways_key_in_a_reply_is_scrubbed(lax, engine_key):
    lax.key, lax.echo_key = ENGINE_KEY, True
    gw = await start_gateway(gateway_config([{"id": "lax", "engine": "vllm", "url": lax.url, "models": [MODEL],
                                              "api_key_env": KEY_ENV}]))
    try:
        for status, body in await _three_ways(gw):
            assert status == 200 and ENGINE_KEY.encode() not in body and b"[redacted]" in body
    finally:
        await gw.stop()


# -- ownership ------------------------------------------------------------------------------------------------------
async def test_a_key_made_again_under_a_revoked_keys_id_inherits_nothing(lax):
    gw = await start_gateway(gateway_config([{"id": "lax", "engine": "vllm", "url": lax.url, "models": [MODEL]}]))
    admin = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}
    try:
        async with fresh() as s:
            async with s.post(gw.url + "/admin/keys", json={"id": "team-x"}, headers=admin) as r:
                first = (await r.json())["key"]
            async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=first, max_retries=0) as c:
                made = await c.responses.create(model=MODEL, input="private")
                conv = await c.conversations.create(items=[{"role": "user", "content": "private too"}])
            async with s.delete(gw.url + "/admin/keys/team-x", headers=admin) as r:
                assert r.status == 200
            async with s.post(gw.url + "/admin/keys", json={"id": "team-x"}, headers=admin) as r:
                again = (await r.json())["key"]
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=again, max_retries=0) as c:
            with pytest.raises(openai.NotFoundError):
                await c.responses.retrieve(made.id)
            with pytest.raises(openai.NotFoundError):
                await c.conversations.retrieve(conv.id)
    finally:
        await gw.stop()


async def test_a_stale_engine_index_entry_is_a_clean_503(lax):
    gw = await start_gateway(gateway_config([{"id": "lax", "engine": "vllm", "url": lax.url, "models": [MODEL]}],
                                            responses={"state": "engine"}))
    try:
        owner = gw.state.auth.principal_for_key(USER_KEY).owner
        gw.state.engine_index.remember("resp_stale1", "lax", owner, "a-model-it-no-longer-serves")
        status, body = await _send(gw.url, "GET", "/v1/responses/resp_stale1")
        assert status == 503 and orjson.loads(body)["error"]["code"] == "stored_response_unavailable"
    finally:
        await gw.stop()


async def test_foreign_and_unknown_ids_take_the_same_looks_in_the_engine_index(lax):
    """With Redis, an id this replica does not know is asked of Redis twice (a write may still be on its way): a
    foreign id takes the same two looks as an unknown one, since entries are kept under their owner."""
    import uuid
    from tests.gateway_harness import gateway_config as cfg_of
    from gateway.keys.principal import hash_key
    cfg = cfg_of([{"id": "lax", "engine": "vllm", "url": lax.url, "models": [MODEL]}], responses={"state": "engine"},
                 state={"backend": "redis", "key_prefix": f"test-{uuid.uuid4().hex[:8]}:"})
    cfg["auth"]["keys"].append({"id": "other", "sha256": hash_key("sk-other")})
    a, b = await start_gateway(cfg), await start_gateway(cfg)
    try:
        async with openai.AsyncOpenAI(base_url=a.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
            made = await c.responses.create(model=MODEL, input="x")
        await asyncio.sleep(0.3)  # (its index entry reaches Redis)
        took = {}
        for name, rid in (("foreign", made.id), ("unknown", "resp_lax99999999")):
            t0 = time.monotonic()
            status, body = await _send(b.url, "GET", f"/v1/responses/{rid}", headers={"Authorization": "Bearer sk-other"})
            took[name] = time.monotonic() - t0
            assert status == 404 and orjson.loads(body)["error"]["message"] == f"Response with id '{rid}' not found."
        assert min(took.values()) >= 0.05  # both waited for the second look
    finally:
        await a.stop()
        await b.stop()


# -- error shapes and the dashboard cookie --------------------------------------------------------------------------
async def test_messages_refusals_made_by_the_gateway_take_anthropics_shape(lax):
    gw = await start_gateway(gateway_config([{"id": "lax", "engine": "vllm", "url": lax.url, "models": [MODEL]}]))
    try:
        status, body = await _send(gw.url, "GET", "/v1/messages")
        assert status == 405 and orjson.loads(body)["type"] == "error"
        assert orjson.loads(body)["error"]["type"] == "invalid_request_error"
        raw = (b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: " + USER_KEY.encode() + b"\r\nx-api-key: other\r\n"
               b"Content-Length: 2\r\n\r\n{}")
        reader, writer = await asyncio.open_connection(*gw.url[7:].split(":"))
        writer.write(raw)
        reply = await reader.read(65536)
        writer.close()
        assert reply.startswith(b"HTTP/1.1 400") and b'"type":"error"' in reply and b'"error":{"type"' in reply
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-wrong", max_retries=0) as c:
            with pytest.raises(anthropic.AuthenticationError) as e:
                await c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
            assert e.value.body["error"]["type"] == "authentication_error"
    finally:
        await gw.stop()


async def test_stats_takes_the_dashboard_cookie_alone(lax):
    gw = await start_gateway(gateway_config([{"id": "lax", "engine": "vllm", "url": lax.url, "models": [MODEL]}]))
    try:
        status, token, _, _ = await sign_in(gw.url, ADMIN_KEY)
        assert token is not None
        async with fresh() as s, s.get(gw.url + "/stats", headers={"Cookie": f"{COOKIE_NAME}={token}"}) as r:
            assert r.status == 200 and "backends" in await r.json()
        async with fresh() as s, s.get(gw.url + "/stats") as r:
            assert r.status == 401
    finally:
        await gw.stop()

