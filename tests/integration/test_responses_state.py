"""Stored responses kept by the gateway, through the official openai client, in front of the simulator's three
engines (none of which is asked to keep anything): chains on any engine, each turn routed, the id routes, and bad
input answered in the API's own shape."""

from __future__ import annotations

import time

import aiohttp
import openai
import pytest

from gateway.sim.runner import SimOptions, start_sim
from tests.gateway_harness import USER_KEY, gateway_config, start_gateway

MODEL = "m"
OTHER_KEY = "sk-test-other-key"
ENGINES = ("vllm", "sglang", "llamacpp")


@pytest.fixture
async def sims():
    started = {e: await start_sim(SimOptions(engine=e, model=MODEL, max_model_len=2048)) for e in ENGINES}
    yield started
    for s in started.values():
        await s.close()


def config(sims, only: tuple[str, ...] = ENGINES, **sections) -> dict:
    from gateway.keys.principal import hash_key
    sections.setdefault("routing", {"policy": "round_robin"})
    cfg = gateway_config([{"id": e, "engine": e, "url": sims[e].url, "models": [MODEL]} for e in only], **sections)
    cfg["auth"]["keys"].append({"id": "other", "sha256": hash_key(OTHER_KEY)})
    return cfg


@pytest.fixture
async def gw(sims):
    g = await start_gateway(config(sims))
    yield g
    await g.stop()


def client(gw, key: str = USER_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def test_a_chain_continues_on_every_engine_each_turn_routed(gw, sims):
    """Round robin sends the turns of one chain to each engine in turn, llama.cpp (which keeps nothing) included;
    every turn after the first holds the whole conversation."""
    async with client(gw) as c:
        served, prev, texts = [], None, []
        for turn in range(6):
            raw = await c.responses.with_raw_response.create(model=MODEL, input=f"turn {turn} question",
                                                              previous_response_id=prev, max_output_tokens=8)
            r = raw.parse()
            assert r.status in ("completed", "incomplete") and r.store is True and r.previous_response_id == prev
            assert r.id.startswith("resp_") and len(r.id) == 37  # the gateway's own id
            served.append(raw.headers["x-shapegate-backend"])
            texts.append(r.output_text)
            prev = r.id
        assert set(served) == set(ENGINES)
        # The engines were sent the whole conversation each turn: the prompt grows with every turn.
        got = await c.responses.retrieve(prev)
        assert got.id == prev and got.output_text == texts[-1]
        items = [i async for i in c.responses.input_items.list(prev, order="asc", limit=100)]
        user_texts = [i.content[0].text for i in items if getattr(i, "role", None) == "user"]
        assert user_texts == [f"turn {t} question" for t in range(6)]
        assert sum(1 for i in items if getattr(i, "role", None) == "assistant") == 5
    # Nothing was left to any engine to keep (SGLang keeps what it is not told not to).
    assert [len(sims[e].state.responses) for e in ENGINES] == [0, 0, 0]


async def test_streamed_turns_are_recorded_before_their_final_event(gw):
    async with client(gw) as c:
        prev = None
        for turn in range(3):
            ids, kinds = set(), []
            async with await c.responses.create(model=MODEL, input=f"streamed {turn}", previous_response_id=prev,
                                                stream=True, max_output_tokens=6) as stream:
                async for ev in stream:
                    kinds.append(ev.type)
                    if hasattr(ev, "response"):
                        ids.add(ev.response.id)
                        assert ev.response.store is True and ev.response.previous_response_id == prev
                    if ev.type == "response.completed":
                        # The client has the final event: the next turn, at once, finds this one.
                        final = ev.response
            assert len(ids) == 1 and kinds[-1] == "response.completed"
            prev = final.id
        got = await c.responses.retrieve(prev)
        assert got.output_text == final.output_text


async def test_delete_then_the_id_is_gone_for_reads_and_follow_ups(gw):
    async with client(gw) as c:
        r = await c.responses.create(model=MODEL, input="to delete", max_output_tokens=4)
        deleted = await c.responses.delete(r.id)
        assert deleted is None or getattr(deleted, "deleted", True)
        for call in (lambda: c.responses.retrieve(r.id),
                     lambda: c.responses.create(model=MODEL, input="more", previous_response_id=r.id)):
            with pytest.raises(openai.NotFoundError) as e:
                await call()
            assert e.value.body["code"] == "response_not_found"


async def test_store_false_then_a_follow_up_is_a_clear_404(gw):
    async with client(gw) as c:
        r = await c.responses.create(model=MODEL, input="not kept", store=False, max_output_tokens=4)
        with pytest.raises(openai.NotFoundError) as e:
            await c.responses.create(model=MODEL, input="more", previous_response_id=r.id)
        assert e.value.body["param"] == "previous_response_id" and r.id in e.value.body["message"]


async def test_another_keys_id_is_the_same_404_as_an_unknown_one(gw):
    async with client(gw) as mine, client(gw, OTHER_KEY) as theirs:
        r = await mine.responses.create(model=MODEL, input="mine", max_output_tokens=4)
        unknown = "resp_" + "0" * 32
        answers = []
        for rid in (r.id, unknown):
            for call in (lambda i=rid: theirs.responses.retrieve(i),
                         lambda i=rid: theirs.responses.input_items.list(i),
                         lambda i=rid: theirs.responses.delete(i),
                         lambda i=rid: theirs.responses.create(model=MODEL, input="x", previous_response_id=i)):
                with pytest.raises(openai.NotFoundError) as e:
                    await call()
                answers.append({k: v for k, v in e.value.body.items() if k != "message"})
                assert e.value.body["message"].replace(rid, "ID") in (
                    "Response with id 'ID' not found.",)
        assert answers[:4] == answers[4:]  # the same code and param for a foreign id and an unknown one
        assert (await mine.responses.retrieve(r.id)).id == r.id  # still there for its owner


async def test_input_tokens_of_another_keys_chain_is_a_404(gw):
    async with client(gw) as mine, aiohttp.ClientSession() as http:
        r = await mine.responses.create(model=MODEL, input="a long private prompt " * 20, max_output_tokens=4)
        async with http.post(gw.url + "/v1/responses/input_tokens", json={
                "model": MODEL, "input": "x", "previous_response_id": r.id},
                headers={"Authorization": f"Bearer {OTHER_KEY}"}) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "response_not_found"
        async with http.post(gw.url + "/v1/responses/input_tokens", json={
                "model": MODEL, "input": "x", "previous_response_id": r.id},
                headers={"Authorization": f"Bearer {USER_KEY}"}) as resp:
            # its owner's chain, expanded, counted by the engine that counts (llama.cpp)
            assert resp.status == 200 and (await resp.json())["input_tokens"] > 40


async def test_a_turn_survives_the_engine_that_served_the_one_before(sims):
    gw = await start_gateway(config(sims, only=("vllm", "llamacpp"), routing={"policy": "least_loaded"}))
    try:
        async with client(gw) as c:
            raw = await c.responses.with_raw_response.create(model=MODEL, input="first", max_output_tokens=4)
            first, engine = raw.parse(), raw.headers["x-shapegate-backend"]
            await sims[engine].close()  # the engine that made turn 1 is gone
            nxt = await c.responses.with_raw_response.create(model=MODEL, input="second",
                                                             previous_response_id=first.id, max_output_tokens=4)
            assert nxt.headers["x-shapegate-backend"] != engine and nxt.parse().status in ("completed", "incomplete")
    finally:
        await gw.stop()


async def test_a_chain_past_every_window_is_refused_with_its_tokens(sims):
    gw = await start_gateway(config(sims, only=("vllm",)))
    try:
        async with client(gw) as c:
            prev = None
            with pytest.raises(openai.BadRequestError) as e:
                for _ in range(12):
                    r = await c.responses.create(model=MODEL, input=" word" * 300, previous_response_id=prev,
                                                 max_output_tokens=4)
                    prev = r.id
            assert e.value.body["code"] == "context_length_exceeded"
            assert any(ch.isdigit() for ch in e.value.body["message"])
    finally:
        await gw.stop()


async def test_background_runs_to_its_end_and_polls(gw):
    async with client(gw) as c:
        r = await c.responses.create(model=MODEL, input="in the background", background=True, max_output_tokens=6)
        assert r.status == "queued" and r.background is True
        deadline = time.monotonic() + 10
        while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
            r = await c.responses.retrieve(r.id)
        assert r.status in ("completed", "incomplete") and r.output_text
        with pytest.raises(openai.BadRequestError):
            await c.responses.cancel(r.id)  # done: nothing to cancel
        nxt = await c.responses.create(model=MODEL, input="after it", previous_response_id=r.id, max_output_tokens=4)
        assert nxt.status in ("completed", "incomplete")


async def test_background_cancel_ends_it(sims):
    slow = await start_sim(SimOptions(engine="vllm", model=MODEL, profile="mi350x-vllm"))
    gw = await start_gateway(gateway_config([{"id": "slow", "engine": "vllm", "url": slow.url, "models": [MODEL]}]))
    try:
        async with client(gw) as c:
            r = await c.responses.create(model=MODEL, input="long " * 50, background=True, max_output_tokens=2000)
            cancelled = await c.responses.cancel(r.id)
            assert cancelled.status == "cancelled"
            assert (await c.responses.retrieve(r.id)).status == "cancelled"
            with pytest.raises(openai.BadRequestError) as e:
                await c.responses.create(model=MODEL, input="x", previous_response_id=r.id)
            assert e.value.body["code"] == "previous_response_not_finished"
    finally:
        await gw.stop()
        await slow.close()


async def test_models_by_id(gw):
    async with client(gw) as c:
        m = await c.models.retrieve(MODEL)
        assert m.id == MODEL
        with pytest.raises(openai.NotFoundError) as e:
            await c.models.retrieve("no-such-model")
        assert e.value.body["code"] == "model_not_found"


async def test_a_conversation_of_three_turns_and_its_items(gw):
    async with client(gw) as c, client(gw, OTHER_KEY) as theirs:
        conv = await c.conversations.create(metadata={"topic": "weather"},
                                            items=[{"type": "message", "role": "user", "content": "I live in Oslo."}])
        assert conv.id.startswith("conv_") and conv.metadata == {"topic": "weather"}
        for turn in range(3):
            r = await c.responses.create(model=MODEL, input=f"question {turn}", conversation=conv.id,
                                         max_output_tokens=6)
            assert r.conversation.id == conv.id
        items = [i async for i in c.conversations.items.list(conv.id, order="asc")]
        roles = [i.role for i in items]
        assert roles == ["user", "user", "assistant", "user", "assistant", "user", "assistant"]
        assert items[0].content[0].text == "I live in Oslo." and items[-2].content[0].text == "question 2"
        page = await c.conversations.items.list(conv.id, limit=2)  # newest first by default
        assert [i.id for i in page.data] == [items[-1].id, items[-2].id] and page.has_more
        one = await c.conversations.items.retrieve(items[1].id, conversation_id=conv.id)
        assert one.id == items[1].id
        added = await c.conversations.items.create(conv.id, items=[{"role": "user", "content": "by hand"}])
        assert added.data[0].content[0].text == "by hand"
        await c.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
        assert len([i async for i in c.conversations.items.list(conv.id)]) == 7
        updated = await c.conversations.update(conv.id, metadata={"topic": "rain"})
        assert updated.metadata == {"topic": "rain"}
        for call in (lambda: theirs.conversations.retrieve(conv.id),
                     lambda: theirs.conversations.items.list(conv.id),
                     lambda: theirs.responses.create(model=MODEL, input="x", conversation=conv.id)):
            with pytest.raises(openai.NotFoundError) as e:
                await call()
            assert e.value.body["code"] == "conversation_not_found"
        deleted = await c.conversations.delete(conv.id)
        assert deleted.deleted is True
        with pytest.raises(openai.NotFoundError):
            await c.conversations.retrieve(conv.id)


async def test_conversation_bounds_are_refusals_never_a_shorter_history(sims):
    gw = await start_gateway(config(sims, only=("vllm",), responses={"max_conversation_items": 4}))
    try:
        async with client(gw) as c:
            conv = await c.conversations.create()
            r = await c.responses.create(model=MODEL, input="one", conversation=conv.id, max_output_tokens=2)
            await c.responses.create(model=MODEL, input="two", conversation=conv.id, max_output_tokens=2)
            with pytest.raises(openai.BadRequestError) as e:  # 4 items held: a fifth cannot be added
                await c.responses.create(model=MODEL, input="three", conversation=conv.id, max_output_tokens=2)
            assert e.value.body["code"] == "conversation_full"
            with pytest.raises(openai.BadRequestError) as e:
                await c.conversations.items.create(conv.id, items=[{"role": "user", "content": "more"}])
            assert e.value.body["code"] == "conversation_full"
            assert len([i async for i in c.conversations.items.list(conv.id)]) == 4
            assert r.conversation.id == conv.id
            with pytest.raises(openai.BadRequestError) as e:
                await c.conversations.create(items=[{"role": "user", "content": str(i)} for i in range(21)])
            assert e.value.body["code"] == "too_many_items"
    finally:
        await gw.stop()


async def test_an_evicted_earlier_turn_is_a_404_naming_it(sims):
    gw = await start_gateway(config(sims, only=("vllm",), responses={"max_per_key": 3}))
    try:
        async with client(gw) as c:
            ids, prev = [], None
            for turn in range(3):
                r = await c.responses.create(model=MODEL, input=f"turn {turn}", previous_response_id=prev,
                                             max_output_tokens=2)
                ids.append(r.id)
                prev = r.id
            await c.responses.create(model=MODEL, input="unrelated", max_output_tokens=2)  # the 4th: turn 0 goes
            with pytest.raises(openai.NotFoundError) as e:
                await c.responses.create(model=MODEL, input="go on", previous_response_id=ids[-1])
            assert ids[0] in e.value.body["message"] and "earlier turn" in e.value.body["message"]
            assert (await c.responses.retrieve(ids[-1])).id == ids[-1]  # the last turn itself is still there
    finally:
        await gw.stop()


async def test_an_input_larger_than_a_stored_response_may_be_is_a_400(sims):
    gw = await start_gateway(config(sims, only=("vllm",), responses={"max_response_bytes": 2048}))
    try:
        async with client(gw) as c:
            with pytest.raises(openai.BadRequestError) as e:
                await c.responses.create(model=MODEL, input="x" * 4000, max_output_tokens=2)
            assert e.value.body["code"] == "response_too_large"
            r = await c.responses.create(model=MODEL, input="x" * 4000, store=False, max_output_tokens=2)
            assert r.output_text is not None  # not stored: nothing to bound
    finally:
        await gw.stop()


async def test_two_replicas_on_one_redis_continue_each_others_chains_and_conversations(sims):
    import uuid
    state = {"backend": "redis", "key_prefix": f"test-{uuid.uuid4().hex[:8]}:"}
    a = await start_gateway(config(sims, state=state))
    b = await start_gateway(config(sims, state=state))
    try:
        async with client(a) as ca, client(b) as cb, client(b, OTHER_KEY) as other:
            prev = None
            for turn in range(4):  # the turns alternate replicas: each continues what the other recorded
                c = ca if turn % 2 == 0 else cb
                r = await c.responses.create(model=MODEL, input=f"turn {turn}", previous_response_id=prev,
                                             max_output_tokens=4, stream=turn == 3)
                if turn == 3:
                    async for ev in r:
                        if ev.type == "response.completed":
                            prev = ev.response.id
                else:
                    prev = r.id
            items = [i async for i in ca.responses.input_items.list(prev, order="asc", limit=100)]
            assert [i.content[0].text for i in items if i.role == "user"] == [f"turn {t}" for t in range(4)]
            with pytest.raises(openai.NotFoundError):
                await other.responses.retrieve(prev)
            conv = await ca.conversations.create()
            await cb.responses.create(model=MODEL, input="on b", conversation=conv.id, max_output_tokens=2)
            await ca.responses.create(model=MODEL, input="on a", conversation=conv.id, max_output_tokens=2)
            texts = [i.content[0].text async for i in cb.conversations.items.list(conv.id, order="asc")
                     if i.role == "user"]
            assert texts == ["on b", "on a"]
    finally:
        await a.stop()
        await b.stop()


async def test_an_engine_that_answers_a_route_501_is_no_candidate_for_it_from_then_on():
    """llama.cpp without --embeddings answers /v1/embeddings with 501: the request fails over at once, and the
    route is not sent there again (as for a 404 of the path)."""
    llama = await start_sim(SimOptions(engine="llamacpp", model=MODEL))
    vllm = await start_sim(SimOptions(engine="vllm", model=MODEL, serves=frozenset({"embeddings"})))
    gw = await start_gateway(gateway_config([{"id": "llama", "engine": "llamacpp", "url": llama.url, "models": [MODEL]},
                                             {"id": "vllm", "engine": "vllm", "url": vllm.url, "models": [MODEL]}],
                                            routing={"policy": "round_robin"}))
    try:
        async with client(gw) as c:
            for _ in range(4):
                raw = await c.embeddings.with_raw_response.create(model=MODEL, input="hello")
                assert raw.headers["x-shapegate-backend"] == "vllm" and raw.parse().data[0].embedding
        assert "embeddings" in gw.state.pool.get("llama").unserved
    finally:
        await gw.stop()
        await llama.close()
        await vllm.close()


async def test_rerank_fits_each_query_document_pair_not_all_of_them_together():
    """400 documents of about 400 tokens: each pair fits a 2,048-token window, all of them together would not."""
    vllm = await start_sim(SimOptions(engine="vllm", model=MODEL, max_model_len=2048,
                                      serves=frozenset({"rerank", "score"})))
    gw = await start_gateway(gateway_config([{"id": "vllm", "engine": "vllm", "url": vllm.url, "models": [MODEL]}]))
    docs = [f"document {i}" + " word" * 400 for i in range(400)]
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/v1/rerank", json={"model": MODEL, "query": "which one?", "documents": docs},
                                 headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                body = await r.json()
                assert r.status == 200, body
                assert len(body["results"]) == 400
            one_too_long = [" word" * 6000]  # its pair alone is past the window, even at the low estimate
            async with http.post(gw.url + "/v1/rerank", json={"model": MODEL, "query": "q", "documents": one_too_long},
                                 headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "context_length_exceeded"
    finally:
        await gw.stop()
        await vllm.close()
