"""Run-time keys across processes: replicas sharing Redis, and `serve --workers 2` sharing a keys file."""

from __future__ import annotations

import asyncio
import secrets
import signal
import sys
import time

import aiohttp
import orjson
import pytest
import redis.asyncio as redis_asyncio

from benchmarks.loopback import free_port, wait_http
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config
from tests.needs import REDIS_URL, redis_up, skip_or_fail
from tests.procs import ROOT, gateway_proc, to_toml

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
WITHIN_S = 1.0  # a change made on one process holds on every other within this, from the admin call's reply
BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def admin(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.request(method, url + path, json=body, headers=ADMIN) as r:
        return r.status, orjson.loads(await r.read())


async def ask(url: str, key: str) -> tuple[int, str]:
    """One chat request on a new connection (with workers the kernel picks which one takes it): the status
    and the answering process's request-id prefix."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.post(url + "/v1/chat/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        return r.status, r.headers["x-request-id"][:12]


async def within(deadline_s: float, check) -> None:
    """`check()` turns true before the deadline, polled as fast as it answers."""
    deadline = time.monotonic() + deadline_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {deadline_s} s"



async def test_replicas_see_a_new_and_a_revoked_key_within_a_second(tmp_path):
    if not await redis_up():
        skip_or_fail("no redis-server answers on 127.0.0.1:6379 (.ci/run starts one)")
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    engine = await FakeEngine(Knobs()).start()
    cfg = gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}],
                         state={"backend": "redis", "key_prefix": prefix})
    (tmp_path / "gw.toml").write_text(to_toml(cfg))
    one = gateway_proc(tmp_path / "gw.toml", log=tmp_path / "one.log")
    two = gateway_proc(tmp_path / "gw.toml", log=tmp_path / "two.log")
    running = [one, two]
    try:
        await asyncio.gather(one.start(timeout=20), two.start(timeout=20))
        status, made = await admin(one.url, "POST", "/admin/keys", {"id": "fleet", "limits": {"rpm": 9}})
        assert status == 201
        key = made["key"]
        await within(WITHIN_S, lambda: _served(two.url, key))
        for _ in range(3):
            assert (await ask(two.url, key))[0] == 200  # proven, cached by the second replica
        status, _ = await admin(one.url, "DELETE", "/admin/keys/fleet")
        assert status == 200
        await within(WITHIN_S, lambda: _refused(two.url, key))
        assert (await ask(one.url, key))[0] == 401
        assert (await ask(two.url, USER_KEY))[0] == 200
        # Made on the second, it reaches the first the same way; each lists what the other made.
        status, made = await admin(two.url, "POST", "/admin/keys", {"id": "back", "admin": True})
        assert status == 201
        await within(WITHIN_S, lambda: _served(one.url, made["key"]))
        status, listed = await admin(one.url, "GET", "/admin/keys")
        assert listed["store"] == "redis" and [r["id"] for r in listed["data"] if r["source"] == "runtime"] == ["back"]
        for proc in running:
            assert made["key"] not in proc.stderr_text() and key not in proc.stderr_text()
    finally:
        for proc in running:
            await proc.stop()
        await engine.stop()
        client = redis_asyncio.Redis.from_url(REDIS_URL)
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def _served(url: str, key: str) -> bool:
    return (await ask(url, key))[0] == 200


async def _refused(url: str, key: str) -> bool:
    return (await ask(url, key))[0] == 401


@pytest.mark.parametrize("keys_file", [True, False], ids=["keys_file", "group_memory"])
async def test_workers_agree_on_keys_within_a_second(tmp_path, keys_file):
    engine = await FakeEngine(Knobs()).start()
    port = free_port()
    # Without a keys file the workers still share their keys (for as long as they run).
    auth = {"keys_file": str(tmp_path / "keys.json")} if keys_file else {}
    cfg = gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}], auth=auth)
    (tmp_path / "gw.toml").write_text(to_toml(cfg))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(tmp_path / "gw.toml"), "--port", str(port),
        "--workers", "2", cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http(url + "/readyz", 20.0)
        workers: set[str] = set()
        for _ in range(200):  # each worker's request-id prefix
            workers.add((await ask(url, USER_KEY))[1])
            if len(workers) == 2:
                break
        assert len(workers) == 2, "one worker answered every connection"
        status, made = await admin(url, "POST", "/admin/keys", {"id": "shared"})
        assert status == 201
        key, answered = made["key"], {}

        async def every_worker(status: int) -> bool:
            got, who = await ask(url, key)
            answered[who] = got
            return all(answered.get(w) == status for w in workers)

        await within(WITHIN_S, lambda: every_worker(200))  # both serve it (and so hold it as proven)
        status, _ = await admin(url, "DELETE", "/admin/keys/shared")
        assert status == 200
        answered.clear()
        await within(WITHIN_S, lambda: every_worker(401))
        assert (tmp_path / "keys.json").exists() == keys_file
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 15)
        await engine.stop()
        assert code == 0, f"serve --workers 2 exited with status {code}"
