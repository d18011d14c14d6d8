"""`shapegate ab` as a process against a real gateway: the experiments table, --json, one-line refusals, and
set / stop / start."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from benchmarks.loopback import free_port
from gateway.sim.runner import SimOptions, start_sim
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, RunningGateway, gateway_config, start_gateway
from tests.procs import shapegate

REQUESTS = 80  # u0..u79 split 41/39: both arms past the 30 samples a verdict needs


async def ab(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`shapegate ab ARGS`, as an installed console script runs it: (exit status, stdout, stderr)."""
    return await shapegate("ab", *args, env=env)


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    # e0 streams five times faster than e1: arm a wins on ITL beyond doubt, even on a busy machine.
    engines = [await FakeEngine(Knobs(chunk_delay=d)).start() for d in (0.004, 0.02)]
    backends = [{"id": f"e{i}", "engine": "vllm", "url": e.url, "models": ["m"]} for i, e in enumerate(engines)]
    gateway = await start_gateway(gateway_config(backends) | {"experiments": [
        {"name": "ab", "model": "m", "mode": "split", "subject": "user",
         "arms": [{"name": "a", "backends": ["e0"]}, {"name": "b", "backends": ["e1"]}]}]})
    try:
        yield gateway
    finally:
        await gateway.stop()
        for e in engines:
            await e.stop()


async def traffic(gw: RunningGateway) -> None:
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0) as client:
        async def one(i: int) -> None:
            stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=16, stream=True, user=f"u{i}")
            async for _ in stream:
                pass

        for start in range(0, REQUESTS, 10):
            await asyncio.gather(*(one(i) for i in range(start, start + 10)))


async def admin_report(gw: RunningGateway) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/admin/experiments", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert r.status == 200
            return await r.json()


async def test_the_table_shows_the_experiment_its_arms_and_verdicts(gw) -> None:
    await traffic(gw)
    (x,) = (await admin_report(gw))["data"]
    status, out, err = await ab("--url", gw.url + "/", "--key", ADMIN_KEY)
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "experiment ab: model m, split, subject user, running (version 0)"
    assert lines[1].split() == ["arm", "share", "requests", "errors", "backends"]
    for arm, line in zip(x["arms"], lines[2:4]):
        assert line.split() == [arm["name"], "50%", str(arm["classes"]["all"]["requests"]), "0", arm["backends"][0]]
    # One row per comparison, in the gateway's order, ending with its plain-language sentence.
    classes = {c["class"] for c in x["comparisons"]}
    rows = [line for line in lines if line.split()[:1] and line.split()[0] in classes]
    assert len(rows) == len(x["comparisons"]) > 0
    for c, row in zip(x["comparisons"], rows):
        assert row.endswith(c["summary"]) and f"a={c['n']['a']} b={c['n']['b']}" in row
    itl = next(row for row in rows if row.split()[:2] == ["all", "ITL"])
    assert " a better " in itl and "arm a: ITL" in itl
    assert lines[-1].startswith("  ratio: the second arm's mean over the first's")

    # --json: the gateway's own report; the key may come from the environment rather than the command line.
    status, out, err = await ab("--url", gw.url, "--experiment", "ab", "--json", env={"SHAPEGATE_ADMIN_KEY": ADMIN_KEY})
    assert (status, err) == (0, "")
    assert json.loads(out)["data"] == [x]

    status, out, err = await ab("--url", gw.url, "--key", ADMIN_KEY, "--experiment", "nope")
    assert (status, out) == (2, "")
    assert err == f"shapegate: no experiment named 'nope' on {gw.url} (experiments: ab)\n"


async def test_refusals_are_one_line_exit_2_and_never_show_the_key(gw) -> None:
    wrong = "sk-not-a-key-of-this-gateway"
    cases = {
        wrong: f"shapegate: {gw.url} refused the admin key (HTTP 401): Invalid or missing API key.\n",
        USER_KEY: f"shapegate: {gw.url} refused the admin key (HTTP 403): This route needs an admin API key.\n",
    }
    for key, expected in cases.items():
        status, out, err = await ab("--url", gw.url, "--key", key)
        assert (status, out, err) == (2, "", expected)
        assert key not in err

    dead = f"http://127.0.0.1:{free_port()}"
    refused = f"shapegate: cannot connect to {dead}: Connection refused\n"
    assert await ab("--url", dead, "--key", ADMIN_KEY) == (2, "", refused)
    # Accepted by the kernel, never answered: the timeout, not a hang.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        assert await ab("--url", url, "--key", ADMIN_KEY, "--timeout", "0.5") == (
            2, "", f"shapegate: no answer from {url} within 0.5 s\n")
    status, out, err = await ab("--url", gw.url, env={"SHAPEGATE_ADMIN_KEY": ""})
    assert (status, out) == (2, "") and err.startswith("shapegate: an admin key is needed")


@pytest.fixture
async def sim_gw() -> AsyncIterator[RunningGateway]:
    """A gateway in front of two simulated engines, one per arm."""
    sims = [await start_sim(SimOptions(engine="vllm", model="m", seed=i)) for i in range(2)]
    backends = [{"id": f"e{i}", "engine": "vllm", "url": e.url, "models": ["m"]} for i, e in enumerate(sims)]
    gateway = await start_gateway(gateway_config(backends) | {"experiments": [
        {"name": "ab", "model": "m", "mode": "split", "subject": "user",
         "arms": [{"name": "a", "backends": ["e0"]}, {"name": "b", "backends": ["e1"]}]}]})
    try:
        yield gateway
    finally:
        await gateway.stop()
        for s in sims:
            await s.close()


async def arms_serving(gw: RunningGateway) -> set[str]:
    """The arms 20 subjects are served by ("" when the experiment is stopped: replies name no arm)."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {USER_KEY}"}) as s:
        arms = set()
        for i in range(20):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": f"u{i}"}
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                arms.add(r.headers.get("x-shapegate-arm", ""))
        return arms


async def test_set_stop_and_start_change_a_running_gateway(sim_gw) -> None:
    gw, key = sim_gw, ("--key", ADMIN_KEY)
    status, out, err = await ab("set", "ab", "--weights", "a=0,b=1", "--url", gw.url, *key)
    assert (status, err) == (0, "")
    assert re.fullmatch(r"experiment ab: running; weights a 0 \(0%\), b 1 \(100%\) \(version \d+\)\n", out), out
    assert await arms_serving(gw) == {"b"}
    (x,) = (await admin_report(gw))["data"]
    assert [(a["weight"], a["share"]) for a in x["arms"]] == [(0.0, 0.0), (1.0, 1.0)]

    # The connection options may come before the action as well as after it.
    status, out, err = await ab("--url", gw.url, *key, "stop", "ab")
    assert (status, err) == (0, "") and out.startswith("experiment ab: stopped (its model routed as if")
    assert await arms_serving(gw) == {""}
    status, out, err = await ab("start", "ab", "--url", gw.url, "--json", *key)
    assert (status, err) == (0, "")
    assert {k: v for k, v in json.loads(out).items() if k in ("name", "enabled", "weights")} == {
        "name": "ab", "enabled": True, "weights": {"a": 0.0, "b": 1.0}}
    assert await arms_serving(gw) == {"b"}
    status, out, err = await ab("set", "ab", "--weights", "a=1,b=3", "--url", gw.url, *key)
    assert status == 0 and "weights a 1 (25%), b 3 (75%)" in out
    assert await arms_serving(gw) == {"a", "b"}

    # The gateway's refusal, in its own words: exit 1, nothing changed.
    status, out, err = await ab("set", "ab", "--weights", "zz=1", "--url", gw.url, *key)
    assert (status, out) == (1, "")
    assert err == f"shapegate: {gw.url} made no change (HTTP 400): No change made: unknown arm 'zz'; arms: a, b.\n"
    status, out, err = await ab("stop", "nope", "--url", gw.url, *key)
    assert (status, out) == (1, "")
    assert err == f"shapegate: {gw.url} made no change (HTTP 404): No experiment named 'nope'.\n"
    status, out, err = await ab("set", "ab", "--url", gw.url, *key)
    assert (status, out) == (2, "") and err.startswith("shapegate: nothing to set")
    status, out, err = await ab("stop", "ab", "--url", gw.url, "--key", USER_KEY)
    assert (status, out) == (2, "") and "refused the admin key (HTTP 403)" in err
    status, out, err = await ab("set", "ab", "--weights", "a=x", "--url", gw.url, *key)
    assert status == 2 and "expected ARM=WEIGHT pairs" in err
    (x,) = (await admin_report(gw))["data"]
    assert x["enabled"] and [a["weight"] for a in x["arms"]] == [1.0, 3.0]
