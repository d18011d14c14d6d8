"""CONTRIBUTING.md's examples, as written there: the example policy routes real requests, the adapter works."""

from __future__ import annotations

import asyncio
import re
import sys
import types
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

import backends
import policies
from backends.openai_http import OpenAIHTTPBackend
from benchmarks.loopback import free_port
from gateway.config import ConfigError, parse_config
from gateway.runtime import build_policy
from tests.fake_engine import FakeEngine, Knobs, make_app
from tests.gateway_harness import USER_KEY, gateway_config, start_gateway

ROOT = Path(__file__).resolve().parents[2]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "CONTRIBUTING.md").read_text(), re.S)


def load(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"CONTRIBUTING.md:{name}", "exec"), module.__dict__)
    sys.modules[name] = module
    return module


@pytest.fixture
def example_policy():
    module = load("policies.fastest_decode", python_blocks()[0])
    policies.REGISTRY["fastest_decode"] = (module.FastestDecode, module.Params)  # the line the guide adds
    yield module
    del policies.REGISTRY["fastest_decode"]
    del sys.modules["policies.fastest_decode"]


async def test_the_example_policy_is_loaded_checked_and_routes(example_policy):
    slow = await FakeEngine(Knobs()).start()
    fast = await FakeEngine(Knobs()).start()
    # The latency model starts from the hints: the policy must prefer the backend said to decode faster.
    cfg = gateway_config([
        {"id": "slow", "engine": "vllm", "url": slow.url, "models": ["m"], "hints": {"itl_ms": 40.0}},
        {"id": "fast", "engine": "vllm", "url": fast.url, "models": ["m"], "hints": {"itl_ms": 8.0}}],
        routing={"policy": "fastest_decode", "params": {"extra_streams": 2}})
    with pytest.raises(ConfigError, match="routing.params.extra_streams"):
        parse_config({**cfg, "routing": {"policy": "fastest_decode", "params": {"extra_streams": -1}}},
                     build_policy)
    gw = await start_gateway(cfg)
    try:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
            raw = await c.chat.completions.with_raw_response.create(
                model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert raw.headers["x-shapegate-backend"] == "fast"
        assert raw.headers["x-shapegate-reason"].startswith("fastest_decode itl=")
        assert len(fast.knobs.seen) == 1 and slow.knobs.seen == []
    finally:
        await gw.stop()
        await slow.stop()
        await fast.stop()


async def test_the_example_adapter_serves_behind_a_gateway():
    module = load("backends.example", python_blocks()[1])
    assert issubclass(module.ExampleBackend, OpenAIHTTPBackend)
    app = make_app(Knobs())  # an OpenAI-compatible server, with the example's own routes added below

    async def ready(request):
        return web.Response(text="ok")

    async def metrics(request):
        return web.Response(text='example:active_requests{model="m"} 3\nexample:queued_requests 1\n')

    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    backends.REGISTRY["example"] = module.ExampleBackend  # the line the guide adds
    gw = None
    try:
        gw = await start_gateway(gateway_config(
            [{"id": "ex", "engine": "example", "url": f"http://127.0.0.1:{port}", "models": ["m"]}]))
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
            raw = await c.chat.completions.with_raw_response.create(
                model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert raw.headers["x-shapegate-backend"] == "ex" and raw.parse().choices[0].message.content
        b = gw.state.pool.get("ex")
        deadline = asyncio.get_running_loop().time() + 5
        while b.load is None:  # its gauges, read the adapter's way
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        assert (b.load.running, b.load.waiting) == (3.0, 1.0)
    finally:
        if gw is not None:
            await gw.stop()
        del backends.REGISTRY["example"]
        del sys.modules["backends.example"]
        await runner.cleanup()


async def test_the_example_api_is_one_module_and_one_registry_line(tmp_path):
    """The guide's two changes, made in a copy of the tree: the module, and the registry line. A gateway run from
    the copy routes the new route to the model's engine, with keys, the route's name in the metrics, and a 404 from
    an engine without it learned."""
    from deploy.compile import copy_tree

    tree = tmp_path / "tree"
    copy_tree(tree)
    (tree / "gateway/apis/tokenize.py").write_text(python_blocks()[2])
    registry = tree / "gateway/apis/registry.py"
    text = registry.read_text()
    text = text.replace("from gateway.apis import audio,", "from gateway.apis import audio, tokenize,", 1)
    text = text.replace("    audio.TRANSCRIPTIONS, audio.TRANSLATIONS,\n",
                        "    audio.TRANSCRIPTIONS, audio.TRANSLATIONS,\n    tokenize.TOKENIZE,\n", 1)
    assert "tokenize.TOKENIZE" in text and "import audio, tokenize" in text
    registry.write_text(text)

    seen: list[dict] = []

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        return web.json_response({"tokens": list(range(len(body["prompt"].split()))), "count": 0})

    with_it, without = make_app(Knobs()), make_app(Knobs())
    with_it.router.add_post("/tokenize", tokenize)
    runners = []
    for app in (with_it, without):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        runners.append(runner)
    ports = [free_port(), free_port()]
    for runner, port in zip(runners, ports):
        await web.TCPSite(runner, "127.0.0.1", port).start()
    from tests.procs import write_config
    cfg = gateway_config([{"id": n, "engine": "vllm", "url": f"http://127.0.0.1:{p}", "models": ["m"]}
                          for n, p in zip(("with", "without"), ports)], routing={"policy": "round_robin"})
    path = write_config(tmp_path, cfg)
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port), cwd=tree,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env={**__import__("os").environ, "PYTHONPATH": str(tree)})
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(300):
                try:
                    async with s.get(url + "/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            auth = {"Authorization": f"Bearer {USER_KEY}"}
            for _ in range(4):
                async with s.post(url + "/tokenize", json={"model": "m", "prompt": "a b c"}, headers=auth) as r:
                    assert r.status == 200 and (await r.json())["tokens"] == [0, 1, 2]
                    assert r.headers["x-shapegate-backend"] == "with"
            async with s.post(url + "/tokenize", json={"model": "m"}, headers=auth) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
            async with s.post(url + "/tokenize", json={"model": "m", "prompt": "x"}) as r:
                assert r.status == 401
            async with s.get(url + "/metrics") as r:
                assert 'route="tokenize"' in await r.text()
        assert len(seen) == 4
    finally:
        proc.terminate()
        await proc.wait()
        for runner in runners:
            await runner.cleanup()
