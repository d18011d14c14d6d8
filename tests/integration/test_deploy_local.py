"""The compose stack run by deploy/run_local.py: two replicas serve and share Redis, and one stops losing nothing;
deploy/config_watch.py reloads the gateway of its file when the file changes, and no other."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import aiohttp
import openai
import pytest
import redis.asyncio as redis_asyncio

from tests import kit
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import gateway_config
from tests.needs import REDIS_URL, redis_up, skip_or_fail
from tests.procs import gateway_proc, to_toml

ROOT = Path(__file__).resolve().parents[2]
USER_KEY = "sg-demo-user-key-not-secret"  # the demo keys of deploy/config/gateway.toml
ADMIN_KEY = "sg-demo-admin-key-not-secret"
ENGINES = {"vllm-0", "sglang-0", "llama-0"}
STREAM_TOKENS = 160


# A whole stack of processes: the waits allow 30 s and poll every tenth of a second.
until = partial(kit.until, timeout=30.0, every=0.1)



@dataclass
class LocalStack:
    proc: asyncio.subprocess.Process
    services: dict
    log: Path

    def url(self, name: str) -> str:
        return self.services[name]["url"]

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def access_log(self, service: str) -> list[dict]:
        prefix = f"{service:<10}| {{"
        return [json.loads(line.split("| ", 1)[1]) for line in self.output().splitlines() if line.startswith(prefix)]


def output_file(path: Path) -> int:
    """A descriptor for a child's output (a file, never an unread pipe that would stall it)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


@contextlib.asynccontextmanager
async def local_stack(tmp_path: Path, compose: Path | None = None):
    """`python3 -m deploy.run_local --ports free` with a key prefix of its own, until its services are healthy;
    at the end it is stopped as a user stops it, and must leave no process and no key behind."""
    if importlib.util.find_spec("yaml") is None:
        skip_or_fail("PyYAML is not installed (pip install -e '.[test]'): deploy/run_local.py needs it")
    if not await redis_up() and shutil.which("redis-server") is None:
        skip_or_fail("neither a Redis on 127.0.0.1:6379 nor redis-server (apt-get install -y redis-server)")
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    status, log = tmp_path / "status.json", tmp_path / "stack.log"
    extra = ["--compose", str(compose)] if compose is not None else []
    out = output_file(log)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "deploy.run_local", "--ports", "free", "--key-prefix", prefix,
            "--status-file", str(status), *extra, cwd=ROOT, stdout=out, stderr=asyncio.subprocess.STDOUT)
    finally:
        os.close(out)  # the child has its own copy
    pids: list[int] = []
    try:
        async def started() -> bool:
            assert proc.returncode is None, f"run_local exited:\n{log.read_text()}"
            return status.exists()

        await until(started, "the stack's services healthy", timeout=60)
        services = json.loads(status.read_text())["services"]
        pids = [s["pid"] for s in services.values() if s["started_here"]]
        yield LocalStack(proc, services, log)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 90) == 0, log.read_text()
        assert not [pid for pid in pids if alive(pid)], "run_local left processes running"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 90)
        client = redis_asyncio.Redis.from_url(REDIS_URL)
        keys = [k async for k in client.scan_iter(match=prefix + "*")] if await redis_up() else []
        if keys:
            await client.delete(*keys)
        await client.aclose()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
async def stack(tmp_path):
    async with local_stack(tmp_path) as running:
        yield running


def client(url: str, key: str = USER_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def get_json(url: str, key: str = ADMIN_KEY) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json()


async def test_both_replicas_serve_and_share_one_redis(stack):
    assert set(stack.services) == {"gateway-1", "gateway-2", "redis", *ENGINES}
    served: dict[str, list[str]] = {}
    for name in ("gateway-1", "gateway-2"):
        async with client(stack.url(name)) as c:
            for i in range(3):
                raw = await c.chat.completions.with_raw_response.create(
                    model="qwen3-30b", max_tokens=8, messages=[{"role": "user", "content": f"hello {i}"}])
                reply = raw.parse()
                assert raw.http_response.status_code == 200 and reply.choices[0].message.content
                served.setdefault(name, []).append(raw.headers["x-shapegate-backend"])
        status, ready = await get_json(stack.url(name) + "/readyz")
        assert status == 200 and ready["backends"] == dict.fromkeys(ENGINES, "ready")
    assert {b for backends in served.values() for b in backends} <= ENGINES

    async def both_replicas() -> dict | None:
        _, rep = await get_json(stack.url("gateway-1") + "/stats?scope=replicas")
        counts = sorted(r["totals"]["requests"] for r in rep["replicas"])
        return rep if counts == [3, 3] else None

    rep = await until(both_replicas, "each replica's 3 requests in gateway-1's view of the fleet")
    assert len({r["replica"] for r in rep["replicas"]}) == 2 and rep["fleet"]["totals"]["requests"] == 6


async def stream_to_end(c: openai.AsyncOpenAI, first: asyncio.Event) -> tuple[int, str | None]:
    """One stream: (content chunks, finish reason); `first` is set on its first content."""
    chunks, finish = 0, None
    # ignore_eos (vLLM's): exactly max_tokens tokens, about 3 s on the simulated card, so SIGTERM lands mid-stream.
    stream = await c.chat.completions.create(model="qwen3-8b", max_tokens=STREAM_TOKENS, stream=True,
                                             messages=[{"role": "user", "content": "tell me a long story"}],
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:  # an error event would raise here
        for choice in chunk.choices:
            if choice.delta.content:
                chunks += 1
                first.set()
            finish = choice.finish_reason or finish
    return chunks, finish


async def test_stopping_a_replica_completes_its_streams_and_loses_no_request(stack):
    one, two = stack.url("gateway-1"), stack.url("gateway-2")
    gone = "run_local: gateway-1 exited with status"
    served_by: dict[str, str] = {}  # request id -> the replica that answered it
    moved: list[str] = []
    sigterm_sent = asyncio.Event()

    async def moving_client() -> None:
        """Sequential requests to gateway-1 that move to gateway-2 when gateway-1 cannot take one; each is
        retried there only if gateway-1 never answered it. Runs until gateway-1 is gone, then 5 more."""
        clients = {one: client(one), two: client(two)}
        current, after_exit = one, 0
        try:
            for i in range(2000):
                rid = f"move-{i}"
                while True:
                    try:
                        raw = await clients[current].chat.completions.with_raw_response.create(
                            model="qwen3-30b", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                            extra_headers={"x-request-id": rid})
                        break
                    except openai.APIConnectionError:
                        assert current == one and sigterm_sent.is_set(), "a replica refused before it was stopped"
                        moved.append(rid)
                        current = two
                assert raw.http_response.status_code == 200 and raw.parse().choices[0].message.content is not None
                assert raw.headers["x-request-id"] == rid
                served_by[rid] = current
                if gone in stack.output():
                    after_exit += 1
                    if after_exit > 5:
                        return
            raise AssertionError("gateway-1 never exited")
        finally:
            for c in clients.values():
                await c.close()

    mover = asyncio.create_task(moving_client())
    # (A moving client that failed raises its own error here.)
    await until(lambda: mover.done() and mover.result() or len(served_by) >= 3, "the moving client served")
    async with client(one) as streamer:
        firsts = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(stream_to_end(streamer, f)) for f in firsts]
        await until(lambda: all(f.is_set() for f in firsts), "first content of every stream")
        sigterm_sent.set()
        os.kill(stack.services["gateway-1"]["pid"], signal.SIGTERM)
        results = await asyncio.wait_for(asyncio.gather(*streams), 60)
    await asyncio.wait_for(mover, 90)

    # Streams in flight at SIGTERM ran to their end on the replica that was stopping.
    assert results == [(STREAM_TOKENS, "length")] * len(streams)
    assert f"{gone} 0" in stack.output()
    # The client moved once, and every request it sent was served: by gateway-1 while it took them, then by 2.
    assert len(moved) == 1 and served_by[moved[0]] == two
    order = list(served_by.values())
    assert order == sorted(order, key=lambda url: url == two) and order.count(two) >= 5
    # Every request gateway-1 read, it answered: its access log holds exactly the ones the client saw it serve.
    log_one = [e for e in stack.access_log("gateway-1") if e["request_id"].startswith("move-")]
    assert {e["request_id"] for e in log_one} == {rid for rid, url in served_by.items() if url == one}
    assert {e["status"] for e in log_one} == {200}
    assert [e["status"] for e in stack.access_log("gateway-1") if e["stream"]] == [200] * len(streams)

    async def alone() -> bool:
        status, ready = await get_json(two + "/readyz")
        _, rep = await get_json(two + "/stats?scope=replicas")
        return status == 200 and ready["ready"] and [r["self"] for r in rep["replicas"]] == [True]

    await until(alone, "gateway-1's stats withdrawn from the shared store, gateway-2 serving")


async def text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


def configmap_dir(root: Path, version: str, text: str) -> None:
    """Write `text` as a Kubernetes ConfigMap volume does: a timestamped directory, `..data` pointing at it
    (swapped atomically), and the key's file as a symlink through `..data`."""
    (root / version).mkdir(parents=True)
    (root / version / "gateway.toml").write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(version)
    os.replace(tmp, root / "..data")
    if not (root / "gateway.toml").is_symlink():
        (root / "gateway.toml").symlink_to("..data/gateway.toml")


async def test_config_watch_reloads_the_gateway_of_its_file_and_no_other(tmp_path):
    a, b = await FakeEngine(Knobs()).start(), await FakeEngine(Knobs()).start()
    backend = {"id": "a", "engine": "vllm", "url": a.url, "models": ["m"]}
    mounted = tmp_path / "etc-shapegate"
    configmap_dir(mounted, "..2026_01_01_00_00_00.1", to_toml(gateway_config([backend])))
    bystander_cfg = tmp_path / "bystander.toml"
    bystander_cfg.write_text(to_toml(gateway_config([backend])))
    watched = gateway_proc(mounted / "gateway.toml", log=tmp_path / "watched.log")
    bystander = gateway_proc(bystander_cfg, log=tmp_path / "bystander.log")
    watch_log = tmp_path / "watch.log"
    watcher = None
    try:
        await watched.start()
        await bystander.start()
        err = output_file(watch_log)
        try:
            watcher = await asyncio.create_subprocess_exec(
                sys.executable, str(ROOT / "deploy" / "config_watch.py"), "--config", str(mounted / "gateway.toml"),
                "--interval", "0.1", stderr=err)
        finally:
            os.close(err)
        await until(lambda: "watching" in watch_log.read_text(), "the watcher's first read")

        both = [backend, {"id": "b", "engine": "vllm", "url": b.url, "models": ["m"]}]
        configmap_dir(mounted, "..2026_01_01_00_01_00.2", to_toml(gateway_config(both)))

        async def reloaded() -> bool:
            _, ready = await get_json(watched.url + "/readyz")
            return ready["backends"].get("b") == "ready"

        await until(reloaded, "the watched gateway serving backend b after the swap")
        assert f"SIGHUP sent to {watched.proc.pid}" in watch_log.read_text()
        assert "configuration reloaded" in watched.stderr_text()
        # The other gateway's file did not change and it got no signal: it never reloaded.
        reload_ok = 'shapegate_config_reloads_total{result="ok"} 1.0'
        assert reload_ok in await text(watched.url + "/metrics")
        assert 'shapegate_config_reloads_total{result="ok"}' not in await text(bystander.url + "/metrics")
        assert "configuration reloaded" not in bystander.stderr_text()
    finally:
        if watcher is not None and watcher.returncode is None:
            watcher.terminate()
            await watcher.wait()
        await watched.stop()
        await bystander.stop()
        await a.stop()
        await b.stop()


async def test_config_watch_holds_its_signal_until_a_starting_gateway_catches_it(tmp_path):
    """A change seen while the gateway is still starting (no SIGHUP handler yet, so SIGHUP would end it) is
    signalled once the gateway catches SIGHUP: the gateway lives and serves the new file."""
    a, b = await FakeEngine(Knobs()).start(), await FakeEngine(Knobs()).start()
    first = [{"id": "a", "engine": "vllm", "url": a.url, "models": ["m"]}]
    mounted = tmp_path / "etc-shapegate"
    configmap_dir(mounted, "..v1", to_toml(gateway_config(first)))
    watch_log = tmp_path / "watch.log"
    err = output_file(watch_log)
    try:
        watcher = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "deploy" / "config_watch.py"), "--config", str(mounted / "gateway.toml"),
            "--interval", "0.02", stderr=err)
    finally:
        os.close(err)
    gw = gateway_proc(mounted / "gateway.toml", log=tmp_path / "gw.log")
    try:
        await until(lambda: "watching" in watch_log.read_text(), "the watcher's first read")
        await gw.start(wait=False)  # its interpreter takes a while to import the gateway and set its handlers
        configmap_dir(mounted, "..v2", to_toml(gateway_config([*first, {"id": "b", "engine": "vllm", "url": b.url,
                                                                       "models": ["m"]}])))

        async def serves_b() -> bool:
            assert gw.proc.returncode is None, f"the gateway died:\n{gw.stderr_text()}"
            try:
                _, ready = await get_json(gw.url + "/readyz")
            except aiohttp.ClientError:
                return False  # not listening yet
            return ready["backends"].get("b") == "ready"

        await until(serves_b, "the gateway serving the new file", timeout=20)
        await until(lambda: f"SIGHUP sent to {gw.proc.pid}" in watch_log.read_text(), "the held signal sent")
        await until(lambda: "configuration reloaded" in gw.stderr_text(), "the gateway's reload")
        assert gw.proc.returncode is None
    finally:
        if watcher.returncode is None:
            watcher.terminate()
            await watcher.wait()
        await gw.stop()
        await a.stop()
        await b.stop()


async def reason(url: str) -> str:
    async with client(url) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="qwen3-30b", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        return raw.headers["x-shapegate-reason"]


async def is_round_robin(url: str) -> bool:
    return await reason(url) == "round_robin"


async def test_sighup_to_run_local_reloads_every_gateway_from_the_edited_config(tmp_path):
    deploy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy" / "config", deploy / "config")
    compose = (ROOT / "deploy" / "compose.yaml").read_text()
    assert compose.count("context: ..") == 1
    (deploy / "compose.yaml").write_text(compose.replace("context: ..", f"context: {ROOT}"))
    config = deploy / "config" / "gateway.toml"
    async with local_stack(tmp_path, deploy / "compose.yaml") as st:
        gateways = [st.url("gateway-1"), st.url("gateway-2")]
        assert [(await reason(url)).startswith("shape") for url in gateways] == [True, True]
        config.write_text(config.read_text().replace('policy = "shape"', 'policy = "round_robin"'))
        st.proc.send_signal(signal.SIGHUP)
        for url in gateways:
            await until(partial(is_round_robin, url), f"{url} routing round-robin after the reload")
        # A file the gateway would refuse is refused before any gateway is signalled; both keep theirs.
        config.write_text("[server\nbroken")
        st.proc.send_signal(signal.SIGHUP)
        await until(lambda: "reload of gateway-2 refused" in st.output(), "the broken file refused")
        assert [await reason(url) for url in gateways] == ["round_robin", "round_robin"]


async def test_a_compose_file_run_local_cannot_run_is_one_line_and_status_2(tmp_path):
    """Before anything starts: a file that is not YAML, a service with no local equivalent (its ports taken and a
    missing PyYAML, the same: tests/integration/test_cli.py)."""
    if importlib.util.find_spec("yaml") is None:
        skip_or_fail("PyYAML is not installed (pip install -e '.[deploy]'): deploy/run_local.py needs it")
    broken, foreign = tmp_path / "broken.yaml", tmp_path / "foreign.yaml"
    broken.write_text("services: [\n")
    foreign.write_text("services:\n  db:\n    image: postgres:16\n")
    cases = {broken: f"run_local: {broken}: not valid YAML: ",
             foreign: "run_local: db: image 'postgres:16' has no local equivalent\n"}
    for compose, line in cases.items():
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "deploy.run_local", "--compose", str(compose), cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert (proc.returncode, out) == (2, b"") and err.decode().startswith(line), err
        assert err.count(b"\n") == 1 and b"Traceback" not in err
