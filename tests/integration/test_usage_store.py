"""The usage ledger's stores, memory and Redis (a real redis-server), held to one contract; and the flush that moves
rows to them, counted once however often Redis fails it."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import pytest

from gateway.config import StateConfig
from gateway.contracts import OK, Outcome, RequestShape
from gateway.stats.ledger import COUNTS, N_COUNTS, Ledger
from gateway.stats.ledger_store import Batch, Flusher, MemoryStore, RedisStore, StoreError, UsageStore
from tests.integration.replicas_kit import drop_keys, redis_client
from tests.needs import REDIS_URL

NOW_HOUR = int(time.time() // 3600)


def counts(**named: int) -> list[int]:
    out = [0] * N_COUNTS
    for name, n in named.items():
        out[COUNTS.index(name)] = n
    return out


@pytest.fixture(params=["memory", "redis"])
async def store(request) -> AsyncIterator[UsageStore]:
    if request.param == "memory":
        yield MemoryStore()
        return
    client = await redis_client()
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    s = RedisStore(StateConfig(backend="redis", redis_url=REDIS_URL, key_prefix=prefix))
    yield s
    await s.close()
    await drop_keys(client, prefix)
    await client.aclose()


async def test_batches_add_up_by_row_and_are_read_by_hour_range(store):
    a, b = (NOW_HOUR, "k1", "m", "chat", "be"), (NOW_HOUR - 3, "k2", "m", "responses", "be")
    await store.add({a: counts(requests=1, prompt_tokens=10, completion_tokens=5)}, 90, "one")
    await store.add({a: counts(requests=2, prompt_tokens=7, errors=1), b: counts(refused=4)}, 90, "two")
    assert await store.read(NOW_HOUR - 5, NOW_HOUR) == {
        a: counts(requests=3, prompt_tokens=17, completion_tokens=5, errors=1), b: counts(refused=4)}
    assert await store.read(NOW_HOUR - 1, NOW_HOUR) == {a: counts(requests=3, prompt_tokens=17, completion_tokens=5,
                                                                  errors=1)}
    assert await store.read(NOW_HOUR + 1, NOW_HOUR + 5) == {}


async def test_a_batch_sent_again_under_its_id_counts_once(store):
    row = (NOW_HOUR, "k", "m", "chat", "be")
    for _ in range(3):  # e.g. its first try timed out after Redis had applied it
        await store.add({row: counts(requests=1, completion_tokens=9)}, 90, "same-id")
    assert await store.read(NOW_HOUR, NOW_HOUR) == {row: counts(requests=1, completion_tokens=9)}


async def test_names_of_any_text_round_trip(store):
    row = (NOW_HOUR, 'key "with" quotes\t\u00e9', "model/with:odd,chars", "chat", "be")
    await store.add({row: counts(requests=1)}, 90, "x")
    assert await store.read(NOW_HOUR, NOW_HOUR) == {row: counts(requests=1)}


async def test_hours_past_the_retention_go():
    memory = MemoryStore()
    old, new = (NOW_HOUR - 3 * 24 - 1, "k", "m", "chat", "b"), (NOW_HOUR, "k", "m", "chat", "b")
    await memory.add({old: counts(requests=1), new: counts(requests=1)}, 3, "a")
    assert await memory.read(0, NOW_HOUR) == {new: counts(requests=1)}
    client = await redis_client()
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    redis = RedisStore(StateConfig(backend="redis", redis_url=REDIS_URL, key_prefix=prefix))
    try:
        await redis.add({new: counts(requests=1)}, 3, "a")
        expires = await client.expiretime(redis.hash_key(NOW_HOUR))
        assert expires == (NOW_HOUR + 1) * 3600 + 3 * 86400  # the end of the hour, plus the retention
    finally:
        await redis.close()
        await drop_keys(client, prefix)
        await client.aclose()


async def test_fields_that_are_not_the_ledgers_are_left_out():
    client = await redis_client()
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    redis = RedisStore(StateConfig(backend="redis", redis_url=REDIS_URL, key_prefix=prefix))
    key = redis.hash_key(NOW_HOUR)
    try:
        await redis.add({(NOW_HOUR, "k", "m", "chat", "b"): counts(requests=2)}, 90, "a")
        await client.hset(key, mapping={"not json": 1, '["k","m","chat","b","no-such-count"]': 5,
                                        '["k","m","chat","b"]': 5, '["k",1,"chat","b","requests"]': 5,
                                        '["k","m","chat","b","errors"]': "many", '{"a": 1}': 3})
        await client.hset(key, '["k","m","chat","b","refused"]', -4)
        assert await redis.read(NOW_HOUR, NOW_HOUR) == {(NOW_HOUR, "k", "m", "chat", "b"): counts(requests=2)}
    finally:
        await redis.close()
        await drop_keys(client, prefix)
        await client.aclose()


class Flaky:
    """A store that fails its first `failures` adds after applying them or not, as a timed-out Redis call may."""

    kind = "flaky"

    def __init__(self, failures: int, applied: bool) -> None:
        self.inner = MemoryStore()
        self.failures, self.applied = failures, applied

    async def add(self, batch: Batch, retention_days: int, batch_id: str) -> None:
        if self.failures:
            self.failures -= 1
            if self.applied:
                await self.inner.add(batch, retention_days, batch_id)
            raise StoreError("timed out")
        await self.inner.add(batch, retention_days, batch_id)

    async def read(self, first_hour: int, last_hour: int) -> Batch:
        return await self.inner.read(first_hour, last_hour)

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("applied", [False, True])
async def test_a_failed_flush_is_retried_in_order_and_counted_once(applied):
    ledger = Ledger()
    store = Flaky(failures=3, applied=applied)
    flusher = Flusher(ledger, store)
    shape = RequestShape("m", "chat", False, 10, 10, "default", "k")
    o = Outcome("b", shape, True, 200, prompt_tokens=10, completion_tokens=4, result=OK)
    for _ in range(4):
        ledger.served("k", "m", "chat", o)
        await flusher.flush(90)
    assert flusher.errors == 3 and len(flusher.waiting) == 0 and flusher.lost_rows == 0
    (row,) = (await store.read(0, NOW_HOUR + 1)).values()
    assert row == counts(requests=4, prompt_tokens=40, completion_tokens=16)


async def test_rows_waiting_past_the_bound_are_lost_and_counted(monkeypatch):
    import gateway.stats.ledger_store as ledger_store
    monkeypatch.setattr(ledger_store, "MAX_WAITING_ROWS", 2)
    ledger = Ledger()
    flusher = Flusher(ledger, Flaky(failures=100, applied=False))
    shape = RequestShape("m", "chat", False, 10, 10, "default", "k")
    for i in range(4):
        ledger.served(f"k{i}", "m", "chat", Outcome("b", shape, True, 200, result=OK))
        await flusher.flush(90)
    assert flusher.lost_rows == 2 and flusher.waiting_rows == 2


async def test_redis_memory_per_row_hour():
    """What docs/operations.md says a row costs in Redis: a key using one model on one API and one backend for an
    hour, with five counts set (requests, prompt, cached, output tokens, errors)."""
    client = await redis_client()
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    redis = RedisStore(StateConfig(backend="redis", redis_url=REDIS_URL, key_prefix=prefix))
    try:
        rows = {(NOW_HOUR, f"team-{i:03d}", "qwen3-30b", api, backend):
                counts(requests=120, prompt_tokens=350_000, cached_tokens=90_000, completion_tokens=60_000, errors=1)
                for i in range(100) for api in ("chat", "responses") for backend in ("vllm-0", "llama-0")}
        await redis.add(rows, 90, "m")
        used = await client.memory_usage(redis.hash_key(NOW_HOUR), samples=0)
        per_row = used / len(rows)
        # 400 rows in one hash (a hashtable): about 550 bytes a row on Redis 7.0, a field of ~110 bytes per count
        assert 400 < per_row < 700, per_row
    finally:
        await redis.close()
        await drop_keys(client, prefix)
        await client.aclose()
