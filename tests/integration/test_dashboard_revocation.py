"""Dashboard sessions on real gateways end with their key: revoked, replaced or demoted, on every replica and
worker at once; one signing secret per worker group; sign-ins throttled per client address."""

from __future__ import annotations

import asyncio
import secrets
import signal
import sys
import time
from http.cookies import SimpleCookie

import aiohttp
import orjson
import pytest
import redis.asyncio as redis_asyncio

from benchmarks.loopback import free_port, wait_http
from gateway.dashboard import COOKIE_NAME
from gateway.keys.principal import hash_key
from gateway.ops.reload import RELOADER
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.needs import REDIS_URL, redis_up, skip_or_fail
from tests.procs import ROOT, to_toml, workers_ready

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
WITHIN_S = 1.0  # a revocation holds on every process within this (the key store's own promise)
# What a signed-in browser reaches with its cookie (/stats needs some key besides: a user's one here).
COOKIE_ROUTES = ("/dashboard", "/dashboard/feed", "/stats", "/admin/experiments")
OPEN = [200] * 4
REFUSED = [401, 401, 403, 401]  # /stats: the user's key is valid, but it is no admin's


def fresh(local: str | None = None) -> aiohttp.ClientSession:
    """A session whose every request goes on a new connection (with workers, the kernel picks which one)."""
    connector = aiohttp.TCPConnector(force_close=True, local_addr=(local, 0) if local else None)
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())


async def sign_in(url: str, key: str, *, local: str | None = None, accept: str = "text/html",
                  headers: dict | None = None) -> tuple[int, str | None, dict[str, str], bytes]:
    """POST the sign-in form: (status, the session cookie's value if one was set, headers, body)."""
    async with fresh(local) as s, s.post(url + "/dashboard/login", data={"key": key}, allow_redirects=False,
                                         headers={"Accept": accept, **(headers or {})}) as r:
        body = await r.read()
        raw = r.headers.getall("Set-Cookie", [])
        token = SimpleCookie(raw[0])[COOKIE_NAME].value if raw else None
        return r.status, token, dict(r.headers), body


async def with_cookie(url: str, path: str, token: str) -> tuple[int, str]:
    """(status, answering process's request-id prefix) of one GET carrying the session cookie (and for /stats
    a user's key, which that route asks of everyone)."""
    headers = {"Cookie": f"{COOKIE_NAME}={token}", "Accept": "application/json"}
    if path == "/stats":
        headers["Authorization"] = f"Bearer {USER_KEY}"
    async with fresh() as s, s.get(url + path, headers=headers) as r:
        await r.read()
        return r.status, r.headers.get("x-request-id", "")[:12]


async def admin(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    async with fresh() as s, s.request(method, url + path, json=body, headers=ADMIN) as r:
        return r.status, orjson.loads(await r.read())


async def statuses(url: str, token: str) -> list[int]:
    return [(await with_cookie(url, p, token))[0] for p in COOKIE_ROUTES]


async def within(deadline_s: float, check) -> None:
    deadline = time.monotonic() + deadline_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {deadline_s} s"


@pytest.fixture
async def engine():
    e = await FakeEngine(Knobs()).start()
    yield e
    await e.stop()


def config(engine: FakeEngine, **sections) -> dict:
    return gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}], **sections)


async def test_a_revoked_or_replaced_keys_session_is_refused_at_once(engine):
    gw = await start_gateway(config(engine))
    try:
        _, made = await admin(gw.url, "POST", "/admin/keys", {"id": "temp-admin", "admin": True})
        status, token, _, _ = await sign_in(gw.url, made["key"])
        assert status == 303 and token
        assert await statuses(gw.url, token) == OPEN
        assert (await admin(gw.url, "DELETE", "/admin/keys/temp-admin"))[0] == 200
        assert await statuses(gw.url, token) == REFUSED  # the very next request: no 12 h of grace
        # Another key made under the same id later does not bring the old session back.
        _, again = await admin(gw.url, "POST", "/admin/keys", {"id": "temp-admin", "admin": True})
        assert await statuses(gw.url, token) == REFUSED
        status, token2, _, _ = await sign_in(gw.url, again["key"])
        assert status == 303 and await statuses(gw.url, token2) == OPEN
        # A run-time key that is no admin never gets a session.
        _, user = await admin(gw.url, "POST", "/admin/keys", {"id": "plain"})
        assert (await sign_in(gw.url, user["key"]))[:2] == (401, None)
    finally:
        await gw.stop()


async def test_a_reload_that_removes_or_demotes_a_configured_admin_ends_its_sessions(engine, tmp_path):
    path = tmp_path / "gw.toml"
    cfg = config(engine)
    cfg["auth"]["keys"] += [{"id": "ops2", "sha256": hash_key("sk-ops2"), "admin": True},
                            {"id": "ops3", "sha256": hash_key("sk-ops3"), "admin": True}]
    path.write_text(to_toml(cfg))
    gw = await start_gateway(cfg)
    gw.app[RELOADER].path = path
    try:
        tokens = {k: (await sign_in(gw.url, k))[1] for k in ("sk-ops2", "sk-ops3", ADMIN_KEY)}
        assert all(tokens.values())
        cfg["auth"]["keys"] = [k for k in cfg["auth"]["keys"] if k["id"] != "ops2"]  # removed
        cfg["auth"]["keys"][-1]["admin"] = False  # ops3 demoted
        path.write_text(to_toml(cfg))
        assert (await admin(gw.url, "POST", "/admin/reload"))[0] == 200
        assert await statuses(gw.url, tokens["sk-ops2"]) == REFUSED
        assert await statuses(gw.url, tokens["sk-ops3"]) == REFUSED
        assert await statuses(gw.url, tokens[ADMIN_KEY]) == OPEN
        async with fresh() as s, s.get(gw.url + "/dashboard/feed", headers={"x-api-key": "sk-ops2"}) as r:
            assert r.status == 401  # the removed key itself no longer opens the dashboard either
        assert (await sign_in(gw.url, "sk-ops2"))[0] == 401
    finally:
        await gw.stop()


async def test_replicas_refuse_a_revoked_keys_session_within_a_second(engine, monkeypatch):
    if not await redis_up():
        skip_or_fail("no redis-server answers on 127.0.0.1:6379 (.ci/run starts one)")
    monkeypatch.setenv("SHAPEGATE_TEST_DASH_SECRET", secrets.token_urlsafe(24))
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    cfg = config(engine, state={"backend": "redis", "key_prefix": prefix},
                 dashboard={"session_secret_env": "SHAPEGATE_TEST_DASH_SECRET"})
    one, two = await start_gateway(cfg), await start_gateway(cfg)
    try:
        _, made = await admin(one.url, "POST", "/admin/keys", {"id": "fleet-admin", "admin": True})
        await within(WITHIN_S, lambda: _admin_there(two.url, made["key"]))
        status, token, _, _ = await sign_in(two.url, made["key"])
        assert status == 303
        assert await statuses(one.url, token) == OPEN and await statuses(two.url, token) == OPEN
        assert (await admin(one.url, "DELETE", "/admin/keys/fleet-admin"))[0] == 200
        assert await statuses(one.url, token) == REFUSED
        await within(WITHIN_S, lambda: _refused(two.url, token))
        assert await statuses(two.url, token) == REFUSED
    finally:
        await one.stop()
        await two.stop()
        client = redis_asyncio.Redis.from_url(REDIS_URL)
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def _admin_there(url: str, key: str) -> bool:
    async with fresh() as s, s.get(url + "/stats", headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status == 200


async def _refused(url: str, token: str) -> bool:
    return (await with_cookie(url, "/dashboard/feed", token))[0] == 401


async def test_workers_share_one_session_secret_and_all_refuse_a_revoked_key(engine, tmp_path):
    port = free_port()
    (tmp_path / "gw.toml").write_text(to_toml(config(engine)))  # no session_secret_env
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(tmp_path / "gw.toml"), "--port", str(port),
        "--workers", "2", cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http(url + "/readyz", 20.0)
        workers = await workers_ready(url, 2)
        status, token, _, _ = await sign_in(url, ADMIN_KEY)
        assert status == 303
        answers = [await with_cookie(url, "/dashboard/feed", token) for _ in range(20)]
        assert [s for s, _ in answers] == [200] * 20  # whichever worker took the connection
        assert {w for _, w in answers} == workers, "one worker answered every connection"
        _, made = await admin(url, "POST", "/admin/keys", {"id": "group-admin", "admin": True})
        answered: dict[str, int] = {}
        session: list[str] = []

        async def signed_in() -> bool:  # on whichever worker: it may not have the new key yet
            status, token, _, _ = await sign_in(url, made["key"])
            session[:] = [token] if status == 303 and token else []
            return bool(session)

        async def every_worker(want: int) -> bool:
            got, who = await with_cookie(url, "/dashboard/feed", session[0])
            answered[who] = got
            return all(answered.get(w) == want for w in workers)

        await within(WITHIN_S, signed_in)
        await within(WITHIN_S * 2, lambda: every_worker(200))
        assert (await admin(url, "DELETE", "/admin/keys/group-admin"))[0] == 200
        answered.clear()
        await within(WITHIN_S, lambda: every_worker(401))
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 15)
        assert code == 0, f"serve --workers 2 exited with status {code}"


async def test_failed_sign_ins_are_throttled_per_client_address(engine):
    gw = await start_gateway(config(engine))
    try:
        for _ in range(10):
            assert (await sign_in(gw.url, "sk-a-guess"))[0] == 401
        status, token, headers, body = await sign_in(gw.url, "sk-another-guess", accept="application/json")
        assert status == 429 and token is None and 1 <= int(headers["Retry-After"]) <= 6
        err = orjson.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        # A browser gets the form again, saying why; the right key waits as well (waiting tells nothing).
        status, token, headers, body = await sign_in(gw.url, ADMIN_KEY)
        assert (status, token) == (429, None) and headers["Retry-After"]
        assert b'data-testid="login-error"' in body and b"Too many sign-in attempts" in body
        # The address is the front's own view of the connection: a header saying otherwise changes nothing.
        forged = {"x-shapegate-peer": "10.9.8.7", "X-Forwarded-For": "10.9.8.7"}
        assert (await sign_in(gw.url, ADMIN_KEY, headers=forged))[0] == 429
        # Another address is not held back; the admin key header is not a sign-in and is never throttled.
        status, token, _, _ = await sign_in(gw.url, ADMIN_KEY, local="127.0.0.2")
        assert status == 303 and token
        async with fresh() as s, s.get(gw.url + "/dashboard/feed", headers=ADMIN) as r:
            assert r.status == 200
    finally:
        await gw.stop()
