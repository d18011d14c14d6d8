"""Two replicas on one Redis in which someone else writes bad values: each replica keeps serving and routing as
before while a value is there, and is back where it was within one sync period of its removal."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import openai
import orjson

from gateway.ops.replica_sync import LATENCY_EVERY_S, TICK_S
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config
from tests.integration.replicas_kit import (ADMIN, MODEL, Replicas, backend, chat, drop_keys, get_json, metric,
                                            new_prefix, redis_client, until)
from tests.procs import to_toml

BREAKER = "shapegate_backend_breaker"
SLACK_S = 1.0  # polling, a request through the gateway and a loaded machine on top of a sync period


async def status(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url, headers=ADMIN) as r:
        await r.read()
        return r.status


async def logged(procs, *texts: str) -> bool:
    """Whether every process has logged every one of `texts`."""
    return all(text in p.stderr_text() for p in procs for text in texts)


async def feeds_answer(*procs) -> None:
    """/stats (both scopes) and /dashboard/feed answer 200 on every replica."""
    for p in procs:
        for path in ("/stats", "/stats?scope=replicas", "/dashboard/feed"):
            assert await status(p.url + path) == 200, (p.url, path)


async def test_a_breaker_held_open_for_a_billion_seconds_is_cut_short_and_ends_with_its_entry(tmp_path):
    client = await redis_client()
    prefix = new_prefix()
    engines = [await FakeEngine(Knobs()).start() for _ in range(2)]
    replicas = Replicas(tmp_path, [backend(f"e{i}", e) for i, e in enumerate(engines)], prefix,
                        routing={"policy": "round_robin"}, health={"interval_s": 60.0, "healthy_threshold": 1})
    try:
        a, b = await replicas.start(), await replicas.start()
        entry = {"by": "elsewhere/1", "n": 1, "at": time.time(), "hold_s": 1e9}
        await client.hset(prefix + "breakers", "e0", orjson.dumps(entry))

        async def held(open_: float) -> bool:
            return all([await metric(p, BREAKER, backend="e0", state="open") == open_ for p in (a, b)])

        await until(lambda: held(1.0), "both replicas hold e0 open")
        # Held for the longest this gateway holds a breaker itself (an engine's Retry-After, capped), no longer.
        holds = [[float(s) for s in re.findall(r"breaker of e0 held open for ([0-9.]+) s", p.stderr_text())]
                 for p in (a, b)]
        assert all(len(h) == 1 and 110.0 < h[0] <= 120.0 for h in holds), holds
        for p in (a, b):
            assert {(await chat(p, f"held {i}"))[0] for i in range(4)} == {"e1"}
        await feeds_answer(a, b)

        await client.hdel(prefix + "breakers", "e0")
        t0 = time.monotonic()
        await until(lambda: held(0.0), "both replicas let e0 take requests again")
        assert time.monotonic() - t0 < TICK_S + SLACK_S
        for p in (a, b):
            assert {(await chat(p, f"after {i}"))[0] for i in range(4)} == {"e0", "e1"}
        assert [await metric(p, BREAKER, backend="e0", state="closed") for p in (a, b)] == [1.0, 1.0]
    finally:
        await replicas.stop()
        for e in engines:
            await e.stop()
        await drop_keys(client, prefix)
        await client.aclose()


def scaled(entry: dict, backend_id: str, factor: float, every_sum: bool) -> dict:
    """One backend's part of a latency entry, its latencies (or every sum, and its requests) scaled."""
    e = entry["b"][backend_id]
    if every_sum:
        e = {**e, "f": [v * factor for v in e["f"]], "s": [v * factor for v in e["s"]], "n": int(e["n"] * factor)}
    else:  # the right-hand sides only: the same requests, each `factor` times slower
        e = {**e, "f": [*e["f"][:25], *(v * factor for v in e["f"][25:])], "s": [e["s"][0], e["s"][1] * factor]}
    return {"t": time.time(), "b": {backend_id: e}}


async def fits(p) -> dict[str, dict]:
    return {r["id"]: r["model"] for r in (await get_json(p.url + "/stats"))["backends"]}


async def test_latency_sums_scaled_ten_million_times_neither_turn_routing_nor_outlive_their_removal(tmp_path):
    client = await redis_client()
    prefix = new_prefix()
    slow = await FakeEngine(Knobs(ttft_s=0.01, token_s=0.02)).start()
    fast = await FakeEngine(Knobs(ttft_s=0.01, token_s=0.001)).start()
    replicas = Replicas(tmp_path, [backend("slow", slow), backend("fast", fast)], prefix,
                        stats={"warmup_samples": 0})
    key = prefix + "latency"
    try:
        a, b = await replicas.start(), await replicas.start()
        for i in range(12):
            for p in (a, b):
                await chat(p, f"question {i}", max_tokens=24, stream=True)

        async def published() -> dict | None:  # both replicas' entries, one of them with both engines measured
            rows = [orjson.loads(raw) for raw in (await client.hgetall(key)).values()]
            both = [r for r in rows if all(r["b"].get(bid, {}).get("n", 0) >= 2 for bid in ("slow", "fast"))]
            return both[0] if len(rows) == 2 and both else None

        entry = await until(published, "both replicas published what they learned")
        for p in (a, b):
            assert (await chat(p, "write a long story", max_tokens=600))[0] == "fast"

        # `fast` ten million times slower by its sums: left out by both (its fit would leave any engine's).
        await client.hset(key, "elsewhere/1", orjson.dumps(scaled(entry, "fast", 1e7, every_sum=False)))
        await until(lambda: logged((a, b), "not taking the latency entry of 'elsewhere/1' for fast"),
                    "both replicas refused the entry")
        for p in (a, b):
            served, reason = await chat(p, "write a long story", max_tokens=600)
            assert served == "fast" and reason.startswith("shape:long_output"), reason
            fit = await fits(p)
            assert fit["slow"]["itl_a_ms"] > 5 * fit["fast"]["itl_a_ms"]
        await feeds_answer(a, b)
        await client.hdel(key, "elsewhere/1")

        # Every sum ten million times: the same figures, so taken, at ten million times the weight...
        samples = {p: (await fits(p))["fast"]["samples"] for p in (a, b)}
        await client.hset(key, "elsewhere/2", orjson.dumps(scaled(entry, "fast", 1e7, every_sum=True)))

        async def heavy(p) -> bool:
            return (await fits(p))["fast"]["samples"] > 1e6

        await until(lambda: _all(heavy, (a, b)), "both replicas took the heavy entry")
        for p in (a, b):
            assert (await chat(p, "write a long story", max_tokens=600))[0] == "fast"
        # ...and gone with the entry within one latency round: each replica is back on what it learned itself.
        await client.hdel(key, "elsewhere/2")
        t0 = time.monotonic()

        async def light(p) -> bool:
            return (await fits(p))["fast"]["samples"] <= samples[p] + 30

        await until(lambda: _all(light, (a, b)), "both replicas dropped what the entry gave")
        assert time.monotonic() - t0 < LATENCY_EVERY_S + SLACK_S
        for p in (a, b):
            assert (await chat(p, "write a long story", max_tokens=600))[0] == "fast"
    finally:
        await replicas.stop()
        await slow.stop()
        await fast.stop()
        await drop_keys(client, prefix)
        await client.aclose()


def weighted(entry: dict, backend_id: str, weight: float, factor: float) -> dict:
    """One backend's part of a latency entry: its requests and weights times `weight`, latencies times `factor`."""
    e = entry["b"][backend_id]
    f = [v * weight for v in e["f"][:25]] + [v * weight * factor for v in e["f"][25:]]
    e = {**e, "f": f, "s": [e["s"][0] * weight, e["s"][1] * weight * factor], "n": int(e["n"] * weight)}
    return {"t": time.time(), "b": {backend_id: e}}


async def test_entries_each_within_bounds_move_a_fit_no_further_in_total_than_one_may(tmp_path):
    client = await redis_client()
    prefix = new_prefix()
    slow = await FakeEngine(Knobs(ttft_s=0.01, token_s=0.02)).start()
    fast = await FakeEngine(Knobs(ttft_s=0.01, token_s=0.001)).start()
    replicas = Replicas(tmp_path, [backend("slow", slow), backend("fast", fast)], prefix,
                        stats={"warmup_samples": 0})
    key = prefix + "latency"
    try:
        a, b = await replicas.start(), await replicas.start()
        for i in range(12):
            for p in (a, b):
                await chat(p, f"question {i}", max_tokens=24, stream=True)

        async def published() -> dict | None:
            rows = [orjson.loads(raw) for raw in (await client.hgetall(key)).values()]
            both = [r for r in rows if all(r["b"].get(bid, {}).get("n", 0) >= 2 for bid in ("slow", "fast"))]
            return both[0] if len(rows) == 2 and both else None

        entry = await until(published, "both replicas published what they learned")
        await asyncio.sleep(LATENCY_EVERY_S + SLACK_S)  # each folded the other's in
        before = {p: (await fits(p))["fast"]["itl_a_ms"] for p in (a, b)}
        gap = {p: (await fits(p))["slow"]["itl_a_ms"] / before[p] for p in (a, b)}  # 20 unless the machine is busy
        # Three entries 2 s apart, each outweighing all before it at 8 times the last one's latencies: each moves
        # the fit about 8 times from where it stands; together 8, 64, then 512 times.
        for i, (weight, factor) in enumerate(((100, 8), (10_000, 64), (1_000_000, 512))):
            await client.hset(key, f"elsewhere/{i}", orjson.dumps(weighted(entry, "fast", weight, factor)))
            await asyncio.sleep(LATENCY_EVERY_S)
        await asyncio.sleep(SLACK_S)
        for p in (a, b):
            moved = (await fits(p))["fast"]["itl_a_ms"] / before[p]
            served, reason = await chat(p, "write a long story", max_tokens=600)
            assert moved <= 10.5, (moved, reason)
            # Routing stays where it was while the engines are further apart than the fit moved (20 times against
            # about 8; on a busy machine the fast engine measures slower, and the gap may be less).
            assert served == "fast" or gap[p] < 1.5 * moved, (moved, reason, gap[p])
        assert await logged((a, b), "within one half-life")  # the later entries refused, and said why
    finally:
        await replicas.stop()
        await slow.stop()
        await fast.stop()
        await drop_keys(client, prefix)
        await client.aclose()


async def _all(check, procs) -> bool:
    return all([await check(p) for p in procs])


async def test_stats_summaries_from_the_future_or_with_a_bucket_past_any_value_leave_the_feeds_answering(tmp_path):
    client = await redis_client()
    prefix = new_prefix()
    engine = await FakeEngine(Knobs()).start()
    replicas = Replicas(tmp_path, [backend("e0", engine)], prefix)
    key = prefix + "stats"
    try:
        a, b = await replicas.start(), await replicas.start()
        for p in (a, b):
            await chat(p)

        async def a_summary() -> dict | None:
            for raw in (await client.hgetall(key)).values():
                s = orjson.loads(raw)
                if s["backends"]["e0"]["classes"]:
                    return s
            return None

        good = await until(a_summary, "a summary with a served request in Redis")

        async def fleet(n: int) -> bool:
            return all([(await get_json(p.url + "/stats?scope=replicas"))["fleet"]["totals"]["requests"] == n
                        for p in (a, b)])

        await until(lambda: fleet(2), "each replica sees the other's request")
        klass = next(iter(good["backends"]["e0"]["classes"]))

        def poisoned(taken_at: float) -> bytes:
            s = orjson.loads(orjson.dumps(good))
            s.update(replica="elsewhere", worker="1", taken_at=taken_at)
            s["backends"]["e0"]["classes"][klass]["ttft"] = {"i": [1_000_000], "n": [1]}
            return orjson.dumps(s)

        await client.hset(key, "elsewhere/1", poisoned(time.time() + 3600))
        deadline = time.monotonic() + 3.0  # three rounds of sharing each: the fresh one kept fresh meanwhile
        while time.monotonic() < deadline:
            await client.hset(key, "elsewhere/2", poisoned(time.time()))
            await feeds_answer(a, b)
            for p in (a, b):
                rep = await get_json(p.url + "/stats?scope=replicas")
                assert "elsewhere" not in {r["replica"] for r in rep["replicas"]}
                assert rep["fleet"]["totals"]["requests"] == 2
            await asyncio.sleep(0.2)
        assert all(p.stderr_text().count("ignoring the stats summary 'elsewhere/2'") == 1 for p in (a, b)), \
            replicas.logs()
        assert not await client.hexists(key, "elsewhere/1")  # a summary from the future is deleted: it never ages
        await client.hdel(key, "elsewhere/2")
        await asyncio.sleep(1.5)
        await feeds_answer(a, b)
    finally:
        await replicas.stop()
        await engine.stop()
        await drop_keys(client, prefix)
        await client.aclose()


async def arms(p, n: int = 12) -> set[str]:
    async with openai.AsyncOpenAI(base_url=p.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
        got = set()
        for i in range(n):
            raw = await c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, user=f"u{i}")
            got.add(raw.headers["x-shapegate-arm"])
        return got


async def put(p, change: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.put(f"{p.url}/admin/experiments/ab", json=change,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            return r.status, await r.json()


async def test_an_experiment_control_no_replica_writes_applies_nothing_and_the_sharing_goes_on(tmp_path):
    client = await redis_client()
    prefix = new_prefix()
    engines = [await FakeEngine(Knobs()).start() for _ in range(3)]
    backends = [backend(f"e{i}", e) for i, e in enumerate(engines)]
    replicas = Replicas(tmp_path, backends, prefix)
    experiment = {"name": "ab", "model": MODEL, "mode": "split", "subject": "user",
                  "arms": [{"name": "a", "backends": ["e0"], "weight": 100},
                           {"name": "b", "backends": ["e1", "e2"], "weight": 0}]}
    state = {"backend": "redis", "redis_url": "redis://127.0.0.1:6379/0", "key_prefix": prefix,
             "flush_interval_s": 0.05}
    replicas.path.write_text(to_toml(gateway_config(backends, state=state) | {"experiments": [experiment]}))
    key = prefix + "experiments:control"
    try:
        a, b = await replicas.start(), await replicas.start()
        bad = [{"version": 10 ** 6, "enabled": True, "fraction": None, "weights": {"a": 0, "b": 1},
                "changed_at": "soon"},
               {"version": 10 ** 6 + 1, "enabled": True, "fraction": None, "weights": {"a": 1e308, "b": 1e308},
                "changed_at": time.time()}]
        for control in bad:
            await client.hset(key, "ab", orjson.dumps(control))
            why = "changed at 'soon'" if control["changed_at"] == "soon" else "from 0 to 1e+06"
            await until(lambda: logged((a, b), "ignoring the experiment control of 'ab'", why),
                        "both replicas refused it")
            for p in (a, b):
                assert await arms(p) == {"a"}
        await feeds_answer(a, b)
        status, body = await put(a, {"weights": {"a": 1e308, "b": 1}})
        assert status == 400 and body["error"]["code"] == "invalid_experiment_change"
        # The sharing goes on: a change made on one replica reaches the other.
        status, body = await put(a, {"weights": {"a": 0, "b": 100}})
        assert status == 200 and body["shared"] is True
        await until(lambda: _arms_are(b, {"b"}), "the other replica adopted the change", timeout=2.0)
        assert "Traceback" not in replicas.logs()
    finally:
        await replicas.stop()
        for e in engines:
            await e.stop()
        await drop_keys(client, prefix)
        await client.aclose()


async def _arms_are(p, want: set[str]) -> bool:
    return await arms(p, 6) == want


async def test_a_version_counter_at_its_top_and_a_replica_that_refuses_are_told_to_the_writer(tmp_path):
    client = await redis_client()
    prefix = new_prefix()
    engines = [await FakeEngine(Knobs()).start() for _ in range(3)]
    backends = [backend(f"e{i}", e) for i, e in enumerate(engines)]
    replicas = Replicas(tmp_path, backends, prefix)
    state = {"backend": "redis", "redis_url": "redis://127.0.0.1:6379/0", "key_prefix": prefix,
             "flush_interval_s": 0.05}

    def config(arms: list[str]) -> str:
        experiment = {"name": "ab", "model": MODEL, "mode": "split", "subject": "user",
                      "arms": [{"name": arm, "backends": [f"e{i}"], "weight": 100 if i == 0 else 0}
                               for i, arm in enumerate(arms)]}
        return to_toml(gateway_config(backends, state=state) | {"experiments": [experiment]})

    try:
        replicas.path.write_text(config(["a", "b"]))
        a, b = await replicas.start(), await replicas.start()
        await asyncio.sleep(1.0)  # each has said what it holds
        # The counter every change takes its version from, at the top of a version's range.
        await client.set(prefix + "experiments:version", 2 ** 53)
        status, body = await put(a, {"weights": {"a": 0, "b": 100}})
        assert status == 200, body
        assert body["version"] < 2 ** 53 and body["shared"] is True, body  # said only once b applied it...
        assert await _arms_are(b, {"b"})  # ...which it did
        assert body["replicas"]["applied"] and not body["replicas"]["refused"]
        # A third replica whose experiment has other arms (a configuration not rolled out everywhere yet).
        replicas.path.write_text(config(["a", "c"]))
        c = await replicas.start()
        await asyncio.sleep(1.0)
        status, body = await put(a, {"weights": {"a": 100, "b": 0}})
        assert status == 200 and body["shared"] is False, body
        refused = body["replicas"]["refused"]
        assert len(refused) == 1 and "unknown arm 'b'" in next(iter(refused.values())), body
        assert await _arms_are(b, {"a"}) and await arms(c) == {"a"}
    finally:
        await replicas.stop()
        for e in engines:
            await e.stop()
        await drop_keys(client, prefix)
        await client.aclose()
