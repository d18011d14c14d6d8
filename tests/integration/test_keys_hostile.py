"""Run-time keys against careless and hostile input on real gateways: bounds, keys pasted as ids, ids a reload
would share, and a keys file in a place other users can write."""

from __future__ import annotations

import logging
import os

import aiohttp
import openai
import orjson
import pytest

from benchmarks.loopback import free_port
from gateway.config import MAX_MODEL_LIMITS, MAX_RPM, MAX_TPM
from gateway.keys import storage
from gateway.keys.principal import hash_key, new_key
from gateway.ops.reload import RELOADER
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.procs import shapegate, to_toml, write_config

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ERROR_FIELDS = {"message", "type", "param", "code"}


async def call(url: str, method: str, path: str, body: dict | bytes | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
    async with aiohttp.ClientSession() as s, s.request(method, url + path, data=data, headers=ADMIN) as r:
        return r.status, orjson.loads(await r.read())


async def chat(url: str, key: str) -> None:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0) as c:
        await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


@pytest.fixture
async def engine():
    e = await FakeEngine(Knobs()).start()
    yield e
    await e.stop()


def config(engine: FakeEngine, **sections) -> dict:
    return gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}], **sections)


async def test_limits_past_the_bounds_are_refused_and_the_listing_keeps_working(engine, monkeypatch):
    gw = await start_gateway(config(engine))
    try:
        models = {f"m{i}": {"rpm": 1} for i in range(MAX_MODEL_LIMITS + 1)}
        cases = [
            (f'{{"id": "huge", "limits": {{"rpm": {2**64}}}}}'.encode(), "limits.rpm"),
            (orjson.dumps({"id": "big", "limits": {"rpm": MAX_RPM + 1}}), "limits.rpm"),
            (orjson.dumps({"id": "big", "limits": {"tpm": MAX_TPM + 1}}), "limits.tpm"),
            (orjson.dumps({"id": "deep", "limits": {"models": {"m1": {"tpm": MAX_TPM + 1}}}}),
             "limits.models.m1.tpm"),
            (orjson.dumps({"id": "wide", "limits": {"models": models}}), "limits.models"),
            (orjson.dumps({"id": "long", "limits": {"models": {"m" * 257: {"rpm": 1}}}}), "limits.models"),
        ]
        for body, param in cases:
            status, err = await call(gw.url, "POST", "/admin/keys", body)
            assert (status, err["error"]["param"], err["error"]["code"]) == (400, param, "invalid_value"), body[:80]
            assert set(err["error"]) == ERROR_FIELDS
        status, made = await call(gw.url, "POST", "/admin/keys",
                                  {"id": "at-bound", "limits": {"rpm": MAX_RPM, "tpm": MAX_TPM}})
        assert status == 201
        await chat(gw.url, made["key"])
        status, listed = await call(gw.url, "GET", "/admin/keys")
        assert status == 200 and [r["id"] for r in listed["data"] if r["source"] == "runtime"] == ["at-bound"]
        # The number of run-time keys is bounded too (lowered here: the bound itself is 10000).
        monkeypatch.setattr(storage, "MAX_RUNTIME_KEYS", 2)
        assert (await call(gw.url, "POST", "/admin/keys", {"id": "second"}))[0] == 201
        status, err = await call(gw.url, "POST", "/admin/keys", {"id": "third"})
        assert (status, err["error"]["code"]) == (409, "too_many_keys") and "revoke" in err["error"]["message"]
        assert (await call(gw.url, "DELETE", "/admin/keys/second"))[0] == 200
        assert (await call(gw.url, "POST", "/admin/keys", {"id": "third"}))[0] == 201
    finally:
        await gw.stop()


async def test_a_key_pasted_as_an_id_is_refused_and_never_echoed_or_logged(engine, capfd, caplog):
    caplog.set_level(logging.DEBUG)
    gw = await start_gateway(config(engine, server={"access_log": True}))
    try:
        _, made = await call(gw.url, "POST", "/admin/keys", {"id": "real"})
        pasted = [made["key"], USER_KEY, new_key()]  # a run-time key, a configured one, one of ours not stored
        for key in pasted:
            for method, path, body in (("POST", "/admin/keys", {"id": key}),
                                       ("DELETE", f"/admin/keys/{key}", None)):
                status, err = await call(gw.url, method, path, body)
                assert (status, err["error"]["code"], err["error"]["param"]) == (400, "key_given_as_id", "id")
                assert key not in err["error"]["message"]
        status, listed = await call(gw.url, "GET", "/admin/keys")
        assert sorted(r["id"] for r in listed["data"]) == ["ops", "real", "user"]
        await chat(gw.url, made["key"])  # refusing to take it as an id revoked nothing
        gw.state.access_log.flush()
        out, err = capfd.readouterr()
        assert "not logged" in caplog.text
        for key in pasted:
            for text in (out, err, caplog.text):
                assert key not in text
    finally:
        await gw.stop()


async def test_a_reload_giving_a_run_time_keys_id_to_the_configuration_is_refused(engine, tmp_path, caplog):
    path = tmp_path / "gw.toml"
    cfg = config(engine)
    path.write_text(to_toml(cfg))
    gw = await start_gateway(cfg)
    gw.app[RELOADER].path = path
    try:
        _, made = await call(gw.url, "POST", "/admin/keys", {"id": "late", "admin": True})
        cfg["auth"]["keys"].append({"id": "late", "sha256": hash_key("sk-late-config")})
        path.write_text(to_toml(cfg))
        status, err = await call(gw.url, "POST", "/admin/reload")
        assert (status, err["error"]["code"]) == (400, "invalid_config")
        assert "'late'" in err["error"]["message"] and "run-time" in err["error"]["message"]
        assert "configuration reload refused, the running configuration stays" in caplog.text
        assert "'late' are held by run-time keys" in caplog.text
        with pytest.raises(openai.AuthenticationError):
            await chat(gw.url, "sk-late-config")  # the old configuration stays
        await chat(gw.url, made["key"])
        assert (await call(gw.url, "DELETE", "/admin/keys/late"))[0] == 200  # revocable, not a 409
        status, out = await call(gw.url, "POST", "/admin/reload")  # now the id is free
        assert status == 200 and out["reloaded"]
        await chat(gw.url, "sk-late-config")
        with pytest.raises(openai.AuthenticationError):
            await chat(gw.url, made["key"])
        status, err = await call(gw.url, "DELETE", "/admin/keys/late")
        assert (status, err["error"]["code"]) == (409, "key_in_config")
    finally:
        await gw.stop()


async def test_a_run_time_key_sharing_a_configured_id_can_still_be_revoked(engine, tmp_path):
    # Two gateways on one keys file, configured differently: the second made "shared", which the first has
    # in its configuration.
    keys_file = str(tmp_path / "keys.json")
    first = await start_gateway(config(engine, auth={"keys_file": keys_file, "keys": [
        {"id": "ops", "sha256": hash_key(ADMIN_KEY), "admin": True},
        {"id": "shared", "sha256": hash_key("sk-configured-shared")}]}))
    second = await start_gateway(config(engine, auth={"keys_file": keys_file}))
    try:
        status, made = await call(second.url, "POST", "/admin/keys", {"id": "shared"})
        assert status == 201
        await first.state.keys.refresh()
        await chat(first.url, made["key"])
        status, out = await call(first.url, "DELETE", "/admin/keys/shared")
        assert (status, out["deleted"]) == (200, True)
        await first.state.keys.refresh()
        with pytest.raises(openai.AuthenticationError):
            await chat(first.url, made["key"])
        await chat(first.url, "sk-configured-shared")  # the configured key of that id stays
        status, err = await call(first.url, "DELETE", "/admin/keys/shared")
        assert (status, err["error"]["code"]) == (409, "key_in_config")
    finally:
        await first.stop()
        await second.stop()


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_serve_refuses_a_keys_file_others_can_write_with_exit_2(tmp_path, workers):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    cfg = gateway_config([{"id": "a", "engine": "vllm", "url": "http://127.0.0.1:9", "models": ["m1"]}],
                         auth={"keys_file": str(shared / "keys.json")})
    path = write_config(tmp_path, cfg)
    code, out, err = await shapegate("serve", "--config", str(path), "--port", str(free_port()),
                                     "--workers", workers, timeout=30)
    assert code == 2, err
    assert f"directory {shared} can be written by other users" in err and "chmod go-w" in err
    assert "Traceback" not in err and not list(shared.iterdir())
