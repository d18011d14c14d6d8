"""The run-time key store: memory, a shared file and Redis, and the Authenticator that consults it."""

from __future__ import annotations

import os
import re
import secrets
import socket
import stat

import orjson
import pytest
import redis.asyncio as redis_asyncio

from gateway.config import AuthConfig, KeyLimits, StateConfig
from gateway.keys import storage
from gateway.keys.auth import Authenticator
from gateway.keys.keystore import KeyExists, KeyNotFound, KeyStore, StoreUnavailable
from gateway.keys.principal import hash_key
from gateway.keys.storage import ID_PATTERN, FileKeys, MemoryKeys, RedisKeys, TooManyKeys
from tests.needs import REDIS_URL, redis_up, skip_or_fail

CONFIG = AuthConfig(keys=[{"id": "ops", "sha256": hash_key("k-ops"), "admin": True}])



async def _drop(prefix: str) -> None:
    client = redis_asyncio.Redis.from_url(REDIS_URL)
    keys = [k async for k in client.scan_iter(match=prefix + "*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def redis_store(prefix: str, url: str = REDIS_URL) -> KeyStore:
    return KeyStore(RedisKeys(StateConfig(backend="redis", redis_url=url, key_prefix=prefix, redis_timeout_s=1.0)))


@pytest.fixture(params=["memory", "file", "redis"])
async def pair(request, tmp_path):
    """Two stores over one backing store, as two processes have them (for memory: one store, one process)."""
    prefix = None
    if request.param == "memory":
        a = b = KeyStore(MemoryKeys())
    elif request.param == "file":
        a, b = (KeyStore(FileKeys(str(tmp_path / "keys.json"))) for _ in range(2))
    else:
        if not await redis_up():
            skip_or_fail("no redis-server answers on 127.0.0.1:6379 (.ci/run starts one)")
        prefix = f"shapegate-test:{secrets.token_hex(6)}:"  # unique per test, removed afterwards
        a, b = redis_store(prefix), redis_store(prefix)
    await a.start()
    if b is not a:
        await b.start()
    yield a, b
    await a.stop()
    if b is not a:
        await b.stop()
    if prefix is not None:
        await _drop(prefix)


async def test_a_key_made_in_one_process_authenticates_in_the_other_with_its_limits(pair):
    a, b = pair
    auth_b = Authenticator(CONFIG, b)
    limits = KeyLimits(rpm=5, models={"m1": {"tpm": 100}})
    key, rec = await a.create("team-x", admin=False, limits=limits)
    assert rec.sha256 == hash_key(key) and key not in orjson.dumps(rec.model_dump()).decode()
    await b.refresh()
    p = auth_b.principal_for_key(key)
    assert p is not None and (p.id, p.admin, p.limits) == ("team-x", False, limits)
    assert auth_b.principal_for_key("k-ops").id == "ops"  # the configured keys stay
    assert auth_b.principal_for_key(key + "x") is None


async def test_a_revoked_key_is_refused_although_it_was_proven(pair):
    a, b = pair
    auth_b = Authenticator(CONFIG, b)
    key, _ = await a.create(None, admin=True, limits=None)
    await b.refresh()
    assert auth_b.principal_for_key(key).admin  # now in the proven cache
    await a.revoke(_.id)
    await b.refresh()
    assert auth_b.principal_for_key(key) is None
    assert auth_b.principal_for_key("k-ops") is not None


async def test_taken_ids_and_unknown_ids_change_nothing(pair):
    a, b = pair
    await a.create("dup", admin=False, limits=None)
    await b.refresh()
    before, generation = dict(b.records), b.generation
    with pytest.raises(KeyExists):
        await b.create("dup", admin=True, limits=None)
    with pytest.raises(KeyExists):
        await b.create("ops", admin=True, limits=None, taken=frozenset({"ops"}))
    with pytest.raises(KeyNotFound):
        await b.revoke("nobody")
    await b.refresh()
    assert b.records == before and b.generation == generation
    assert not b.records["dup"].admin


async def test_generated_ids_follow_the_id_rules_and_avoid_taken_ones(pair):
    a, _ = pair
    ids = {(await a.create(None, admin=False, limits=None))[1].id for _ in range(20)}
    assert len(ids) == 20 and all(re.fullmatch(ID_PATTERN, i) for i in ids)


async def test_last_use_is_published_off_the_request_path_and_merged(pair):
    a, b = pair
    key, _ = await a.create("used", admin=False, limits=None)
    await b.refresh()
    auth_b = Authenticator(CONFIG, b)
    assert (await a.last_used()).get("used") is None
    auth_b.principal_for_key(key)
    used_at = b.used["used"]
    await b.publish_used()
    assert (await a.last_used())["used"] == pytest.approx(used_at)
    a.used["used"] = used_at - 100  # an older use elsewhere never moves it back
    await a.publish_used()
    assert (await b.last_used())["used"] == pytest.approx(used_at)


async def test_the_file_holds_digests_only_and_a_new_process_loads_it(tmp_path):
    path = tmp_path / "keys.json"
    a = KeyStore(FileKeys(str(path)))
    await a.start()
    key, rec = await a.create("persist", admin=True, limits=KeyLimits(tpm=9))
    await a.stop()
    text = path.read_text()
    assert rec.sha256 in text and key not in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    b = KeyStore(FileKeys(str(path)))
    await b.start()
    assert Authenticator(CONFIG, b).principal_for_key(key).limits == KeyLimits(tpm=9)
    assert b.records["persist"].created == rec.created
    await b.stop()


async def test_every_file_change_is_noticed_even_within_one_clock_tick(tmp_path):
    path = str(tmp_path / "keys.json")
    a, b = KeyStore(FileKeys(path)), KeyStore(FileKeys(path))
    await a.start(), await b.start()
    for i in range(10):  # same-sized files written back to back
        await a.create(f"k{i}", admin=False, limits=None)
        await b.refresh()
        assert f"k{i}" in b.records
        await a.revoke(f"k{i}")
        await b.refresh()
        assert f"k{i}" not in b.records
    await a.stop(), await b.stop()


async def test_an_unreadable_file_keeps_the_loaded_keys_and_refuses_changes(tmp_path):
    path = tmp_path / "keys.json"
    a = KeyStore(FileKeys(str(path)))
    await a.start()
    key, _ = await a.create("kept", admin=False, limits=None)
    path.write_text("{not json")
    await a.refresh()
    assert Authenticator(CONFIG, a).principal_for_key(key).id == "kept"
    with pytest.raises(StoreUnavailable):
        await a.create("new", admin=False, limits=None)
    with pytest.raises(StoreUnavailable):
        await a.revoke("kept")
    assert path.read_text() == "{not json"
    await a.stop()


async def test_unreachable_redis_refuses_changes_and_keeps_the_loaded_keys():
    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = redis_store("shapegate-test:down:", f"redis://127.0.0.1:{port}/0")
    await store.start()  # logs the failure; starts with no run-time keys
    assert store.records == {}
    with pytest.raises(StoreUnavailable):
        await store.create("x", admin=False, limits=None)
    with pytest.raises(StoreUnavailable):
        await store.revoke("x")
    assert store.records == {} and await store.last_used() == {}
    await store.stop()


async def test_a_store_takes_at_most_its_cap_of_run_time_keys(pair, monkeypatch):
    a, b = pair
    monkeypatch.setattr(storage, "MAX_RUNTIME_KEYS", 3)
    for i in range(3):
        await a.create(f"k{i}", admin=False, limits=None)
    await b.refresh()
    with pytest.raises(TooManyKeys):
        await b.create("one-too-many", admin=False, limits=None)
    await a.revoke("k0")
    await b.refresh()
    await b.create("room-again", admin=False, limits=None)
    await a.refresh()
    assert sorted(a.records) == ["k1", "k2", "room-again"]


async def test_a_redis_record_under_another_field_is_listed_and_revoked_by_its_id():
    if not await redis_up():
        skip_or_fail("no redis-server answers on 127.0.0.1:6379 (.ci/run starts one)")
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    client = redis_asyncio.Redis.from_url(REDIS_URL)
    s = redis_store(prefix)
    try:
        def row(key: str) -> bytes:
            return orjson.dumps({"id": "moved", "sha256": hash_key(key), "admin": False, "created": 1.0})

        # Written by hand (or another tool): the field names differ from the id the records hold.
        await client.hset(prefix + "keys", mapping={"elsewhere": row("sk-elsewhere"), "moved": row("sk-own"),
                                                    "zzz": row("sk-zzz"), "junk": b"{not json"})
        await client.incr(prefix + "keys:version")
        await s.start()
        auth = Authenticator(CONFIG, s)
        # One record per id, the same everywhere: the one stored under its own id.
        assert list(s.records) == ["moved"] and auth.principal_for_key("sk-own").id == "moved"
        await s.revoke("moved")
        assert await client.hkeys(prefix + "keys") == [b"junk"]  # every field holding the id went
        with pytest.raises(KeyNotFound):
            await s.revoke("moved")
        await client.hset(prefix + "keys", "only-elsewhere", row("sk-elsewhere"))
        await client.incr(prefix + "keys:version")
        await s.refresh()
        assert auth.principal_for_key("sk-elsewhere").id == "moved"
        await s.revoke("moved")
        await s.refresh()
        assert s.records == {} and auth.principal_for_key("sk-elsewhere") is None
    finally:
        await s.stop()
        await client.aclose()
        await _drop(prefix)


async def test_stored_limits_beyond_the_bounds_are_left_out_not_served():
    if not await redis_up():
        skip_or_fail("no redis-server answers on 127.0.0.1:6379 (.ci/run starts one)")
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    client = redis_asyncio.Redis.from_url(REDIS_URL)
    s = redis_store(prefix)
    try:
        fine = {"id": "fine", "sha256": hash_key("sk-fine"), "admin": False, "created": 1.0, "limits": {"rpm": 10**9}}
        # 2**64 by hand: orjson itself refuses to write it (which made GET /admin/keys fail for everyone).
        huge = (f'{{"id": "huge", "sha256": "{hash_key("sk-huge")}", "admin": false, "created": 1.0, '
                f'"limits": {{"rpm": {2**64}}}}}')
        await client.hset(prefix + "keys", mapping={"huge": huge, "fine": orjson.dumps(fine)})
        await client.incr(prefix + "keys:version")
        await s.start()
        assert list(s.records) == ["fine"] and s.records["fine"].limits.rpm == 10**9
    finally:
        await s.stop()
        await client.aclose()
        await _drop(prefix)
