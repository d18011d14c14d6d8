"""Gateways in front of a real engine or its simulator: the targets of the client-level e2e suite."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai

from benchmarks.loopback import free_port
from gateway.sim.runner import SimOptions, SimServer, start_sim
from tests.e2e import wire
from tests.e2e.engines import LLAMA_ALIAS, VLLM_NAME, EngineHandle
from tests.e2e.quirks import QUIRKS, EngineQuirks
from tests.gateway_harness import ADMIN_KEY, USER_KEY, RunningGateway, gateway_config, start_gateway

# What clients ask for; differs from both engines' own names so every reply needs the rewrite.
PUBLIC_MODEL = "shapegate-tiny"
TARGETS = ("llamacpp-real", "llamacpp-sim", "vllm-real", "vllm-sim")
NATIVE = {"llamacpp": LLAMA_ALIAS, "vllm": VLLM_NAME}


def engine_of(target: str) -> str:
    return target.split("-", 1)[0]


def sim_options(engine: str, **extra: Any) -> SimOptions:
    """The simulator shaped like the real engine: llama `-c 4096 --parallel 2`, vLLM 4096 / max_num_seqs 2."""
    if engine == "llamacpp":
        return SimOptions(engine="llamacpp", model=LLAMA_ALIAS, slots=2, max_model_len=2048, **extra)
    return SimOptions(engine="vllm", model=VLLM_NAME, slots=2, max_model_len=4096, **extra)


def backend(backend_id: str, engine: str, url: str, native: str | None = None) -> dict[str, Any]:
    return {"id": backend_id, "engine": engine, "url": url, "models": {PUBLIC_MODEL: native or NATIVE[engine]}}


def config(backends: list[dict[str, Any]], **sections: Any) -> dict[str, Any]:
    # round robin: a portfolio sends traffic to every member whatever the load. Long probe and scrape
    # timeouts: on two cores a streaming vLLM's API server can leave /health and /metrics unanswered
    # for 3-10 s and more, which with the usual 1-2 s would mark it unhealthy and leave no load sample.
    return gateway_config(backends, routing={"policy": "round_robin"},
                          health={"timeout_s": 30.0, "load_stale_s": 60.0}, **sections)


@dataclass
class Target:
    name: str  # also the gateway's backend id
    engine: str
    real: bool
    engine_url: str
    gateway: RunningGateway

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def quirks(self) -> EngineQuirks:
        return QUIRKS[self.engine]

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=60)


@contextlib.asynccontextmanager
async def open_target(name: str, handle: EngineHandle | None, **sections: Any) -> AsyncIterator[Target]:
    """A gateway in front of the real engine `handle`, or in front of a fresh simulator when None (`sections`: the
    gateway's configuration beside the defaults)."""
    engine = engine_of(name)
    sim: SimServer | None = None
    if handle is None:
        sim = await start_sim(sim_options(engine))
    url = handle.url if handle is not None else sim.url
    try:
        gw = await start_gateway(config([backend(name, engine, url)], **sections))
        try:
            yield Target(name, engine, handle is not None, url, gw)
        finally:
            await gw.stop()
    finally:
        if sim is not None:
            await sim.close()


# -- reading the gateway and the engine ------------------------------------------------------------
async def gateway_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    return await wire.metric_families(http, url)


def labelled(families: dict[str, Any], family: str, sample: str, **labels: str) -> float | None:
    """The sum of the samples carrying these labels (others summed over), None when there are none."""
    fam = families.get(family)
    values = [s.value for s in (fam.samples if fam is not None else ())
              if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


async def stats(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


# each engine's count of generated tokens (family, sample)
GENERATED = {"llamacpp": ("llamacpp:tokens_predicted", "llamacpp:tokens_predicted_total"),
             "vllm": ("vllm:generation_tokens", "vllm:generation_tokens_total")}


async def engine_generated(http: aiohttp.ClientSession, engine: str, url: str) -> float:
    return wire.sample_value(await wire.metric_families(http, url), *GENERATED[engine])


async def engine_running(http: aiohttp.ClientSession, engine: str, url: str) -> float:
    """Requests the engine itself says it is working on: llama.cpp busy slots, vLLM's running gauge."""
    if engine == "llamacpp":
        return float(sum(s["is_processing"] for s in (await wire.get(http, url + "/slots")).json()))
    return wire.sample_value(await wire.metric_families(http, url), QUIRKS[engine].running_gauge)


async def last_sample(backend_stats: Any, seen: int) -> Any:
    """The gateway's own record of the request that just ended (it lands right after the last byte)."""
    while len(backend_stats.samples) == seen:
        await asyncio.sleep(0.001)
    return backend_stats.window(time.monotonic(), 3600.0)[-1]


# -- start-up as the gateway sees it -------------------------------------------------------------
@dataclass
class Boot:
    """An engine started behind a watching gateway: its /readyz answers over the engine's start-up."""

    handle: Any  # EngineHandle or SimServer
    launched_at: float
    ready_at: float  # when the engine's own readiness check passed
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s since launch, /readyz status)
    error: str | None = None  # the watcher failed (the engine itself started fine)


async def watch_startup(engine: str, start: Callable[[int], Awaitable[Any]],
                        settle_s: float = 0.3, give_up_s: float = 5.0) -> Boot:
    """Point a gateway at a free port, then start the engine there and record /readyz: until it has
    been 200 for `settle_s`, or for `give_up_s` after the engine said it was ready."""
    port = free_port()
    launched_at = time.monotonic()
    started_at: list[float] = []

    async def launch() -> Any:
        handle = await start(port)
        started_at.append(time.monotonic())
        return handle

    task = asyncio.create_task(launch())
    timeline: list[tuple[float, int]] = []
    error = None
    try:
        gw = await start_gateway(config([backend(f"{engine}-boot", engine, f"http://127.0.0.1:{port}")]),
                                 wait_ready=False)
        try:
            async with aiohttp.ClientSession() as http:
                ok_since = None
                while not (task.done() and (task.exception() is not None
                                            or time.monotonic() - started_at[0] > give_up_s
                                            or (ok_since is not None and time.monotonic() - ok_since > settle_s))):
                    async with http.get(gw.url + "/readyz") as resp:
                        await resp.read()
                        timeline.append((time.monotonic() - launched_at, resp.status))
                    ok_since = (ok_since or time.monotonic()) if resp.status == 200 else None
                    await asyncio.sleep(0.02)
        finally:
            await gw.stop()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    handle = await task  # the engine's own failure is the one to report
    if isinstance(handle, EngineHandle):  # its own /health poll saw 200 at launch + startup_s
        ready_at = handle.launched_at + handle.startup_s
    else:
        ready_at = started_at[0]
    return Boot(handle, launched_at, ready_at, timeline, error)


async def start_sim_at(engine: str, port: int, warmup_s: float) -> SimServer:
    sim = await start_sim(sim_options(engine, port=port, warmup_s=warmup_s))
    try:
        await sim.wait_ready(timeout=10)
    except BaseException:
        await sim.close()
        raise
    return sim
