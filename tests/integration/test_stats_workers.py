"""`serve --workers 2`: /stats and the dashboard feed show the whole process group, every request counted once."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp
import orjson

from benchmarks.loopback import free_port, wait_http
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config
from tests.procs import ROOT, to_toml, workers_ready

N = 40
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def fresh_get(url: str) -> tuple[str, dict]:
    """One GET on a new connection (the kernel picks the worker): the answering worker's id prefix and body."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.get(url, headers=ADMIN) as r:
            assert r.status == 200, await r.text()
            return r.headers["x-request-id"][:12], orjson.loads(await r.read())


async def test_stats_merge_every_worker_and_count_each_request_once(tmp_path):
    engine = await FakeEngine(Knobs(chunk_delay=0.002)).start()
    port = free_port()
    cfg = gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}])
    (tmp_path / "gw.toml").write_text(to_toml(cfg))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(tmp_path / "gw.toml"), "--port", str(port),
        "--workers", "2", cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http(url + "/readyz", 20.0)
        await workers_ready(url, 2, 10.0)
        served_by, body = set(), {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                  "stream": True}
        for i in range(N):  # a new connection each: the kernel spreads them over both workers
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                async with s.post(url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                    assert r.status == 200
                    await r.read()
                    served_by.add(r.headers["x-request-id"][:12])  # request ids start with a per-process prefix
        assert len(served_by) == 2, "one worker served every request"
        # Each worker publishes its summary every second; then any worker's answer holds both, once each.
        reports, answered_by = [], set()
        for _ in range(100):
            who, rep = await fresh_get(url + "/stats")
            if rep["totals"]["requests"] == N and rep["workers"]["count"] == 2:
                reports.append(rep)
                answered_by.add(who)
                if len(answered_by) == 2 and len(reports) >= 4:
                    break
            await asyncio.sleep(0.1)
        assert answered_by == served_by, "the merged view never came from both workers"
        _, feed = await fresh_get(url + "/dashboard/feed")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        await engine.stop()
    for rep in (*reports, feed):
        assert rep["scope"] == "group" and rep["workers"]["expected"] == 2
        assert rep["workers"]["count"] == 2 and rep["totals"]["requests"] == N
        (a,) = rep["backends"]
        assert a["overall"]["outcomes"] == {"ok": N, "client_left": 0, "client_error": 0, "engine_error": 0}
        assert a["overall"]["samples"] == N
        assert rep["classes"]["default"]["requests"] == N
        assert sum(rep["classes"]["default"]["reasons"].values()) == N
        assert a["views"] == {"health": {"ready": 2}, "breaker": {"closed": 2}}
        # Percentiles of the merged distributions (never averages of the workers' percentiles).
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert 0 < a["overall"][key]["p50"] <= a["overall"][key]["p90"] <= a["overall"][key]["p99"]
        workers = rep["workers"]["summaries"]
        assert len({w["worker"] for w in workers}) == 2
        assert all(0 <= w["age_s"] < 3 and w["taken_at"] <= rep["now"] for w in workers)
