"""Token quotas through the public API: a run-time key's day quota refused in OpenAI's and Anthropic's shapes with
its reset time, and what it used shown by /admin/keys, `shapegate keys list` and the dashboard's keys view."""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp
import openai
import pytest

from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, gateway_config, start_gateway

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
USED = 11  # the fake engine's usage of a request: 10 prompt tokens, max_tokens (1) completion tokens
QUOTA = 40


@pytest.fixture
async def engine():
    e = await FakeEngine(Knobs()).start()
    yield e
    await e.stop()


async def test_a_day_quota_of_a_run_time_key_is_refused_in_each_api_s_shape_and_listed_with_its_use(engine):
    gw = await start_gateway(gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}]))
    try:
        async with aiohttp.ClientSession(headers=ADMIN) as s:
            async with s.post(gw.url + "/admin/keys", json={"id": "team", "limits": {"tokens_per_day": QUOTA}}) as r:
                assert r.status == 201
                key = (await r.json())["key"]
            async with s.post(gw.url + "/admin/keys", json={"limits": {"tokens_per_day": 0}}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "limits.tokens_per_day"
        served = 0
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0) as c:
            with pytest.raises(openai.RateLimitError) as e:
                for _ in range(10):
                    await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=1)
                    served += 1
        assert QUOTA - USED < served * USED <= QUOTA + USED  # up to the quota: the last one reserved its estimate
        err = e.value
        assert err.body["code"] == "quota_exceeded" and err.body["type"] == "tokens"
        assert "resets at" in err.body["message"] and "T00:00:00Z" in err.body["message"]
        h = err.response.headers
        assert h["x-ratelimit-limit-tokens-day"] == str(QUOTA)
        assert h["x-ratelimit-remaining-tokens-day"] == str(QUOTA - served * USED)
        assert 1 <= int(h["retry-after"]) <= 120 and h["x-ratelimit-reset-tokens-day"].endswith("s")
        # Anthropic's Messages: the same refusal, in Anthropic's shape.
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/messages", headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
                              json={"model": "m1", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}) as r:
                body = await r.json()
                assert r.status == 429 and body["type"] == "error", body
                assert body["error"]["type"] == "rate_limit_error" and "Token quota reached" in body["error"]["message"]
                assert r.headers["x-ratelimit-limit-tokens-day"] == str(QUOTA)
        # Listed with what it used, never the key.
        async with aiohttp.ClientSession(headers=ADMIN) as s:
            async with s.get(gw.url + "/admin/keys") as r:
                rows = {k["id"]: k for k in (await r.json())["data"]}
            async with s.get(gw.url + "/dashboard/keys") as r:
                view = {k["id"]: k for k in (await r.json())["keys"]}
        for listed in (rows["team"], view["team"]):
            (q,) = listed["quotas"]
            assert (q["period"], q["model"], q["limit"], q["used"]) == ("day", None, QUOTA, served * USED)
            assert q["resets"].endswith("T00:00:00Z")
        assert rows["team"]["limits"]["tokens_per_day"] == QUOTA and rows["user"]["quotas"] == []
        env = {**os.environ, "SHAPEGATE_ADMIN_KEY": ADMIN_KEY, "SHAPEGATE_URL": gw.url}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway.cli", "keys", "list", env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, stderr
        line = next(li for li in stdout.decode().splitlines() if li.startswith("team "))
        assert f"tokens_per_day={QUOTA}" in line and f"day {served * USED}/{QUOTA}" in line
        assert key not in stdout.decode()
    finally:
        await gw.stop()
