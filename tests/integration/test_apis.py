"""Responses, Messages, rerank and transcriptions through the gateway, with the official openai and anthropic clients:
with the state kept by the engines ([responses] state = "engine"), stored responses stay with the backend and the
key that made them; errors take each API's shape. (With the state kept by the gateway, the default:
test_responses_state.py.)"""

from __future__ import annotations

import aiohttp
import anthropic
import openai
import pytest

from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway

OTHER_KEY = "sk-test-other-key"


def _cfg(engines, **sections):
    from gateway.keys.principal import hash_key
    cfg = gateway_config([{"id": f"b{i}", "engine": "vllm", "url": e.url, "models": {"m": "m"}}
                          for i, e in enumerate(engines)], routing={"policy": "round_robin"}, **sections)
    cfg["auth"]["keys"].append({"id": "other", "sha256": hash_key(OTHER_KEY)})
    return cfg


ENGINE_STATE = {"state": "engine"}


@pytest.fixture
async def gw(api_engines):
    g = await start_gateway(_cfg(api_engines))
    yield g
    await g.stop()


@pytest.fixture
async def gw_engine(api_engines):
    g = await start_gateway(_cfg(api_engines, responses=ENGINE_STATE))
    yield g
    await g.stop()


def oai(gw, key=USER_KEY):
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def claude(gw, key=USER_KEY):
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)


async def test_responses_create_streamed_and_not_with_usage_counted(gw):
    async with oai(gw) as c:
        raw = await c.responses.with_raw_response.create(model="m", input="hello", max_output_tokens=16)
        r = raw.parse()
        assert r.output_text.startswith(("a0", "b0")) and r.usage.output_tokens == 5
        assert raw.headers["x-shapegate-backend"] in ("b0", "b1")
        kinds = []
        async with await c.responses.create(model="m", input=[{"role": "user", "content": "hi"}],
                                            stream=True) as stream:
            async for ev in stream:
                kinds.append(ev.type)
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert kinds.count("response.output_text.delta") == 5
    metrics = await _get(gw, "/metrics", ADMIN_KEY)
    assert 'route="responses"' in metrics
    assert 'shapegate_completion_tokens_total{backend="b0"}' in metrics or "b1" in metrics


async def test_previous_response_chain_stays_on_the_backend_that_made_it(gw_engine, api_engines):
    async with oai(gw_engine) as c:
        first = await c.responses.create(model="m", input="turn 1")
        made_on = first.output_text[0]  # "a" or "b": the engine's name
        prev = first.id
        for turn in (2, 3):
            nxt = await c.responses.create(model="m", input=f"turn {turn}", previous_response_id=prev)
            assert nxt.output_text[0] == made_on  # round robin alone would have alternated
            prev = nxt.id
        got = await c.responses.retrieve(prev)
        assert got.id == prev
        cancelled = await c.post(f"/responses/{prev}/cancel", cast_to=object)
        assert cancelled["status"] == "cancelled"
        await c.responses.delete(prev)
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(prev)


async def test_another_keys_response_id_is_a_404_on_every_route(gw_engine):
    async with oai(gw_engine) as mine, oai(gw_engine, OTHER_KEY) as theirs:
        r = await mine.responses.create(model="m", input="secret")
        for call in (lambda: theirs.responses.retrieve(r.id), lambda: theirs.responses.delete(r.id),
                     lambda: theirs.post(f"/responses/{r.id}/cancel", cast_to=object),
                     lambda: theirs.responses.create(model="m", input="x", previous_response_id=r.id)):
            with pytest.raises(openai.NotFoundError) as e:
                await call()
            assert e.value.body["code"] == "response_not_found"
        # the same answer as for an id nobody made
        with pytest.raises(openai.NotFoundError) as unknown:
            await mine.responses.retrieve("resp_unknown123")
        assert unknown.value.body["message"] == "Response with id 'resp_unknown123' not found."
        assert (await mine.responses.retrieve(r.id)).id == r.id  # still there for its owner


async def test_a_stored_responses_backend_down_is_a_clear_error(api_engines):
    g = await start_gateway(_cfg(api_engines, responses=ENGINE_STATE))
    try:
        async with oai(g) as c:
            r = await c.responses.create(model="m", input="x")
            backend = "b0" if r.output_text[0] == "a" else "b1"
            await api_engines[0 if backend == "b0" else 1].stop()
            for _ in range(100):  # the probes notice
                if not g.state.pool.get(backend).usable(__import__("time").monotonic()):
                    break
                await __import__("asyncio").sleep(0.05)
            with pytest.raises(openai.InternalServerError) as e:
                await c.responses.create(model="m", input="y", previous_response_id=r.id)
            assert e.value.status_code == 503
            assert e.value.body["code"] == "stored_response_unavailable"
            assert backend in e.value.body["message"] and r.id in e.value.body["message"]
            # a request without a stored response still goes to the backend that is up
            assert (await c.responses.create(model="m", input="z")).output_text
    finally:
        await g.stop()


async def test_replicas_sharing_redis_find_each_others_stored_responses(api_engines):
    import uuid
    state = {"backend": "redis", "key_prefix": f"test-{uuid.uuid4().hex[:8]}:"}
    a = await start_gateway(_cfg(api_engines, state=state, responses=ENGINE_STATE))
    b = await start_gateway(_cfg(api_engines, state=state, responses=ENGINE_STATE))
    try:
        async with oai(a) as ca, oai(b) as cb, oai(b, OTHER_KEY) as other:
            r = await ca.responses.create(model="m", input="made on replica a")
            assert (await cb.responses.retrieve(r.id)).id == r.id  # replica b never saw it
            nxt = await cb.responses.create(model="m", input="go on", previous_response_id=r.id)
            assert nxt.output_text[0] == r.output_text[0]
            with pytest.raises(openai.NotFoundError):
                await other.responses.retrieve(r.id)
    finally:
        await a.stop()
        await b.stop()


async def test_messages_streamed_and_not_with_anthropic_headers_passed_on(gw, api_engines):
    async with claude(gw) as c:
        m = await c.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
        assert m.type == "message" and m.usage.output_tokens == 5 and m.content[0].text
        kinds = []
        async with c.messages.stream(model="m", max_tokens=16, system="be brief",
                                     messages=[{"role": "user", "content": "hi"}]) as s:
            async for ev in s:
                kinds.append(ev.type)
            final = await s.get_final_message()
        assert "message_start" in kinds and "message_stop" in kinds and final.usage.output_tokens == 5
        n = await c.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}])
        assert n.input_tokens == 9
    seen = [s for e in api_engines for s in e.knobs.seen if s[1] == "/v1/messages"]
    assert all(s[2].get("anthropic-version") for s in seen)
    assert all("x-api-key" not in {k.lower() for k in s[2]} for s in seen)  # the client's key stays here


async def test_messages_errors_take_anthropics_shape(gw):
    async with claude(gw) as c:
        with pytest.raises(anthropic.BadRequestError) as e:
            await c.messages.create(model="m", max_tokens=0, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.NotFoundError) as nf:
            await c.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert nf.value.body["error"]["type"] == "not_found_error"
    async with claude(gw, "sk-wrong") as bad:
        with pytest.raises(anthropic.AuthenticationError) as au:
            await bad.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert au.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_mid_stream_failure_ends_with_the_apis_own_error_event(api_engines, api):
    for e in api_engines:
        e.knobs.fail_after = 2
    g = await start_gateway(_cfg(api_engines))
    try:
        path = "/v1/responses" if api == "responses" else "/v1/messages"
        body = {"model": "m", "stream": True, "input": "x"} if api == "responses" else \
            {"model": "m", "stream": True, "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
        async with aiohttp.ClientSession() as s:
            async with s.post(g.url + path, json=body, headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                assert r.status == 200
                text = (await r.read()).decode()
        assert text.count(".delta" if api == "responses" else '"content_block_delta"') >= 2
        last = text.strip().split("\n\n")[-1]
        assert last.startswith("event: error\ndata: ")
        assert "[DONE]" not in text
        if api == "messages":
            assert '"type":"error","error":{"type":"api_error"' in last
        else:
            assert '"type":"error","code":"upstream_error"' in last and '"sequence_number":3' in last
    finally:
        await g.stop()


async def test_an_engine_without_a_route_is_no_candidate_for_it(api_engines):
    api_engines[0].knobs.missing = frozenset({"/v1/messages"})
    g = await start_gateway(_cfg(api_engines))
    try:
        async with claude(g) as c:
            for _ in range(4):
                m = await c.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
                assert m.content[0].text.startswith("b")
        tried = [s for s in api_engines[0].knobs.seen if s[1] == "/v1/messages"]
        assert len(tried) <= 1  # answered 404 once, then never tried again
        assert g.state.pool.get("b0").unserved.keys() == {"messages"}
        api_engines[1].knobs.missing = frozenset({"/v1/messages"})
        async with claude(g) as c:
            with pytest.raises(anthropic.NotFoundError) as e:
                await c.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
            assert "/v1/messages" in e.value.body["error"]["message"]
    finally:
        await g.stop()


async def test_rerank_under_each_name_and_transcriptions_as_a_form(gw, api_engines):
    headers = {"Authorization": f"Bearer {USER_KEY}"}
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            async with s.post(gw.url + path, json={"model": "m", "query": "q", "documents": ["x", "y"]},
                              headers=headers) as r:
                assert r.status == 200 and len((await r.json())["results"]) == 2
        async with s.post(gw.url + "/v1/rerank", json={"model": "m", "documents": ["x"]}, headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "query"
    async with oai(gw) as c:
        t = await c.audio.transcriptions.create(model="m", file=("a.wav", b"RIFF" + b"\0" * 2000, "audio/wav"))
        assert t.text.startswith("heard") and t.text.endswith("via m")
    forms = [s for e in api_engines for s in e.knobs.seen if s[1] == "/v1/audio/transcriptions"]
    assert forms and forms[0][2]["Content-Type"].startswith("multipart/form-data; boundary=")


async def test_engine_response_ids_of_another_form_are_never_stored(api_engines):
    for e in api_engines:
        e.knobs.bad_id = True
    g = await start_gateway(_cfg(api_engines, responses=ENGINE_STATE))
    try:
        async with oai(g) as c:
            r = await c.responses.create(model="m", input="x")
            assert r.id.startswith("resp ")
        assert len(g.state.engine_index._local) == 0
    finally:
        await g.stop()


async def test_id_routes_methods_and_unknown_forms(gw):
    headers = {"Authorization": f"Bearer {USER_KEY}"}
    async with aiohttp.ClientSession() as s:
        async with s.put(gw.url + "/v1/responses/resp_abc", headers=headers) as r:
            assert r.status == 405 and r.headers["Allow"] == "GET, DELETE"
        async with s.get(gw.url + "/v1/responses/resp%0Aabc", headers=headers) as r:
            assert r.status == 404  # not an id's form: no API route at all
        async with s.post(gw.url + "/v1/responses", json={"model": "m", "input": "x",
                                                           "previous_response_id": "../../admin"},
                          headers=headers) as r:
            body = await r.json()
            assert r.status == 404 and "admin" not in body["error"]["message"]


async def _get(gw, path: str, key: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + path, headers={"Authorization": f"Bearer {key}"}) as r:
            return await r.text()


def _ev(kind: str, **fields) -> bytes:
    import orjson
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


DELTA = _ev("response.output_text.delta", delta="x ", sequence_number=1)
CREATED = _ev("response.created", response={"id": "resp_h1", "model": "m"}, sequence_number=0)
MDELTA = _ev("content_block_delta", index=0, delta={"type": "text_delta", "text": "x"})
MSTART = _ev("message_start", message={"id": "msg_1", "model": "m", "usage": {"input_tokens": 3}})
# (api, id, the engine's stream, HTTP status the client gets, what its body's last event must hold)
HOSTILE_STREAMS = [
    ("responses", "ends-without-completed", [CREATED, DELTA], 200, b'"code":"upstream_truncated"'),
    ("responses", "opens-with-error", [_ev("error", code="bad", message="no such tool")], 500, b"no such tool"),
    ("responses", "failed-midway", [CREATED, DELTA, _ev("response.failed", response={"error": {"message": "oom"}})],
     200, b'"type":"response.failed"'),
    ("responses", "event-over-the-limit", [CREATED, DELTA, b"data: " + b"x" * 70_000], 200, b"larger than"),
    ("responses", "garbage-json-special", [CREATED, b'data: {"type":"response.completed", oops\n\n'], 200,
     b"upstream_truncated"),
    ("messages", "ends-without-stop", [MSTART, MDELTA], 200, b'"type":"api_error"'),
    ("messages", "opens-with-overloaded", [_ev("error", error={"type": "overloaded_error", "message": "busy"})],
     529, b"overloaded_error"),
    ("messages", "error-midway", [MSTART, MDELTA, _ev("error", error={"type": "api_error", "message": "died"})],
     200, b"died"),
    ("messages", "one-byte-writes", [bytes([c]) for c in MSTART + MDELTA + _ev("message_stop")], 200,
     b"message_stop"),
]


@pytest.mark.parametrize("api,case,script,status,last", HOSTILE_STREAMS, ids=[r[1] for r in HOSTILE_STREAMS])
async def test_hostile_engine_streams_end_cleanly_in_the_apis_form(api_engines, api, case, script, status, last):
    for e in api_engines:
        e.knobs.script = script
    g = await start_gateway(_cfg(api_engines, upstream={"max_event_bytes": 65_536}))
    try:
        path = "/v1/responses" if api == "responses" else "/v1/messages"
        body = {"model": "m", "stream": True, "input": "x"} if api == "responses" else \
            {"model": "m", "stream": True, "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
        async with aiohttp.ClientSession() as s:
            async with s.post(g.url + path, json=body, headers={"Authorization": f"Bearer {USER_KEY}"},
                              timeout=aiohttp.ClientTimeout(total=20)) as r:
                data = await r.read()
                assert r.status == status, data
        assert last in data.strip().split(b"\n\n")[-1]
        assert b"[DONE]" not in data
        if status != 200 and api == "messages":
            assert data.startswith(b'{"type":"error"')
    finally:
        await g.stop()
