"""How each request ended reads the same in /metrics, /stats, the dashboard feed and the access log."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp
import openai
import orjson
import pytest

from benchmarks.loopback import free_port, wait_http
from tests import kit
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.integration.test_metrics import Scrape, scrape
from tests.procs import ROOT, to_toml
from tests.raw_engine import CONTENT, SSE_EVENTS, RawEngine, chunk, head

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TOO_LONG = (b'{"error":{"message":"This model\'s maximum context length is 4096 tokens.","type":"BadRequestError",'
            b'"param":null,"code":400}}')
OUTCOMES = ("ok", "client_left", "client_error", "engine_error")


async def get_json(url: str, path: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + path, headers=ADMIN) as r:
        assert r.status == 200, await r.text()
        return orjson.loads(await r.read())


def ask(client: openai.AsyncOpenAI, rid: str, model: str = "m1", **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                          extra_headers={"x-request-id": rid}, **kw)


async def leave_mid_stream(client: openai.AsyncOpenAI, rid: str) -> int:
    """Read two chunks of a long stream, then hang up; returns the chunks seen."""
    stream = await ask(client, rid, max_tokens=200, stream=True)
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 2:
            break
    await stream.close()
    return seen


def outcome_counts(m: Scrape, **labels: str) -> dict[str, float]:
    return {k: m.value("shapegate_requests_total", outcome=k, **labels) for k in OUTCOMES}


async def test_each_outcome_lands_alike_in_all_four_places(tmp_path):
    engine = await FakeEngine(Knobs(chunk_delay=0.02)).start()
    cfg = gateway_config([
        {"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]},
        {"id": "down", "engine": "vllm", "url": f"http://127.0.0.1:{free_port()}", "models": ["m2"]},
    ], server={"access_log": True}, stats={"window_s": 120.0})
    (tmp_path / "gw.toml").write_text(to_toml(cfg))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(tmp_path / "gw.toml"), "--port", str(port),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    out = asyncio.create_task(proc.stdout.read())
    try:
        await wait_http(url + "/readyz", 20.0)
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=USER_KEY, max_retries=0) as client:
            for i in range(3):
                stream = await ask(client, f"r-ok{i}", max_tokens=4, stream=True)
                assert len([c async for c in stream if c.choices and c.choices[0].delta.content]) == 4
            assert await leave_mid_stream(client, "r-left") == 2
            for _ in range(100):  # the gateway notices the hang-up on its next write
                if (await get_json(url, "/stats"))["totals"]["outcomes"]["client_left"]:
                    break
                await asyncio.sleep(0.05)
            engine.knobs.fail_status, engine.knobs.fail_body = 400, TOO_LONG
            with pytest.raises(openai.BadRequestError):
                await ask(client, "r-400", max_tokens=4)
            engine.knobs.fail_status, engine.knobs.fail_body = 500, Knobs().fail_body
            with pytest.raises(openai.APIStatusError) as failed:
                await ask(client, "r-500", max_tokens=4)
            assert failed.value.status_code >= 500
            with pytest.raises(openai.APIStatusError) as refused:  # m2's only backend never came up
                await ask(client, "r-refused", model="m2", max_tokens=4)
            assert refused.value.status_code == 503
        m = await scrape(url)
        stats = await get_json(url, "/stats")
        feed = await get_json(url, "/dashboard/feed")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        await engine.stop()
    lines = {x["request_id"]: x for x in map(orjson.loads, (await out).splitlines())}

    # The access log: the request's own ending, one line each.
    assert {rid: (x["outcome"], x["status"]) for rid, x in lines.items()} == {
        "r-ok0": ("ok", 200), "r-ok1": ("ok", 200), "r-ok2": ("ok", 200), "r-left": ("client_left", 499),
        "r-400": ("client_error", 400), "r-500": ("engine_error", lines["r-500"]["status"]),
        "r-refused": ("rejected", 503)}
    assert lines["r-500"]["status"] >= 500 and lines["r-refused"]["backend"] is None
    want = {"ok": 3, "client_left": 1, "client_error": 1, "engine_error": 1}
    # /metrics: the attempts on backend a by outcome, and the refusal with no backend.
    assert outcome_counts(m, backend="a") == want
    assert m.value("shapegate_requests_total", backend="a", status="400", outcome="client_error") == 1
    assert m.value("shapegate_requests_total", backend="a", status="499", outcome="client_left") == 1
    assert m.one("shapegate_requests_total", outcome="rejected") == 1
    assert m.value("shapegate_requests_total", backend="", model="m2", status="503", outcome="rejected") == 1
    # /stats and the dashboard feed: the same counts; only the engine's 500 is an error.
    for report in (stats, feed):
        a = next(b for b in report["backends"] if b["id"] == "a")
        assert a["overall"]["outcomes"] == want and report["totals"]["outcomes"] == want
        assert a["overall"]["error_rate"] == pytest.approx(1 / 6)
        assert report["totals"]["error_rate"] == pytest.approx(1 / 6)
        assert report["totals"]["rejected"] == 1
        assert sum(c["rejected"] for c in report["classes"].values()) == 1
        assert sum(c["outcomes"]["engine_error"] for c in report["classes"].values()) == 1
        assert a["failovers"] == m.value("shapegate_upstream_retries_total", backend="a")
        # Every routed request's reason, by class, as the routing-decision counter has them.
        assert sum(n for c in report["classes"].values() for n in c["reasons"].values()) == \
            m.value("shapegate_routing_decisions_total") == 6
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):  # percentiles of the three served streams
            assert 0 < a["overall"][key]["p50"] <= a["overall"][key]["p99"]
        assert report["workers"]["count"] == 1
    assert stats["backends"][0]["overall"]["ttft_ms"] == feed["backends"][0]["overall"]["ttft_ms"]


async def test_failovers_and_breaker_openings_per_backend():
    good, busy = await FakeEngine(Knobs()).start(), await FakeEngine(Knobs(fail_status=503, retry_after="30")).start()
    gw = await start_gateway(gateway_config([
        {"id": "good", "engine": "vllm", "url": good.url, "models": ["m1"]},
        {"id": "busy", "engine": "llamacpp", "url": busy.url, "models": ["m1"]},
    ], routing={"policy": "round_robin"}))
    try:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0) as client:
            for i in range(6):
                await ask(client, f"r{i}", max_tokens=3)  # an engine's 503 moves the request on, and opens at once
        stats = await get_json(gw.url, "/stats")
        feed = await get_json(gw.url, "/dashboard/feed")
        await asyncio.sleep(0.3)  # breaker openings reach /metrics with the 0.2 s pool refresh
        m = await scrape(gw.url)
    finally:
        await gw.stop()
        await good.stop()
        await busy.stop()
    for report in (stats, feed):
        rows = {b["id"]: b for b in report["backends"]}
        assert rows["busy"]["breaker"] == "open" and rows["busy"]["breaker_openings"] == 1
        assert rows["busy"]["failovers"] == rows["busy"]["overall"]["outcomes"]["engine_error"] == 1
        assert rows["good"]["overall"]["outcomes"]["ok"] == 6 and rows["good"]["breaker_openings"] == 0
        assert report["totals"]["failovers"] == 1 and report["totals"]["breaker_openings"] == 1
        assert report["classes"]["default"]["reasons"] == {"round_robin": 6}
    assert m.one("shapegate_breaker_openings_total", backend="busy") == 1
    assert m.value("shapegate_upstream_retries_total", backend="busy") == 1
    assert m.value("shapegate_requests_total", backend="busy", outcome="engine_error") == 1


async def _whole_stream_then_slow_end(w: asyncio.StreamWriter, stream: bool, engine: RawEngine) -> None:
    """Every event of a stream with the engine's usage and [DONE], then the end of the chunked body a while later
    (an engine that finishes its bookkeeping before it closes the body)."""
    usage = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],' \
            b'"usage":{"prompt_tokens":777,"completion_tokens":1,"total_tokens":778}}\n\n'
    events = [*SSE_EVENTS[:-1], usage, SSE_EVENTS[-1]]
    w.write(head(True, b"Transfer-Encoding: chunked") + b"".join(chunk(e) for e in events))
    await w.drain()
    await asyncio.sleep(1.0)
    w.write(b"0\r\n\r\n")
    await w.drain()


async def test_a_client_that_hangs_up_after_its_whole_stream_was_served():
    """The client's stream ended with [DONE] (the gateway ends its body there), the client hangs up while the
    engine's own end of body is still on its way: the request was served, and counts the engine's usage, not the
    gateway's estimate."""
    engine = await RawEngine().start()
    engine.set(_whole_stream_then_slow_end)
    gw = await start_gateway(gateway_config([{"id": "raw", "engine": "openai", "url": engine.url, "models": ["m"]}],
                                            usage={"flush_interval_s": 0.1}))
    try:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0) as client:
            stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                          stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == CONTENT

        async def counted() -> dict | None:
            report = await get_json(gw.url, "/admin/usage?by=api")
            return report if report["totals"]["requests"] == 1 else None

        report = await kit.until(counted, "the request in the ledger", timeout=10.0)
        totals = report["totals"]
        assert (totals["prompt_tokens"], totals["completion_tokens"], totals["errors"]) == (777, 1, 0)
        m = await scrape(gw.url)
        assert outcome_counts(m, backend="raw") == {"ok": 1, "client_left": 0, "client_error": 0, "engine_error": 0}
    finally:
        await gw.stop()
        await engine.stop()
