"""/admin/keys on real gateways: make, use, list and revoke keys; bad requests; the file; reload; the CLI."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal

import aiohttp
import openai
import orjson
import pytest

from benchmarks.loopback import free_port
from gateway.config import KeyLimits
from gateway.keys.principal import hash_key
from gateway.ops.reload import RELOADER
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.kit import until
from tests.needs import skip_or_fail
from tests.procs import shapegate, to_toml

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ERROR_FIELDS = {"message", "type", "param", "code"}


async def call(url: str, method: str, path: str, body: dict | bytes | None = None,
               headers: dict | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
    async with aiohttp.ClientSession() as s, \
            s.request(method, url + path, data=data, headers=ADMIN if headers is None else headers) as r:
        return r.status, orjson.loads(await r.read()), dict(r.headers)


async def chat(url: str, key: str) -> str:
    """The id of the principal that served one request; raises openai's errors."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0) as c:
        r = await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].message.content
        return r.id


async def listing(url: str) -> list[dict]:
    """What GET /admin/keys lists, without when keys were last used (which using them changes)."""
    status, got, _ = await call(url, "GET", "/admin/keys")
    assert status == 200
    return [{k: v for k, v in row.items() if k != "last_used"} for row in got["data"]]


@pytest.fixture
async def engine():
    e = await FakeEngine(Knobs()).start()
    yield e
    await e.stop()


def config(engine: FakeEngine, **sections) -> dict:
    return gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}], **sections)


async def test_make_use_list_and_revoke_a_key_which_never_shows_again(engine, capfd, caplog):
    caplog.set_level(logging.DEBUG)
    gw = await start_gateway(config(engine, server={"access_log": True}))
    try:
        limits = {"rpm": 5, "models": {"m1": {"tpm": 100}}}
        status, made, headers = await call(gw.url, "POST", "/admin/keys", {"id": "team-x", "limits": limits})
        assert status == 201 and headers["Cache-Control"] == "no-store"
        key = made["key"]
        assert made["id"] == "team-x" and made["admin"] is False and made["created"] > 0
        none = {"tokens_per_day": None, "tokens_per_month": None}
        assert made["limits"] == {"rpm": 5, "tpm": None, **none, "models": {"m1": {"rpm": None, "tpm": 100, **none}}}
        await chat(gw.url, key)
        # The principal the limits module reads carries the key's own limits.
        assert gw.state.auth.principal_for_key(key).limits == KeyLimits.model_validate(limits)
        status, listed, _ = await call(gw.url, "GET", "/admin/keys")
        assert status == 200 and listed["store"] == "memory"
        rows = {r["id"]: r for r in listed["data"]}
        assert {(i, r["source"], r["admin"]) for i, r in rows.items()} == {
            ("user", "config", False), ("ops", "config", True), ("team-x", "runtime", False)}
        assert rows["team-x"]["last_used"] >= made["created"] and rows["team-x"]["created"] == made["created"]
        status, gone, _ = await call(gw.url, "DELETE", "/admin/keys/team-x")
        assert (status, gone) == (200, {"object": "api_key", "id": "team-x", "deleted": True})
        with pytest.raises(openai.AuthenticationError):
            await chat(gw.url, key)
        assert "team-x" not in {r["id"] for r in (await call(gw.url, "GET", "/admin/keys"))[1]["data"]}
        await chat(gw.url, USER_KEY)
        gw.state.access_log.flush()
        out, err = capfd.readouterr()
        lines = [orjson.loads(x) for x in out.splitlines() if x.startswith("{")]
        assert [(x["principal"], x["status"]) for x in lines] == [("team-x", 200), (None, 401), ("user", 200)]
        for text in (out, err, caplog.text, orjson.dumps(listed).decode()):
            assert key not in text and hash_key(key) not in text
        assert "team-x" in caplog.text  # the id is what the log names
    finally:
        await gw.stop()


async def test_bad_requests_are_refused_in_the_openai_shape_and_change_nothing(engine):
    gw = await start_gateway(config(engine))
    try:
        assert (await call(gw.url, "POST", "/admin/keys", {"id": "exists"}))[0] == 201
        before = await listing(gw.url)
        cases = [
            ({"id": "exists"}, 409, "id", "key_exists"),
            ({"id": "ops"}, 409, "id", "key_exists"),  # a configured key's id
            ({"limits": {"rpm": 0}}, 400, "limits.rpm", "invalid_value"),
            ({"limits": {"models": {"m1": {"tpm": -3}}}}, 400, "limits.models.m1.tpm", "invalid_value"),
            ({"limits": {"rpm": "5"}}, 400, "limits.rpm", "invalid_value"),
            ({"admin": "yes"}, 400, "admin", "invalid_value"),
            ({"id": "has space"}, 400, "id", "invalid_value"),
            ({"id": "x" * 65}, 400, "id", "invalid_value"),
            ({"sha256": "0" * 64}, 400, "sha256", "invalid_value"),
            (b"{not json", 400, None, "invalid_json"),
            (b"[]", 400, None, "invalid_value"),
        ]
        for body, status, param, code in cases:
            got, err, _ = await call(gw.url, "POST", "/admin/keys", body)
            assert (got, err["error"]["param"], err["error"]["code"]) == (status, param, code), body
            assert set(err["error"]) == ERROR_FIELDS and err["error"]["message"]
        got, err, _ = await call(gw.url, "DELETE", "/admin/keys/nobody")
        assert (got, err["error"]["code"]) == (404, "key_not_found")
        got, err, _ = await call(gw.url, "DELETE", "/admin/keys/user")
        assert (got, err["error"]["code"]) == (409, "key_in_config") and "configuration" in err["error"]["message"]
        await chat(gw.url, USER_KEY)  # the configured key still works
        assert await listing(gw.url) == before
        # Admin routes: no key 401, a user's key 403, all OpenAI-shaped.
        for method, path in (("GET", "/admin/keys"), ("POST", "/admin/keys"), ("DELETE", "/admin/keys/exists")):
            for headers, status, kind in (({}, 401, "authentication_error"),
                                          ({"Authorization": f"Bearer {USER_KEY}"}, 403, "permission_error")):
                got, err, _ = await call(gw.url, method, path, b"{}" if method == "POST" else None, headers)
                assert (got, err["error"]["type"]) == (status, kind) and set(err["error"]) == ERROR_FIELDS
        assert await listing(gw.url) == before
    finally:
        await gw.stop()


async def test_a_run_time_admin_key_may_make_keys(engine):
    gw = await start_gateway(config(engine))
    try:
        _, made, _ = await call(gw.url, "POST", "/admin/keys", {"admin": True})
        status, other, _ = await call(gw.url, "POST", "/admin/keys", {},
                                      {"Authorization": f"Bearer {made['key']}"})
        assert status == 201 and other["id"] != made["id"] and other["id"].startswith("key-")
        await chat(gw.url, other["key"])
    finally:
        await gw.stop()


async def test_keys_file_survives_a_restart(engine, tmp_path):
    path = tmp_path / "keys.json"
    cfg = config(engine, auth={"keys_file": str(path)})
    gw = await start_gateway(cfg)
    try:
        _, made, _ = await call(gw.url, "POST", "/admin/keys", {"id": "kept", "limits": {"tpm": 50}})
        assert (await call(gw.url, "GET", "/admin/keys"))[1]["store"] == "file"
        await chat(gw.url, made["key"])
    finally:
        await gw.stop()
    text = path.read_text()
    assert hash_key(made["key"]) in text and made["key"] not in text
    gw = await start_gateway(cfg)
    try:
        await chat(gw.url, made["key"])
        rows = {r["id"]: r for r in (await call(gw.url, "GET", "/admin/keys"))[1]["data"]}
        assert rows["kept"]["created"] == made["created"] and rows["kept"]["limits"]["tpm"] == 50
        assert rows["kept"]["last_used"] is not None
    finally:
        await gw.stop()


async def test_a_reload_keeps_run_time_keys(engine, tmp_path):
    path = tmp_path / "gw.toml"
    cfg = config(engine)
    path.write_text(to_toml(cfg))
    gw = await start_gateway(cfg)
    gw.app[RELOADER].path = path
    try:
        _, made, _ = await call(gw.url, "POST", "/admin/keys", {"id": "survivor"})
        await chat(gw.url, made["key"])
        cfg["auth"]["keys"].append({"id": "late", "sha256": hash_key("sk-late")})
        path.write_text(to_toml(cfg))
        status, out, _ = await call(gw.url, "POST", "/admin/reload")
        assert status == 200 and out["reloaded"]
        await chat(gw.url, made["key"])
        await chat(gw.url, "sk-late")
        assert {r["id"] for r in (await call(gw.url, "GET", "/admin/keys"))[1]["data"]} == {
            "user", "ops", "late", "survivor"}
        assert (await call(gw.url, "DELETE", "/admin/keys/survivor"))[0] == 200
        with pytest.raises(openai.AuthenticationError):
            await chat(gw.url, made["key"])
    finally:
        await gw.stop()


async def keys_cli(*args: str, admin_key: str | None = ADMIN_KEY) -> tuple[int, str, str]:
    """`shapegate keys ARGS` with the admin key in its environment, or none there."""
    return await shapegate("keys", *args, unset=("SHAPEGATE_ADMIN_KEY",),
                           env=None if admin_key is None else {"SHAPEGATE_ADMIN_KEY": admin_key})


async def test_the_cli_makes_lists_and_revokes_keys(engine):
    gw = await start_gateway(config(engine))
    try:
        code, out, err = await keys_cli("create", "--url", gw.url, "--id", "cli-1", "--rpm", "7")
        assert code == 0, err
        fields = dict(line.split(":", 1) for line in out.splitlines())
        key = fields["key"].strip()
        assert fields["id"].strip() == "cli-1" and fields["limits"].strip() == "rpm=7"
        assert "cannot show it again" in err
        await chat(gw.url, key)
        code, out, err = await keys_cli("list", "--url", gw.url)
        assert code == 0 and key not in out and hash_key(key) not in out
        row = next(line.split() for line in out.splitlines() if line.startswith("cli-1"))
        assert row[:4] == ["cli-1", "runtime", "no", "rpm=7"]
        code, out, _ = await keys_cli("list", "--url", gw.url, "--json")
        assert {r["id"] for r in orjson.loads(out)["data"]} == {"user", "ops", "cli-1"}
        assert (await keys_cli("revoke", "--url", gw.url, "cli-1"))[:2] == (0, "revoked cli-1\n")
        code, _, err = await keys_cli("revoke", "--url", gw.url, "cli-1")
        assert code == 1 and "HTTP 404" in err and "No run-time key" in err
        code, _, err = await keys_cli("create", "--url", gw.url, "--id", "ops")
        assert code == 1 and "HTTP 409" in err
        code, _, err = await keys_cli("list", "--url", gw.url, admin_key=USER_KEY)
        assert code == 2 and "refused the admin key" in err
        code, _, err = await keys_cli("list", "--url", gw.url, admin_key=None)
        assert code == 2 and "SHAPEGATE_ADMIN_KEY" in err
        code, _, err = await keys_cli("list", "--url", f"http://127.0.0.1:{free_port()}")
        assert code == 2 and "cannot connect to" in err
        with pytest.raises(openai.AuthenticationError):
            await chat(gw.url, key)
    finally:
        await gw.stop()


async def test_with_redis_down_known_keys_work_and_changes_fail_with_503(engine, tmp_path):
    server = shutil.which("redis-server")
    if server is None:
        skip_or_fail("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    redis = await asyncio.create_subprocess_exec(
        server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(tmp_path), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    gw = None
    try:
        state = {"backend": "redis", "redis_url": f"redis://127.0.0.1:{port}/0", "redis_timeout_s": 0.5}

        async def redis_answers() -> bool:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            w.close()
            return True

        await until(redis_answers)
        gw = await start_gateway(config(engine, state=state))
        _, made, _ = await call(gw.url, "POST", "/admin/keys", {"id": "before-outage"})
        await chat(gw.url, made["key"])
        redis.send_signal(signal.SIGKILL)
        await redis.wait()
        await chat(gw.url, made["key"])  # from the last loaded set
        await chat(gw.url, USER_KEY)
        for method, path, body in (("POST", "/admin/keys", {"id": "during-outage"}),
                                   ("DELETE", "/admin/keys/before-outage", None)):
            status, err, headers = await call(gw.url, method, path, body)
            assert (status, err["error"]["code"]) == (503, "key_store_unavailable") and headers["Retry-After"]
        await chat(gw.url, made["key"])  # the failed revoke changed nothing, locally either
        status, listed, _ = await call(gw.url, "GET", "/admin/keys")
        assert status == 200 and "before-outage" in {r["id"] for r in listed["data"]}
    finally:
        if gw is not None:
            await gw.stop()
        if redis.returncode is None:
            redis.kill()
            await redis.wait()
