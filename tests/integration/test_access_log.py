"""Access log: one JSON line per request on stdout of a real gateway process, and never the API key."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import aiohttp
import orjson

from benchmarks.loopback import free_port, wait_http
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config
from tests.procs import ROOT, to_toml

FIELDS = {"ts", "request_id", "principal", "route", "model", "class", "backend", "reason", "status", "outcome", "stream",
          "ttft_ms", "itl_ms", "e2e_ms", "prompt_tokens", "completion_tokens", "experiment", "arm"}


async def post(s: aiohttp.ClientSession, url: str, rid: str, body: dict | bytes) -> int:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with s.post(url + "/v1/chat/completions", data=data,
                      headers={"Authorization": f"Bearer {USER_KEY}", "x-request-id": rid}) as r:
        await r.read()
        return r.status


def chat(model: str = "m1", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}


async def test_one_line_per_request_with_its_outcome(tmp_path):
    a, b = await FakeEngine(Knobs()).start(), await FakeEngine(Knobs()).start()
    slow = await FakeEngine(Knobs(chunk_delay=0.2, stream_chunks=20)).start()
    cfg = gateway_config([
        {"id": "a", "engine": "vllm", "url": a.url, "models": ["m1"]},
        {"id": "b", "engine": "sglang", "url": b.url, "models": ["m1"]},
        {"id": "slow", "engine": "llamacpp", "url": slow.url, "models": ["m2"]},
    ], server={"access_log": True}, routing={"policy": "round_robin"})
    (tmp_path / "gw.toml").write_text(to_toml(cfg))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(tmp_path / "gw.toml"), "--port", str(port),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = asyncio.create_task(proc.stdout.read()), asyncio.create_task(proc.stderr.read())
    try:
        await wait_http(url + "/readyz", 20.0)
        async with aiohttp.ClientSession() as s:
            assert await post(s, url, "r-stream", chat(stream=True, stream_options={"include_usage": True})) == 200
            assert await post(s, url, "r-plain", chat()) == 200
            assert await post(s, url, "r-nomodel", chat("nope")) == 404
            assert await post(s, url, "r-badjson", b"{not json") == 400
            a.knobs.fail_status, a.knobs.retry_after = 503, "30"  # overloaded: the next request moves on to b
            assert [await post(s, url, f"r-fo{i}", chat()) for i in range(2)] == [200, 200]
            async with s.post(url + "/v1/chat/completions", data=orjson.dumps(chat("m2", stream=True)),
                              headers={"Authorization": f"Bearer {USER_KEY}", "x-request-id": "r-left"}) as r:
                await r.content.readline()  # the stream has started; then the client hangs up
            async with s.get(url + "/metrics") as r:  # not a model request: no line
                assert r.status == 200
            deadline = time.monotonic() + 5
            while True:  # until the gateway noticed the hang-up (its metrics count the request as client_left)
                async with s.get(url + "/metrics") as r:
                    if b'outcome="client_left"' in await r.read():
                        break
                assert time.monotonic() < deadline, "the hang-up was never noticed"
                await asyncio.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        for e in (a, b, slow):
            await e.stop()
    stdout, stderr = await out, await err
    for key in (USER_KEY, ADMIN_KEY):
        assert key.encode() not in stdout and key.encode() not in stderr
    lines = [orjson.loads(x) for x in stdout.splitlines()]
    by_id = {x["request_id"]: x for x in lines}
    assert len(by_id) == len(lines) == 7  # exactly one line each, failovers included
    assert all(set(x) == FIELDS for x in lines)
    assert all(x["principal"] == "user" for x in lines)
    assert {x["route"] for x in lines} == {"chat"}
    times = [x[k] for x in lines for k in ("ts", "ttft_ms", "itl_ms", "e2e_ms") if x[k] is not None]
    assert all(len(repr(t).partition(".")[2]) <= 3 for t in times)  # milliseconds to 3 decimals (microseconds)
    assert all(abs(x["ts"] - time.time()) < 60 for x in lines)

    st = by_id["r-stream"]
    assert (st["status"], st["model"], st["class"], st["stream"]) == (200, "m1", "default", True)
    assert st["backend"] in ("a", "b") and st["reason"] == "round_robin"
    assert 0 < st["ttft_ms"] <= st["e2e_ms"] and st["itl_ms"] is not None
    assert (st["prompt_tokens"], st["completion_tokens"]) == (10, 4)
    plain = by_id["r-plain"]
    assert plain["status"] == 200 and plain["stream"] is False and plain["ttft_ms"] is None
    assert plain["e2e_ms"] > 0 and plain["completion_tokens"] == 4
    assert by_id["r-nomodel"]["status"] == 404 and by_id["r-nomodel"]["model"] == "nope"
    assert by_id["r-nomodel"]["backend"] is None
    assert by_id["r-badjson"]["status"] == 400 and by_id["r-badjson"]["model"] is None
    moved = [by_id[f"r-fo{i}"] for i in range(2)]
    assert all(x["status"] == 200 and x["backend"] == "b" for x in moved)
    assert any("failover from a" in x["reason"] for x in moved)
    left = by_id["r-left"]
    assert (left["status"], left["backend"], left["model"]) == (499, "slow", "m2")
