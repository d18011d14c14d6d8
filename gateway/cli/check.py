"""`shapegate check`: after the configuration validated, ask each backend once whether it answers and what it serves."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import orjson

from backends.openai_http import printable
from gateway.config import BackendConfig, GatewayConfig
from gateway.runtime import Gateway

# Reading a model list or a context window is best effort: any of these means "could not tell".
LOOKUP_ERRORS = (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError)


@dataclass
class ModelReport:
    public: str
    native: str
    listed: bool | None  # None: the engine listed no models to compare with
    context: int | None
    context_from: str  # "max_context" (the config), "engine", or "" when unknown


@dataclass
class BackendReport:
    cfg: BackendConfig
    reachable: bool
    health: str  # the probe's detail ("ok", the engine's message) or why it failed
    status: int = 0
    listed: tuple[str, ...] | None = None  # the ids of the engine's GET /v1/models
    list_error: str = ""
    slots: int | None = None  # llama.cpp's parallel slots, from its load scrape
    models: list[ModelReport] = field(default_factory=list)


def model_ids(body: bytes) -> tuple[str, ...]:
    """The model ids of an OpenAI-style list (`{"data": [{"id": ...}]}`)."""
    data = orjson.loads(body)["data"]
    return tuple(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))


async def _listed(adapter, timeout: float) -> tuple[tuple[str, ...] | None, str]:
    try:
        status, body = await adapter._get("/v1/models", timeout)  # the adapter's probe GET: its key, its limits
    except LOOKUP_ERRORS as e:
        return None, type(e).__name__
    if status != 200:
        return None, f"HTTP {status}"
    try:
        return model_ids(body), ""
    except LOOKUP_ERRORS:
        return None, "not an OpenAI model list"


async def check_backend(g: Gateway, bc: BackendConfig, timeout: float) -> BackendReport:
    """Probe the backend once the way serving does, then read what it lists and how long a request may be."""
    b = g.make_backend(bc)  # as serving makes it: same engine routes, key, limits and context windows
    adapter = b.adapter
    try:
        probe = await adapter.probe(timeout, deep=True)
        if probe.status == 0:
            why = f"no answer within {timeout:g} s" if probe.detail == "TimeoutError" else probe.detail
            return BackendReport(bc, False, why or "no answer")
        report = BackendReport(bc, True, probe.detail or f"HTTP {probe.status}", probe.status)
        report.listed, report.list_error = await _listed(adapter, timeout)
        if bc.engine == "llamacpp":
            try:
                load = await adapter.sample_load(timeout)
            except LOOKUP_ERRORS:
                load = None
            report.slots = load.total_slots if load is not None else None
        await b.discover_windows(timeout)
        source = "max_context" if bc.max_context is not None else "engine"  # the operator's figure wins
        for public, native in bc.models.items():
            context = b.window(public)
            listed = None if report.listed is None else native in report.listed
            report.models.append(ModelReport(public, native, listed, context, source if context else ""))
        return report
    finally:
        adapter.close()


async def check_all(cfg: GatewayConfig, timeout: float) -> list[BackendReport]:
    async with aiohttp.ClientSession() as session:
        g = Gateway(cfg, session)
        return list(await asyncio.gather(*(check_backend(g, bc, timeout) for bc in cfg.backends)))


def describe(r: BackendReport) -> list[str]:
    bc = r.cfg
    lines = [f"backend {bc.id}: engine {bc.engine}, url {bc.url}"]
    if not r.reachable:
        return lines + [f"  unreachable: {r.health}"]
    health = r.health if r.health == "ok" or r.health.startswith("HTTP ") else f"HTTP {r.status}: {r.health}"
    lines.append(f"  reachable; health: {health}")
    if r.listed is None:
        lines.append(f"  engine lists: unknown ({r.list_error})")
    else:
        lines.append(f"  engine lists: {', '.join(printable(m) for m in r.listed) or 'no models'}")
    if r.slots is not None:
        lines.append(f"  slots: {r.slots}")
    for m in r.models:
        name = m.public if m.public == m.native else f"{m.public} (engine name {m.native})"
        if m.listed is None:
            found = "not checked"
        elif m.listed:
            found = "listed"
        else:
            found = "NOT listed" + (" (llama.cpp answers to any name)" if bc.engine == "llamacpp" else "")
        window = f"{m.context} tokens ({m.context_from})" if m.context else "unknown"
        lines.append(f"  model {name}: {found}; context window: {window}")
    return lines


def backends(n: int) -> str:
    return f"{n} backend" if n == 1 else f"{n} backends"


def summary(reports: list[BackendReport]) -> str:
    up = sum(r.reachable for r in reports)
    ready = sum(r.reachable and r.health == "ok" for r in reports)
    if ready == len(reports):
        return f"{backends(len(reports))} answered, all healthy"
    return (f"{up} of {backends(len(reports))} answered, {ready} healthy; the configuration is valid, and serve "
            f"keeps probing the others")


def run(cfg: GatewayConfig, path: str, timeout: float) -> int:
    """Print what each backend says; the configuration is valid by now, so the answer is 0 either way."""
    print(f"{path}: configuration valid ({backends(len(cfg.backends))}, routing policy {cfg.routing.policy})")
    reports = asyncio.run(check_all(cfg, timeout))
    for r in reports:
        print("\n".join(describe(r)))
    print(summary(reports))
    return 0
