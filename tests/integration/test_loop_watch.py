"""The loop's own health in /metrics: lag probe and GC pauses, and the start-up heap kept out of collections."""

from __future__ import annotations

import asyncio
import gc

import aiohttp

from gateway.observe.loop_watch import YOUNG_THRESHOLD
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, gateway_config, start_gateway
from tests.integration.test_metrics import Scrape


async def scrape(url: str) -> Scrape:
    async with aiohttp.ClientSession() as s, \
            s.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
        return Scrape(await r.text())


async def test_lag_and_gc_pauses_are_measured_and_startup_objects_frozen():
    before = gc.get_threshold()
    engine = await FakeEngine(Knobs()).start()
    gw = await start_gateway(gateway_config([{"id": "a", "engine": "vllm", "url": engine.url, "models": ["m1"]}]))
    try:
        # What start-up made is out of the collector's view while the gateway runs.
        assert gc.get_freeze_count() > 10_000
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD  # young collections sized for the requests in flight
        deadline = asyncio.get_running_loop().time() + 5
        while True:
            gc.collect(0)  # a young collection, as the request path's allocations cause
            m = await scrape(gw.url)
            if m.value("shapegate_event_loop_lag_seconds_count") >= 3 and \
                    m.value("shapegate_gc_pause_seconds_count", generation="0") >= 1:
                break
            assert asyncio.get_running_loop().time() < deadline, "no lag samples or GC pauses recorded"
            await asyncio.sleep(0.05)
        gc.collect()
        assert (await scrape(gw.url)).value("shapegate_gc_pause_seconds_count", generation="2") >= 1
    finally:
        await gw.stop()
        await engine.stop()
    assert gc.get_freeze_count() == 0  # released at shutdown: a process running many gateways keeps nothing
    assert gc.get_threshold() == before


def test_a_collection_inside_a_metric_lock_does_not_wait_for_that_lock():
    # A collection can start inside any allocation, also one made while a metric holds its lock (prometheus'
    # multiprocess values take a non-reentrant one): the callback must not need that lock then.
    import threading

    from gateway.observe.loop_watch import GcWatch

    lock = threading.Lock()
    seen: list[tuple[int, float]] = []

    def observe(generation: int, seconds: float) -> None:
        assert lock.acquire(timeout=1), "the GC callback waited for a lock its own thread holds"
        seen.append((generation, seconds))
        lock.release()

    watch = GcWatch(observe)
    watch.install()
    try:
        with lock:
            gc.collect()
        watch.drain()
    finally:
        watch.remove()
    assert any(gen == 2 for gen, _ in seen)
