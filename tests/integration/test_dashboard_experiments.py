"""The dashboard's experiments section in a real browser: arms, verdicts, shadow copies; hidden without any."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, RunningGateway, gateway_config, start_gateway
from tests.integration.browser import FormLogin, open_page

pytestmark = pytest.mark.usefixtures("chromium")  # tests/integration/conftest.py: fails in CI without it

# Markup in a name the config accepts: the page must show it as text, never parse it.
SPLIT_MODEL = "m<b>1</b>"
SHADOW_MODEL = "s"
REQUESTS = 80  # u0..u79 split 41/39: both arms past the 30 a verdict needs
# Set by experiments.js each time a report arrives, shown or not.
REPORT_SEEN = "document.querySelector('[data-testid=\"experiments-at\"]').dataset.value"


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    # e0 streams five times faster than e1: arm a wins on ITL beyond doubt, even on a busy machine.
    es = [await FakeEngine(Knobs(chunk_delay=d)).start() for d in (0.004, 0.02, 0.004)]
    yield es
    for e in es:
        await e.stop()


def experiments_config(engines: list[FakeEngine]) -> dict:
    backends = [{"id": "e0", "engine": "vllm", "url": engines[0].url, "models": [SPLIT_MODEL, SHADOW_MODEL]},
                {"id": "e1", "engine": "vllm", "url": engines[1].url, "models": [SPLIT_MODEL]},
                {"id": "cand", "engine": "vllm", "url": engines[2].url, "models": [SHADOW_MODEL]}]
    return gateway_config(backends) | {"experiments": [
        {"name": "ab", "model": SPLIT_MODEL, "mode": "split", "subject": "user",
         "arms": [{"name": "a", "backends": ["e0"]}, {"name": "b", "backends": ["e1"]}]},
        {"name": "sh", "model": SHADOW_MODEL, "mode": "shadow", "subject": "user", "shadow_max_in_flight": 20,
         "arms": [{"name": "candidate", "backends": ["cand"]}]}]}


async def traffic(gw: RunningGateway) -> None:
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0) as client:
        async def one(i: int, model: str) -> None:
            stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=16, stream=True, temperature=0, user=f"u{i}")
            async for _ in stream:
                pass

        for start in range(0, REQUESTS, 10):
            await asyncio.gather(*(one(i, m) for i in range(start, start + 10) for m in (SPLIT_MODEL, SHADOW_MODEL)))


async def admin_report(gw: RunningGateway) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/admin/experiments", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert r.status == 200
            return {x["name"]: x for x in (await r.json())["data"]}


async def wait_for_copies(gw: RunningGateway) -> dict:
    """The report once every shadow copy has come back (they finish after the client's replies)."""
    for _ in range(100):  # the gateway recomputes its report at most every 2 s
        report = await admin_report(gw)
        shadow = report["sh"]["arms"][1]["shadow"]
        if shadow.get("sent", 0) >= REQUESTS and not shadow["in_flight"]:
            return report
        await asyncio.sleep(0.1)
    raise AssertionError(f"shadow copies never settled: {shadow}")


async def test_the_section_shows_each_experiment_its_arms_and_verdicts(engines) -> None:
    gw = await start_gateway(experiments_config(engines))
    try:
        await traffic(gw)
        report = await wait_for_copies(gw)
        async with open_page(width=1440, height=1000) as page:
            await page.authenticate(gw.url + "/dashboard", FormLogin(ADMIN_KEY))
            await page.wait_for(f"!!{REPORT_SEEN}")
            dom = await page.read()
            order = await page.evaluate("Array.from(document.querySelectorAll("
                                        "'[data-testid=\"verdicts:ab:all\"] li'), e => e.dataset.value)")
            markup = await page.evaluate("document.querySelector('[data-testid=\"experiments\"] b') === null")
            errors = list(page.errors)
    finally:
        await gw.stop()
    assert errors == []
    assert dom["experiments"]["hidden"] is False
    split = dom["experiment:ab"]["text"]
    assert split.startswith("ab") and f"model {SPLIT_MODEL}" in split and markup
    assert dom["experiment-state:ab"]["text"] == "running"
    counts = {a["name"]: a["classes"]["all"]["requests"] for a in report["ab"]["arms"]}
    assert sum(counts.values()) == REQUESTS
    for arm in ("a", "b"):
        assert dom[f"arm:ab:{arm}"]["text"].startswith(arm)
        assert float(dom[f"arm-share:ab:{arm}"]["value"]) == 0.5
        assert int(dom[f"arm-requests:ab:{arm}"]["value"]) == counts[arm]
    # Every comparison's sentence, as the gateway worded it, under its class; the decided ones on top.
    for c in report["ab"]["comparisons"]:
        shown = dom[f"verdict:ab:{c['class']}:{c['metric']}:b"]
        assert (shown["text"], shown["value"]) == (c["summary"], c["verdict"])
        # The median's and the tail's verdicts under the mean's.
        for stat, q in c["quantiles"].items():
            shown = dom[f"verdict:ab:{c['class']}:{c['metric']}:b:{stat}"]
            assert (shown["text"], shown["value"]) == (q["summary"], q["verdict"])
    assert set(report["ab"]["comparisons"][0]["quantiles"]) == {"p50", "p99"}
    assert "differences under 5% are none" in split
    assert dom["verdict:ab:all:itl:b"]["value"] == "a_better"
    assert dom["verdict:ab:all:itl:b"]["text"].startswith("arm a: ITL ")
    rank = {"a_better": 0, "b_better": 0, "no_difference": 1, "insufficient_data": 2}
    assert [rank[v] for v in order] == sorted(rank[v] for v in order) and order[0] == "a_better"
    # The shadow experiment: copies sent to the candidate and how often it said what the primary said.
    assert "shadow, copies of 100% of requests" in dom["experiment:sh"]["text"]
    assert int(dom["shadow-sent:sh:candidate"]["value"]) == report["sh"]["arms"][1]["shadow"]["sent"]
    assert int(dom["shadow-skipped:sh:candidate"]["value"]) == 0
    assert float(dom["agreement:sh:candidate"]["value"]) == 1.0
    assert f"{REQUESTS} of {REQUESTS} identical" in dom["agreement:sh:candidate"]["text"]


async def test_the_section_is_hidden_without_experiments(engines) -> None:
    gw = await start_gateway(gateway_config([{"id": "e0", "engine": "vllm", "url": engines[0].url,
                                              "models": ["m"]}]))
    try:
        async with open_page(width=1280, height=800) as page:
            await page.authenticate(gw.url + "/dashboard", FormLogin(ADMIN_KEY))
            await page.wait_for(f"!!{REPORT_SEEN}")  # the report came, with nothing in it
            dom = await page.read()
            errors = list(page.errors)
    finally:
        await gw.stop()
    assert errors == []
    assert dom["experiments"]["hidden"] is True
    assert dom["experiments-body"]["text"] == ""


async def test_an_arm_the_error_guard_stopped_says_so(engines) -> None:
    engines[1].knobs.fail_status = 500  # arm b's engine fails every request (its clients go on to arm a)
    cfg = experiments_config(engines)
    cfg["experiments"][0]["error_guard_min_requests"] = 20
    cfg["health"]["breaker_failures"] = 1_000_000  # the guard, not the breaker, takes the arm out
    gw = await start_gateway(cfg)
    try:
        await traffic(gw)
        (b,) = [a for a in (await admin_report(gw))["ab"]["arms"] if a["name"] == "b"]
        async with open_page(width=1440, height=1000) as page:
            await page.authenticate(gw.url + "/dashboard", FormLogin(ADMIN_KEY))
            await page.wait_for(f"!!{REPORT_SEEN}")
            dom = await page.read()
            errors = list(page.errors)
    finally:
        await gw.stop()
    assert errors == []
    assert b["guard"]["error_rate"] == 1.0 and b["share"] == 0
    assert dom["arm-guard:ab:b"]["text"] == "stopped" and "arm-guard:ab:a" not in dom
    assert float(dom["arm-share:ab:b"]["value"]) == 0
    line = dom["guard:ab:b"]["text"]
    assert line.startswith("arm b stopped by the error guard since ") and b["guard"]["reason"] in line
    assert line.endswith("shapegate ab start ab resumes it")
