"""The gateway as a process: SIGTERM drains streams and refuses new connections; SIGHUP and the admin route reload."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp

from gateway.ops.reload import RELOADER
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import gateway_config, start_gateway
from tests.integration.failover_kit import ADMIN, AUTH, MSG, ask, first_content, stream_ending
from tests.kit import until
from tests.procs import gateway_proc, to_toml


def fake_backend(id: str, e: FakeEngine, *models: str) -> dict:
    return {"id": id, "engine": "vllm", "url": e.url, "models": ["m", *models]}


async def refused(port: int) -> bool:
    try:
        _, w = await asyncio.open_connection("127.0.0.1", port)
    except (ConnectionRefusedError, ConnectionResetError):
        # A connect that raced the listener's close sat in its backlog and was reset with it: not accepted either.
        return True
    w.close()
    return False


async def start_streams(s, url: str, n: int, chunks: int, model: str = "m") -> list:
    body = {"model": model, "messages": MSG, "stream": True, "max_tokens": chunks}
    streams = [await s.post(url + "/v1/chat/completions", json=body, headers=AUTH) for _ in range(n)]
    heads = [await first_content(r) for r in streams]
    return list(zip(streams, heads))


async def test_sigterm_lets_streams_finish_and_refuses_new_connections(tmp_path):
    slow = await FakeEngine(Knobs(chunk_delay=0.05)).start()
    other = await FakeEngine(Knobs()).start()
    cfg = gateway_config([fake_backend("a", slow)], server={"shutdown_grace_s": 10.0})
    path = tmp_path / "gw.toml"
    path.write_text(to_toml(cfg))
    gw = await gateway_proc(path, log=tmp_path / "gw.log").start()
    try:
        async with aiohttp.ClientSession() as s:
            # SIGHUP first: a new backend appears without a restart.
            path.write_text(to_toml(gateway_config([fake_backend("a", slow), fake_backend("b", other)],
                                                   server={"shutdown_grace_s": 10.0})))
            gw.signal(signal.SIGHUP)

            async def has_b() -> bool:
                async with s.get(gw.url + "/readyz") as r:
                    return (await r.json())["backends"].get("b") == "ready"
            deadline = time.monotonic() + 5
            while not await has_b():
                assert time.monotonic() < deadline, "SIGHUP reload did not add backend b"
                await asyncio.sleep(0.05)
            path.write_text("[server\nbroken")  # an invalid file is refused; the running config stays
            gw.signal(signal.SIGHUP)
            await until(lambda: "reload refused" in gw.stderr_text(), timeout=5)
            assert await has_b()

            open_streams = await start_streams(s, gw.url, 3, chunks=30)  # ~1.5 s each
            gw.signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not await refused(gw.port):
                assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
                await asyncio.sleep(0.02)
            for r, head in open_streams:
                raw = head + await r.read()
                assert stream_ending(raw) == "finish", "a stream in flight at SIGTERM completes"
            assert await asyncio.wait_for(gw.proc.wait(), 10) == 0
    finally:
        await gw.stop()
        await slow.stop()
        await other.stop()


async def test_streams_past_the_grace_end_with_an_error_event(tmp_path):
    slow = await FakeEngine(Knobs(chunk_delay=0.05)).start()
    path = tmp_path / "gw.toml"
    path.write_text(to_toml(gateway_config([fake_backend("a", slow)], server={"shutdown_grace_s": 0.5})))
    gw = await gateway_proc(path).start()
    try:
        async with aiohttp.ClientSession() as s:
            open_streams = await start_streams(s, gw.url, 2, chunks=400)  # 20 s: far past the grace
            t0 = time.monotonic()
            gw.signal(signal.SIGTERM)
            for r, head in open_streams:
                raw = head + await r.read()
                assert stream_ending(raw) == "error" and b'"code":"shutting_down"' in raw
            assert await asyncio.wait_for(gw.proc.wait(), 10) == 0
            assert time.monotonic() - t0 < 5
        await until(lambda: slow.knobs.active == 0, timeout=5)  # the engine saw the requests end
    finally:
        await gw.stop()
        await slow.stop()


async def test_readyz_turns_false_as_soon_as_shutdown_starts():
    e = await FakeEngine(Knobs()).start()
    gw = await start_gateway(gateway_config([fake_backend("a", e)]))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/readyz") as r:
                assert r.status == 200
            gw.state.stopping = True
            async with s.get(gw.url + "/readyz") as r:
                assert r.status == 503 and not (await r.json())["ready"]
    finally:
        await gw.stop()
        await e.stop()


async def test_admin_reload_adds_drains_and_refuses_bad_files(tmp_path, caplog):
    a, b = await FakeEngine(Knobs(chunk_delay=0.02)).start(), await FakeEngine(Knobs()).start()
    path = tmp_path / "gw.toml"
    cfg = gateway_config([fake_backend("a", a)])
    path.write_text(to_toml(cfg))
    gw = await start_gateway(cfg)
    gw.app[RELOADER].path = path
    try:
        async with aiohttp.ClientSession() as s:
            async def reload(headers=ADMIN):
                async with s.post(gw.url + "/admin/reload", headers=headers) as r:
                    return r.status, await r.json()
            assert (await reload(AUTH))[0] == 403
            path.write_text(to_toml(gateway_config([fake_backend("a", a, "only-a"), fake_backend("b", b)],
                                                   server={"max_body_bytes": 16 * 1024},
                                                   stats={"refit_interval_s": 2.0})))
            status, out = await reload()
            assert status == 200 and out["added"] == ["b"] and out["updated"] == ["a"]
            await until(lambda: gw.state.pool.get("b").usable(time.monotonic()))
            # The settings read on every request follow the new configuration (they are copied out of it).
            big = {"model": "m", "messages": [{"role": "user", "content": "x" * 20_000}]}
            async with s.post(gw.url + "/v1/chat/completions", headers=AUTH, json=big) as r:
                assert r.status == 413, await r.text()
            assert [x.latency.refit_s for x in gw.state.pool.all()] == [2.0, 2.0]
            # Remove a while a stream runs on it: the stream completes, new requests go to b.
            (r, head), = await start_streams(s, gw.url, 1, chunks=40, model="only-a")
            assert r.headers["x-shapegate-backend"] == "a"
            path.write_text(to_toml(gateway_config([fake_backend("b", b)])))
            status, out = await reload()
            assert status == 200 and out["removed"] == ["a"]
            assert {x.id: x.health.state for x in gw.state.pool.all()} == {"a": "draining", "b": "ready"}
            assert (await ask(s, gw.url)).backend == "b"
            assert stream_ending(head + await r.read()) == "finish"
            await until(lambda: [x.id for x in gw.state.pool.all()] == ["b"])
            # An invalid file is refused with the reason; the running configuration stays.
            path.write_text(to_toml(gateway_config([fake_backend("b", b)], health={"interval_s": -1})))
            status, out = await reload()
            assert status == 400 and out["error"]["code"] == "invalid_config"
            assert "health.interval_s" in out["error"]["message"]
            assert "reload refused" in caplog.text
            assert [x.id for x in gw.state.pool.all()] == ["b"] and gw.state.cfg.health.interval_s == 0.1
            assert b'shapegate_config_reloads_total{result="refused"} 1.0' in gw.state.metrics.exposition()
    finally:
        await gw.stop()
        await a.stop()
        await b.stop()
