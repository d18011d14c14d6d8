"""Replicas as separate processes on one Redis: sessions stay put, breaker openings and latency learning spread."""

from __future__ import annotations

import orjson

from tests.fake_engine import FakeEngine, Knobs
from tests.integration.replicas_kit import (Replicas, backend, chat, drop_keys, get_json, metric, new_prefix,
                                            redis_client, session_turn, until)

BREAKER = "shapegate_backend_breaker"


async def test_a_session_alternating_between_replicas_stays_on_one_backend(tmp_path):
    client = await redis_client()
    prefix = new_prefix()
    engines = [await FakeEngine(Knobs()).start() for _ in range(3)]
    replicas = Replicas(tmp_path, [backend(f"e{i}", e) for i, e in enumerate(engines)], prefix,
                        routing={"policy": "prefix_affinity"})
    try:
        a, b = await replicas.start(), await replicas.start()
        # Equal loads rotate: b is one step further on than a, so on its own it would pick another backend.
        await chat(b, "warming up")
        went = []
        for turn in range(6):
            here, there = (a, b) if turn % 2 == 0 else (b, a)
            went.append(await session_turn(client, prefix, here, there, "s-alternating", f"turn {turn}"))
        assert len({backend_id for backend_id, _ in went}) == 1, went
        first = went[0][0]
        assert all(reason == f"prefix_affinity:session -> {first}" for _, reason in went[1:]), went
        turns = [sum(body["messages"][0]["content"].startswith("turn") for body in e.knobs.seen) for e in engines]
        assert turns[int(first[1])] == 6 and sum(turns) == 6
    finally:
        await replicas.stop()
        for e in engines:
            await e.stop()
        await drop_keys(client, prefix)
        await client.aclose()


async def test_an_engine_one_replica_saw_die_is_avoided_by_the_other_before_it_fails_there(tmp_path):
    client = await redis_client()
    prefix = new_prefix()
    dead, live = await FakeEngine(Knobs()).start(), await FakeEngine(Knobs()).start()
    # Probes far apart: only a request (on a) can find the engine gone; b learns it from a alone.
    replicas = Replicas(tmp_path, [backend("dead", dead), backend("live", live)], prefix,
                        routing={"policy": "round_robin"},
                        health={"interval_s": 60.0, "breaker_open_s": 30.0, "healthy_threshold": 1})
    try:
        a, b = await replicas.start(), await replicas.start()
        await dead.stop()
        # a's first request goes to `dead` first (round robin starts there), is refused, and moves on.
        served, reason = await chat(a)
        assert served == "live" and "failover from dead" in reason, reason

        async def held_open_on_b() -> bool:
            return await metric(b, BREAKER, backend="dead", state="open") == 1.0

        await until(held_open_on_b, "b holds dead's breaker open", timeout=3.0)
        # b's first request would start at `dead` too; it goes straight to `live`, with no failover.
        served, reason = await chat(b)
        assert (served, reason) == ("live", "round_robin")
        row = next(r for r in (await get_json(b.url + "/stats"))["backends"] if r["id"] == "dead")
        assert row["overall"]["requests"] == 0 and row["failovers"] == 0 and row["breaker_openings"] == 0
        assert await metric(b, "shapegate_replica_imports_total", kind="breaker") == 1.0
        assert await metric(a, "shapegate_replica_imports_total", kind="breaker") == 0.0  # its own: no echo
        entry = orjson.loads(await client.hget(prefix + "breakers", "dead"))
        assert 0 < entry["hold_s"] <= 30.0
    finally:
        await replicas.stop()
        await live.stop()
        await drop_keys(client, prefix)
        await client.aclose()


async def test_a_replica_started_later_routes_its_first_request_on_what_another_learned(tmp_path):
    client = await redis_client()
    prefix = new_prefix()
    slow = await FakeEngine(Knobs(ttft_s=0.01, token_s=0.02)).start()
    fast = await FakeEngine(Knobs(ttft_s=0.01, token_s=0.001)).start()
    # `slow` first: between two unmeasured engines the tie goes to it.
    replicas = Replicas(tmp_path, [backend("slow", slow), backend("fast", fast)], prefix,
                        stats={"warmup_samples": 0})
    try:
        a = await replicas.start()
        for i in range(12):
            await chat(a, f"question {i}", max_tokens=24, stream=True)
        assert len(slow.knobs.seen) >= 2 and len(fast.knobs.seen) >= 2  # a measured both

        async def published() -> bool:
            for raw in (await client.hgetall(prefix + "latency")).values():
                learned = orjson.loads(raw)["b"]
                if all(learned.get(bid, {}).get("n", 0) >= 2 for bid in ("slow", "fast")):
                    return True
            return False

        await until(published, "a published what it learned")
        b = await replicas.start()
        seen_slow = len(slow.knobs.seen)
        served, reason = await chat(b, "write a long story", max_tokens=600)
        assert served == "fast" and reason.startswith("shape:long_output e2e="), reason
        assert len(slow.knobs.seen) == seen_slow
        assert await metric(b, "shapegate_replica_imports_total", kind="latency") >= 4
        fit = {r["id"]: r["model"] for r in (await get_json(b.url + "/stats"))["backends"]}
        assert fit["slow"]["itl_a_ms"] > 5 * fit["fast"]["itl_a_ms"]
    finally:
        await replicas.stop()
        await slow.stop()
        await fast.stop()
        await drop_keys(client, prefix)
        await client.aclose()
