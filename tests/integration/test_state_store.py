"""The store of the state kept for clients: one contract, the same tests on this process's memory and on a real
redis-server (each Redis run under a key prefix of its own)."""

from __future__ import annotations

import asyncio
import uuid

import orjson
import pytest

from gateway.config import ResponsesConfig, StateConfig
from gateway.state.redis_store import RedisStore
from gateway.state.store import CONVERSATION, FULL, MISSING, OK, RESPONSE, MemoryStore, status_of
from tests.needs import redis_up, skip_or_fail


def record(status: str, size: int = 0) -> bytes:
    return orjson.dumps({"status": status, "pad": "x" * size})


@pytest.fixture(params=["memory", "redis"])
async def make(request):
    made = []

    async def build(**limits) -> MemoryStore | RedisStore:
        cfg = ResponsesConfig(**limits)
        if request.param == "memory":
            store = MemoryStore(cfg)
        else:
            if not await redis_up():
                skip_or_fail("no Redis answers on 127.0.0.1:6379")
            store = RedisStore(cfg, StateConfig(backend="redis", key_prefix=f"test-{uuid.uuid4().hex[:10]}:",
                                                redis_timeout_s=2.0))
        made.append(store)
        return store

    yield build
    for s in made:
        await s.close()


async def test_a_response_is_its_owners_alone(make):
    s = await make()
    await s.put_response("alice", "resp_1", record("completed"))
    assert status_of(await s.get(RESPONSE, "alice", "resp_1")) == "completed"
    assert await s.get(RESPONSE, "bob", "resp_1") is None  # another owner: no such id at all
    assert await s.count(RESPONSE, "alice", ["resp_1", "resp_2"]) == 1
    assert await s.get_many(RESPONSE, "alice", ["resp_2", "resp_1"]) == [None, record("completed")]
    assert not await s.delete(RESPONSE, "bob", "resp_1")
    assert await s.delete(RESPONSE, "alice", "resp_1") and await s.get(RESPONSE, "alice", "resp_1") is None
    assert not await s.delete(RESPONSE, "alice", "resp_1")


async def test_past_a_keys_count_or_bytes_its_oldest_go_first(make):
    s = await make(max_per_key=3, max_bytes_per_key=4096, max_response_bytes=4096)
    for i in range(5):
        await s.put_response("alice", f"resp_{i}", record("completed"))
        await s.put_response("bob", f"resp_{i}", record("completed"))
    kept = [await s.get(RESPONSE, "alice", f"resp_{i}") is not None for i in range(5)]
    assert kept == [False, False, True, True, True]
    assert await s.count(RESPONSE, "bob", [f"resp_{i}" for i in range(5)]) == 3  # each key its own bound
    # 4,071 bytes: one more than the count allows, and past 4,096 bytes with any of the three others beside it
    evicted = await s.put_response("alice", "resp_big", record("completed", 4040))
    assert evicted == 3 and await s.get(RESPONSE, "alice", "resp_big") is not None
    assert await s.count(RESPONSE, "alice", [f"resp_{i}" for i in range(5)]) == 0


async def test_past_the_total_the_oldest_of_all_go_first(make):
    s = await make(max_total=16)
    for i in range(20):
        await s.put_response(f"key{i % 4}", f"resp_{i}", record("completed"))
    alive = [i for i in range(20) if await s.get(RESPONSE, f"key{i % 4}", f"resp_{i}") is not None]
    assert alive == list(range(4, 20))


async def test_a_replacement_only_over_one_of_the_statuses_named(make):
    s = await make()
    await s.put_response("alice", "resp_bg", record("queued"))
    assert await s.replace_response_if("alice", "resp_bg", record("cancelled"), ("queued", "in_progress"))
    assert not await s.replace_response_if("alice", "resp_bg", record("completed"), ("queued", "in_progress"))
    assert status_of(await s.get(RESPONSE, "alice", "resp_bg")) == "cancelled"
    assert not await s.replace_response_if("alice", "resp_none", record("completed"), ("queued",))
    assert not await s.replace_response_if("bob", "resp_bg", record("completed"), ("cancelled",))


async def test_records_expire(make):
    s = await make(ttl_s=0.3)  # (Redis keeps time in milliseconds: 300)
    await s.put_response("alice", "resp_1", record("completed"))
    assert await s.create_conversation("alice", "conv_1", b"{}", [b'{"id":"i1"}'])
    await asyncio.sleep(0.5)
    assert await s.get(RESPONSE, "alice", "resp_1") is None
    assert await s.get(CONVERSATION, "alice", "conv_1") is None and await s.items("alice", "conv_1") is None
    assert await s.create_conversation("alice", "conv_2", b"{}", [])  # an expired one counts no more


async def test_conversations_and_their_items(make):
    s = await make(max_conversation_items=4, max_conversation_bytes=1024, max_conversations_per_key=2)
    assert await s.create_conversation("alice", "conv_1", b'{"m":1}', [b'{"id":"a"}'])
    assert await s.get(CONVERSATION, "alice", "conv_1") == b'{"m":1}'
    assert await s.get(CONVERSATION, "bob", "conv_1") is None and await s.items("bob", "conv_1") is None
    assert await s.append_items("alice", "conv_1", [b'{"id":"b"}', b'{"id":"c"}']) == OK
    assert await s.items("alice", "conv_1") == [b'{"id":"a"}', b'{"id":"b"}', b'{"id":"c"}']
    assert await s.append_items("alice", "conv_1", [b'{"id":"d"}', b'{"id":"e"}']) == FULL  # 5 > 4: nothing added
    assert await s.append_items("alice", "conv_1", [b"x" * 1000]) == FULL  # bytes
    assert len(await s.items("alice", "conv_1")) == 3
    assert await s.append_items("bob", "conv_1", [b'{"id":"z"}']) == MISSING
    assert await s.delete_item("alice", "conv_1", b'{"id":"b"}')
    assert not await s.delete_item("alice", "conv_1", b'{"id":"b"}')
    assert await s.append_items("alice", "conv_1", [b'{"id":"d"}', b'{"id":"e"}']) == OK  # room again
    assert await s.set_meta("alice", "conv_1", b'{"m":2}') and not await s.set_meta("bob", "conv_1", b"{}")
    assert await s.get(CONVERSATION, "alice", "conv_1") == b'{"m":2}'
    assert await s.create_conversation("alice", "conv_2", b"{}", [])
    assert not await s.create_conversation("alice", "conv_3", b"{}", [])  # two a key at most
    assert await s.delete(CONVERSATION, "alice", "conv_1")
    assert await s.items("alice", "conv_1") is None
    assert await s.create_conversation("alice", "conv_3", b"{}", [])
