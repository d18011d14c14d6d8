"""What an operator reads is true: serve's start and stop lines and an engine's health changes in the real process's
stderr, run-time keys kept beside the configuration across a restart (or in memory when asked), no traceback when a
command's output pipe closes, and the dashboard's sign-in hint for run-time admin keys."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import aiohttp

from benchmarks.loopback import ROOT
from gateway.keys.principal import hash_key
from tests.fake_engine import FakeEngine
from tests.gateway_harness import ADMIN_KEY, gateway_config, start_gateway
from tests.procs import gateway_proc, shapegate, write_config

ADMIN = {"keys": [{"id": "ops", "sha256": hash_key(ADMIN_KEY), "admin": True}]}
FAST_HEALTH = {"interval_s": 0.1, "timeout_s": 1.0, "warmup": False, "unhealthy_threshold": 2,
               "backoff_max_s": 0.2}


def _config(tmp_path, engine: FakeEngine, **extra):
    return write_config(tmp_path, {"auth": ADMIN, "health": FAST_HEALTH, "server": {"shutdown_grace_s": 2.0},
                                   "backends": [{"id": "vllm-0", "engine": "vllm", "url": engine.url,
                                                 "models": ["m"]}], **extra})


async def _wait_for(proc, pattern: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = proc.stderr_text()
        if re.search(pattern, text, re.M):
            return text
        await asyncio.sleep(0.05)
    raise AssertionError(f"{pattern!r} not in the log:\n{proc.stderr_text()}")


async def _admin(url: str, method: str, path: str, **kw):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **kw) as r:
            return r.status, await r.json(content_type=None)


async def test_serve_logs_start_health_changes_and_stop_and_keeps_run_time_keys_beside_its_config(tmp_path):
    engine = await FakeEngine().start()
    path = _config(tmp_path, engine)
    keys_file = tmp_path / "gw.keys.json"
    gw = gateway_proc(path, log=tmp_path / "serve.log")
    try:
        await gw.start()
        text = await _wait_for(gw, r"is now ready")
        start = next(line for line in text.splitlines() if "shapegate listening on" in line)
        assert " INFO " in start and f"http://127.0.0.1:{gw.port}" in start
        assert f"vllm-0 (vllm at {engine.url}: m)" in start and "routing policy shape" in start
        assert f"run-time keys are kept in {keys_file}" in start
        # A failing engine is a WARNING; its recovery is news at INFO.
        engine.knobs.health_status = 503
        text = await _wait_for(gw, r"WARNING .*backend vllm-0 \(vllm at .*\) is now unhealthy")
        engine.knobs.health_status = 200
        text = await _wait_for(gw, r"INFO .*backend vllm-0 is now ready", timeout=15)
        # A run-time key is kept in the file beside the configuration and answers after a restart.
        status, made = await _admin(gw.url, "POST", "/admin/keys", json={"id": "team-b"})
        assert status in (200, 201), made
        assert keys_file.exists() and made["key"] not in keys_file.read_text()  # digests only
        assert await gw.stop() == 0
        text = gw.stderr_text()
        assert re.search(r"INFO .*shutting down \(SIGTERM\): no new connections, /readyz answers 503; draining 0 "
                         r"request\(s\) in flight \(0 stream\(s\)\) for up to 2\.0 s", text), text
        assert re.search(r"INFO .*stopped after \d+\.\d s: 0 request\(s\) drained, 0 stream\(s\) cut", text), text
        await gw.start()
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {made['key']}"}) as r:
                assert r.status == 200
    finally:
        await gw.stop()
        await engine.stop()
    assert "Traceback" not in gw.stderr_text()


async def test_ephemeral_keys_stay_in_memory_and_an_unsafe_place_is_refused(tmp_path):
    engine = await FakeEngine().start()
    path = _config(tmp_path, engine)
    gw = gateway_proc(path, log=tmp_path / "serve.log")
    gw.argv.append("--ephemeral-keys")
    try:
        await gw.start()
        text = await _wait_for(gw, r"shapegate listening on")
        assert "run-time keys are kept in memory only (--ephemeral-keys)" in text
        status, _ = await _admin(gw.url, "POST", "/admin/keys", json={"id": "team-b"})
        assert status in (200, 201)
        assert not (tmp_path / "gw.keys.json").exists()
    finally:
        await gw.stop()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # any local user could plant a keys file here
    path = _config(shared, engine)
    try:
        status, out, err = await shapegate("serve", "--config", str(path), "--port", "0")
    finally:
        await engine.stop()
    assert status == 2 and out == "" and "Traceback" not in err
    assert err.startswith("shapegate: ") and str(shared) in err and "--ephemeral-keys" in err
    assert "[auth] keys_file" in err and len(err.splitlines()) == 1


def test_no_traceback_when_the_output_pipe_closes(tmp_path):
    path = write_config(tmp_path, {"auth": {"enabled": False}, "backends": [
        {"id": f"b{i}", "engine": "vllm", "url": "http://127.0.0.1:1", "models": ["m"]} for i in range(40)]})
    for args in (["check", "--config", str(path), "--timeout", "1"], ["keys", "new"], ["--help"]):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the command writes a line (as `| head -1` is, soon after)
        proc = subprocess.run([sys.executable, "-m", "gateway.cli", *args], stdout=write, stderr=subprocess.PIPE,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
        os.close(write)
        err = proc.stderr.decode()
        assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, (args, err)


async def test_the_sign_in_page_names_run_time_admin_keys_and_one_signs_in(tmp_path):
    engine = await FakeEngine().start()
    g = await start_gateway(gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m"]}]))
    try:
        status, made = await _admin(g.url, "POST", "/admin/keys", json={"id": "night-ops", "admin": True})
        assert status in (200, 201), made
        async with aiohttp.ClientSession() as s:
            async with s.get(g.url + "/dashboard", headers={"Accept": "text/html"}) as r:
                page = await r.text()
            assert "shapegate keys create --admin" in page and "[[auth.keys]]" in page
            async with s.post(g.url + "/dashboard/login", data={"key": made["key"]}, allow_redirects=False) as r:
                assert r.status == 303, await r.text()
    finally:
        await g.stop()
        await engine.stop()

