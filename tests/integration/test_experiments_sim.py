"""Split experiments in front of simulated engines: identical arms read no difference, the error guard stops a
failing arm, a request without the subject keeps to its session."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.sim.runner import SimOptions, SimServer, start_sim
from tests.gateway_harness import ADMIN_KEY, USER_KEY, RunningGateway, gateway_config, start_gateway
from tests.procs import set_faults

MODEL = "m"
# The simulated MI350X vLLM: tens of ms per request, so timer and loop jitter on a busy machine stay small
# beside the modelled times (the tiny test profiles run in a few ms, where they would not).
PROFILE = "mi350x-vllm"


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    servers = [await start_sim(SimOptions(engine="vllm", model=MODEL, profile=PROFILE, seed=i)) for i in range(2)]
    yield servers
    for s in servers:
        await s.close()


def config(sims: list[SimServer], **experiment) -> dict:
    backends = [{"id": f"e{i}", "engine": "vllm", "url": s.url, "models": [MODEL]} for i, s in enumerate(sims)]
    x = {"name": "ab", "model": MODEL, "subject": "header:x-end-user",
         "arms": [{"name": "a", "backends": ["e0"]}, {"name": "b", "backends": ["e1"]}], **experiment}
    # Round robin outside the experiment (the warm-up); a breaker that never opens keeps a failing engine in its
    # arm, so that the error guard, not the breaker, is what takes it out of the traffic.
    return gateway_config(backends, routing={"policy": "round_robin"}, health={"breaker_failures": 1_000_000}) \
        | {"experiments": [x]}


async def chat(http: aiohttp.ClientSession, gw: RunningGateway, headers: dict[str, str]) -> tuple[str, str]:
    """One streamed request: (the arm that served it, its backend)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
            "stream": True, "ignore_eos": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers.get("x-shapegate-arm", ""), r.headers["x-shapegate-backend"]


async def load(http: aiohttp.ClientSession, gw: RunningGateway, users: range, concurrency: int = 16) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            await chat(http, gw, {"x-end-user": f"user-{i}"})

    await asyncio.gather(*(one(i) for i in users))


async def report(gw: RunningGateway, settled: int | None = None) -> dict:
    """The experiment's report; with `settled`, once that many requests are recorded (just after each reply)."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as s:
        while True:
            async with s.get(gw.url + "/admin/experiments") as r:
                assert r.status == 200
                (x,) = (await r.json())["data"]
            if settled is None or sum(a["classes"].get("all", {}).get("requests", 0) for a in x["arms"]) >= settled:
                return x
            assert time.monotonic() - t0 < 10, "the requests were never all recorded"
            await asyncio.sleep(2.1)  # the report is cached for 2 s


async def put(gw: RunningGateway, change: dict) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.put(f"{gw.url}/admin/experiments/ab", json=change,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {USER_KEY}"},
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


async def test_identical_simulated_arms_read_no_difference(sims, http):
    gw = await start_gateway(config(sims, enabled=False))
    try:
        # Each engine's first requests (connections, caches) go in before the experiment counts anything.
        await load(http, gw, range(-16, 0))
        await put(gw, {"enabled": True})
        await load(http, gw, range(600))
        x = await report(gw, settled=600)
    finally:
        await gw.stop()
    every = [c for c in x["comparisons"] if c["class"] == "all"]
    assert {c["metric"] for c in every} == {"ttft", "itl", "e2e", "output_tps", "error_rate"}
    for c in every:
        assert c["verdict"] == "no_difference", c
        for q in c["quantiles"].values():
            # About 300 per arm: enough for the median, not for a p99 verdict (it waits for 1,000).
            expected = {"p50": {"no_difference"}, "p99": {"insufficient_data"}}[q["stat"]]
            assert q["verdict"] in expected, q
    assert x["practical_margin"] == 0.05 and all(a["guard"] is None for a in x["arms"])


async def test_the_error_guard_stops_a_failing_arm_and_a_start_resumes_it(sims, http, caplog):
    caplog.set_level(logging.INFO, logger="shapegate.experiments")
    await set_faults(sims[1].url, error_rate=0.5)
    gw = await start_gateway(config(sims, error_guard_min_requests=20))
    x = gw.state.experiments.by_name["ab"]
    try:
        # Half of arm b's requests fail on its engine and go on to arm a's (before their first byte): the clients
        # see no error, the guard sees b's engine errors.
        for start in range(0, 400, 40):
            await load(http, gw, range(start, start + 40))
            if x.guard.stopped:
                break
        assert "b" in x.guard.stopped, "the guard never stopped the failing arm"
        report_x = await report(gw)
        b = next(a for a in report_x["arms"] if a["name"] == "b")
        assert b["share"] == 0 and b["serving"] is False and b["weight"] == 1.0
        assert b["guard"]["against"] == "a" and b["guard"]["error_rate"] > 0.25 and b["guard"]["processes"] == 1
        assert "engine errors over its last" in b["guard"]["reason"]
        assert any("arm b stopped by the error guard" in r.getMessage() for r in caplog.records)
        # Every subject is served by arm a now, those of arm b included.
        served = {await chat(http, gw, {"x-end-user": f"user-{i}"}) for i in range(1000, 1030)}
        assert served == {("a", "e0")}
        # Fixed, and started again: the stop is lifted and b's subjects come back to it.
        await set_faults(sims[1].url, error_rate=0.0)
        await put(gw, {"enabled": True})
        assert not x.guard.stopped
        served = {await chat(http, gw, {"x-end-user": f"user-{i}"}) for i in range(1000, 1030)}
        assert served == {("a", "e0"), ("b", "e1")}
        assert any("stops lifted" in r.getMessage() for r in caplog.records)
    finally:
        await gw.stop()


async def test_a_request_without_the_subject_keeps_to_its_session_then_its_key(sims, http):
    gw = await start_gateway(config(sims))
    x = gw.state.experiments.by_name["ab"]
    try:
        # The case: subject x-end-user, a conversation that never sends it but has a session id.
        sessions = [f"s-{i}" for i in range(6)]
        for session in sessions:
            served = {await chat(http, gw, {"x-session-id": session}) for _ in range(5)}
            arm = x.assign(session).name
            assert served == {(arm, "e0" if arm == "a" else "e1")}, session
        assert {x.assign(s).name for s in sessions} == {"a", "b"}  # and the sessions do not all share one arm
        # Neither subject nor session: the key's arm, every time.
        served = {await chat(http, gw, {}) for _ in range(10)}
        assert {arm for arm, _ in served} == {x.assign("user").name}
    finally:
        await gw.stop()
