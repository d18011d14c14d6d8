"""Split experiments through a real gateway: sticky arms, pinning, run-time ramps (also across replicas), reload."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid

import aiohttp
import openai
import pytest

from benchmarks.loopback import Proc, free_port
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway
from tests.procs import gateway_proc, to_toml, workers_ready

MODEL = "m"


def split_config(engines, weights=(50, 50), subject="user", **sections) -> dict:
    backends = [{"id": f"e{i}", "engine": "vllm", "url": e.url, "models": [MODEL]} for i, e in enumerate(engines)]
    experiment = {"name": "ab", "model": MODEL, "mode": "split", "subject": subject,
                  "arms": [{"name": "a", "backends": ["e0"], "weight": weights[0]},
                           {"name": "b", "backends": ["e1", "e2"], "weight": weights[1]}]}
    return gateway_config(backends, **sections) | {"experiments": [experiment]}


CLIENTS: list[openai.AsyncOpenAI] = []


def client(gw, key=USER_KEY) -> openai.AsyncOpenAI:
    """An OpenAI client closed by the `closing` fixture at the end of the test."""
    CLIENTS.append(openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0))
    return CLIENTS[-1]


@pytest.fixture(autouse=True)
async def closing():
    yield
    while CLIENTS:
        await CLIENTS.pop().close()


async def arm_of(c: openai.AsyncOpenAI, user: str | None, headers: dict | None = None) -> tuple[str, str]:
    raw = await c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        **({"user": user} if user else {}), extra_headers=headers or {})
    return raw.headers["x-shapegate-arm"], raw.headers["x-shapegate-backend"]


async def put(gw, name: str, change, key=ADMIN_KEY) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.put(f"{gw.url}/admin/experiments/{name}", json=change,
                         headers={"Authorization": f"Bearer {key}"}) as r:
            return r.status, await r.json()


async def get_report(gw) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/admin/experiments", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert r.status == 200
            return await r.json()


async def test_a_subject_keeps_its_arm_and_the_arm_serves_it(engines):
    gw = await start_gateway(split_config(engines))
    try:
        c = client(gw)
        seen: dict[str, set] = {}
        for round_ in range(3):
            for u in range(40):
                arm, backend = await arm_of(c, f"user-{u}")
                seen.setdefault(f"user-{u}", set()).add(arm)
                assert backend == "e0" if arm == "a" else backend in ("e1", "e2")
        assert all(len(arms) == 1 for arms in seen.values())  # sticky
        got_a = sum(arms == {"a"} for arms in seen.values())
        assert 8 <= got_a <= 32  # both arms get subjects at 50/50 (exact shares: tests/unit/test_experiments.py)
        # No subject: the request keeps to its session, else to its key ("user"), so a conversation never hops.
        arms = {(await arm_of(c, None))[0] for _ in range(30)}
        assert arms == {gw.state.experiments.by_name["ab"].assign("user").name}
        by_session = {s: {(await arm_of(c, None, {"x-session-id": s}))[0] for _ in range(3)} for s in "pqrstuvwxyz"}
        assert all(len(arms) == 1 for arms in by_session.values())
        assert set().union(*by_session.values()) == {"a", "b"}
    finally:
        await gw.stop()


async def test_only_an_admin_may_pin_an_arm(engines):
    gw = await start_gateway(split_config(engines, weights=(1, 0)))
    try:
        arm, backend = await arm_of(client(gw, ADMIN_KEY), "u1", {"x-shapegate-arm": "b"})
        assert arm == "b" and backend in ("e1", "e2")
        with pytest.raises(openai.PermissionDeniedError) as e:
            await arm_of(client(gw), "u1", {"x-shapegate-arm": "b"})
        assert e.value.body["code"] == "permission_denied"
        with pytest.raises(openai.BadRequestError) as e:
            await arm_of(client(gw, ADMIN_KEY), "u1", {"x-shapegate-arm": "nope"})
        assert e.value.body["code"] == "unknown_arm"
    finally:
        await gw.stop()


async def test_a_ramp_takes_effect_at_once_and_bad_changes_change_nothing(engines):
    gw = await start_gateway(split_config(engines, weights=(100, 0)))
    try:
        c = client(gw)
        assert {(await arm_of(c, f"u{i}"))[0] for i in range(20)} == {"a"}
        status, body = await put(gw, "ab", {"weights": {"a": 0, "b": 1}})
        assert status == 200 and body["weights"] == {"a": 0.0, "b": 1.0}
        assert {(await arm_of(c, f"u{i}"))[0] for i in range(20)} == {"b"}
        for bad in ({"weights": {"a": 0, "b": 0}}, {"weights": {"a": -1}}, {"weights": {"zzz": 1}},
                    {"weights": {"a": "x"}}, {"enabled": "no"}, {"colour": 1}, [], {"fraction": 0.5}):
            status, body = await put(gw, "ab", bad)
            assert status == 400, bad
            assert set(body["error"]) == {"message", "type", "param", "code"}
        assert {(await arm_of(c, f"u{i}"))[0] for i in range(20)} == {"b"}  # unchanged
        status, body = await put(gw, "ab", {"weights": {"a": 1}}, key=USER_KEY)
        assert status == 403
        status, body = await put(gw, "nope", {"enabled": False})
        assert status == 404 and body["error"]["code"] == "experiment_not_found"
        # Stopped: the model is routed as if there were no experiment, and replies carry no arm.
        status, _ = await put(gw, "ab", {"enabled": False})
        raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                                max_tokens=2, user="u1")
        assert status == 200 and "x-shapegate-arm" not in raw.headers
    finally:
        await gw.stop()


async def test_a_ramp_reaches_another_replica_through_redis_within_a_second(engines):
    state = {"backend": "redis", "key_prefix": f"test-{uuid.uuid4().hex[:8]}:"}
    gws = [await start_gateway(split_config(engines, weights=(100, 0), state=state)) for _ in range(2)]
    try:
        status, body = await put(gws[0], "ab", {"weights": {"a": 0, "b": 100}})
        assert status == 200 and body["shared"] is True
        t0 = time.monotonic()
        c = client(gws[1])

        async def all_b():
            return {(await arm_of(c, f"u{i}"))[0] for i in range(5)} == {"b"}

        while not await all_b():
            assert time.monotonic() - t0 < 1.0, "the other replica did not adopt the change within 1 s"
            await asyncio.sleep(0.05)
        # Each replica's verdicts count every replica's requests (samples are exchanged every few seconds).
        served = sum(len(e.knobs.seen) for e in engines)
        t0 = time.monotonic()
        while True:
            x = (await get_report(gws[0]))["data"][0]
            if sum(a["classes"].get("all", {}).get("requests", 0) for a in x["arms"]) == served:
                break
            assert time.monotonic() - t0 < 10.0, "replica 0 never saw replica 1's samples"
            await asyncio.sleep(0.2)
        assert x["processes"] == 2
    finally:
        for g in gws:
            await g.stop()


async def test_verdicts_in_the_admin_report(engines):
    gw = await start_gateway(split_config(engines))
    try:
        c = client(gw)
        for i in range(60):
            stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=5, stream=True, user=f"u{i}")
            async for _ in stream:
                pass
        # A request's figures are recorded just after its last byte went out: poll for the sixtieth.
        t0 = time.monotonic()
        while True:
            (x,) = (await get_report(gw))["data"]
            n_a, n_b = (a["classes"].get("all", {}).get("requests", 0) for a in x["arms"])
            if n_a + n_b == 60:
                break
            assert time.monotonic() - t0 < 10, (n_a, n_b)
            await asyncio.sleep(0.1)
        assert x["name"] == "ab" and x["mode"] == "split" and [a["name"] for a in x["arms"]] == ["a", "b"]
        comp = next(c for c in x["comparisons"] if c["class"] == "all" and c["metric"] == "ttft")
        assert {"class", "metric", "arms", "ratio", "ci_low", "ci_high", "noise_floor", "n", "verdict"} <= set(comp)
        assert comp["n"] == {"a": n_a, "b": n_b}
        assert comp["verdict"] in ("a_better", "b_better", "no_difference", "insufficient_data")
        # A user key may not read it.
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/admin/experiments", headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                assert r.status == 403
    finally:
        await gw.stop()


async def test_another_gateway_process_gives_every_subject_the_same_arm(engines, tmp_path):
    cfg = split_config(engines, weights=(30, 70))
    path = tmp_path / "gw.toml"
    path.write_text(to_toml(cfg))
    inproc = await start_gateway(cfg)
    other = await gateway_proc(path, log=tmp_path / "gw.log").start()
    try:
        a, b = client(inproc), client(other)
        for u in range(40):
            assert (await arm_of(a, f"s{u}"))[0] == (await arm_of(b, f"s{u}"))[0]
    finally:
        await inproc.stop()
        await other.stop()


async def test_a_ramp_reaches_every_worker_of_one_process_group(engines, tmp_path):
    path = tmp_path / "gw.toml"
    path.write_text(to_toml(split_config(engines, weights=(100, 0))))
    port = free_port()
    gw = Proc([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port),
               "--workers", "2"], port, "/readyz", tmp_path / "gw.log")
    await gw.start()
    try:
        await workers_ready(gw.url, 2)  # a worker not yet ready would answer 503, without an arm
        status, body = await put(gw, "ab", {"weights": {"a": 0, "b": 1}})
        assert status == 200
        t0 = time.monotonic()
        # New connections: the kernel spreads them over both workers.
        while True:
            arms = set()
            for i in range(12):
                async with aiohttp.ClientSession() as s:
                    async with s.post(gw.url + "/v1/chat/completions", json={
                            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                            "user": f"u{i}"}, headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                        assert r.status == 200, await r.text()
                        arms.add(r.headers["x-shapegate-arm"])
            if arms == {"b"}:
                break
            assert time.monotonic() - t0 < 2.0, f"still {arms} after 2 s"
            await asyncio.sleep(0.05)
    finally:
        await gw.stop()


async def test_a_reload_keeps_a_running_experiments_samples(engines, tmp_path):
    cfg = split_config(engines)
    path = tmp_path / "gw.toml"
    path.write_text(to_toml(cfg))
    gw = await gateway_proc(path, log=tmp_path / "gw.log").start()
    try:
        c = client(gw)
        for i in range(10):
            await arm_of(c, f"u{i}")
        cfg["experiments"][0]["arms"][0]["weight"] = 10  # a weight changed in the file: samples still comparable
        path.write_text(to_toml(cfg))
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/admin/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
                assert r.status == 200, await r.text()
        x = (await get_report(gw))["data"][0]
        assert sum(a["classes"]["all"]["requests"] for a in x["arms"]) == 10
        assert x["arms"][0]["weight"] == 10
    finally:
        await gw.stop()
