"""`shapegate check`: after the configuration validated, ask each backend once whether it answers and what it serves;
exit 1 when one does not answer or does not list a configured model (unless --allow-missing)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp

from backends.openai_http import printable
from gateway.config import BackendConfig, GatewayConfig
from gateway.fleet.served import ANY_NAME, LOOKUP_ERRORS, fix, read_model_list
from gateway.runtime import Gateway


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
    tried: str  # the request the probe made ("GET http://.../health")
    status: int = 0
    listed: tuple[str, ...] | None = None  # the ids of the engine's GET /v1/models
    list_error: str = ""
    slots: int | None = None  # llama.cpp's parallel slots, from its load scrape
    models: list[ModelReport] = field(default_factory=list)


async def check_backend(g: Gateway, bc: BackendConfig, timeout: float) -> BackendReport:
    """Probe the backend once the way serving does, then read what it lists and how long a request may be."""
    b = g.make_backend(bc)  # as serving makes it: same engine routes, key, limits and context windows
    adapter = b.adapter
    tried = f"GET {bc.url}{adapter.health_path}"
    try:
        probe = await adapter.probe(timeout, deep=True)
        if probe.status == 0:
            why = f"no answer within {timeout:g} s" if probe.detail == "TimeoutError" else probe.detail
            return BackendReport(bc, False, why or "no answer", tried)
        report = BackendReport(bc, True, probe.detail or f"HTTP {probe.status}", tried, probe.status)
        report.listed, report.list_error = await read_model_list(adapter, timeout)
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
        return lines + [f"  unreachable: {r.health}", f"    fix: {unreachable_fix(r)}"]
    health = r.health if r.health == "ok" or r.health.startswith("HTTP ") else f"HTTP {r.status}: {r.health}"
    lines.append(f"  reachable; health: {health}")
    if r.status != 200:
        lines.append(f"    fix: {unhealthy_fix(r)}")
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
            found = "NOT listed" + (" (llama.cpp answers to any name)" if bc.engine in ANY_NAME else "")
        window = f"{m.context} tokens ({m.context_from})" if m.context else "unknown"
        lines.append(f"  model {name}: {found}; context window: {window}")
        if m.listed is False:
            lines.append(f"    fix: {fix(bc.engine, m.public, m.native, r.listed)}")
    return lines


def unreachable_fix(r: BackendReport) -> str:
    """What was tried, and what to check, for a backend that did not answer at all."""
    bc = r.cfg
    where = bc.url.split("://", 1)[1].split("/", 1)[0]
    said = r.health.lower()
    if "name or service not known" in said or "name resolution" in said or "nodename nor servname" in said:
        check = f"the host name in {where} does not resolve here: correct url in [[backends]] {bc.id}"
    elif "refused" in said or "connect call failed" in said:
        check = (f"nothing accepts connections at {where}: start the engine, or check its --host/--port and url "
                 f"in [[backends]] {bc.id}")
    elif "no answer within" in said:
        check = (f"{where} did not answer in time: check that it is reachable from here (an address, a firewall) "
                 f"and that the engine is not stalled; a slow engine needs a longer --timeout")
    else:
        check = f"check url in [[backends]] {bc.id} and that a {bc.engine} engine serves HTTP there"
    return f"tried {r.tried}; {check}"


def unhealthy_fix(r: BackendReport) -> str:
    """What an engine that answers its health route with an error is telling the operator."""
    bc = r.cfg
    if r.status in (401, 403):
        return (f"{r.tried} answered HTTP {r.status}: the engine wants an API key; set api_key_env in [[backends]] "
                f"{bc.id} to the environment variable that holds it")
    if r.status == 404:
        return (f"{r.tried} answered HTTP 404: is url the engine's root (without /v1), and is it a {bc.engine} "
                f"engine (engine = in [[backends]] {bc.id})?")
    if r.status == 503:
        return (f"{r.tried} answered HTTP 503: the engine runs but is not ready (loading its model?); serve keeps "
                f"probing it and routes to it once it is")
    return f"{r.tried} answered HTTP {r.status}: see the engine's own log for why"


def missing(reports: list[BackendReport]) -> list[str]:
    """Each configured model a backend's engine does not list, as backend/model."""
    return [f"{r.cfg.id}/{m.public}" for r in reports for m in r.models if m.listed is False]


def backends(n: int) -> str:
    return f"{n} backend" if n == 1 else f"{n} backends"


def summary(reports: list[BackendReport], allow_missing: bool = False) -> str:
    """The last line: never "all healthy" while a configured model is not listed where it is configured."""
    n = len(reports)
    up = sum(r.reachable for r in reports)
    ready = sum(r.reachable and r.health == "ok" for r in reports)
    unlisted = missing(reports)
    if ready == n:
        line = f"{backends(n)} answered, " + ("all healthy" if not unlisted else f"{ready} healthy")
    else:
        line = (f"{up} of {backends(n)} answered, {ready} healthy; the configuration is valid, and serve keeps "
                f"probing the others")
    if unlisted:
        line += f"; not listed by their engine: {', '.join(unlisted)}"
    if failed(reports) and not allow_missing:
        line += " (exit status 1; --allow-missing accepts this)"
    return line


def failed(reports: list[BackendReport]) -> bool:
    """Whether a backend did not answer, or one does not list a model it is configured with."""
    return any(not r.reachable for r in reports) or bool(missing(reports))


def run(cfg: GatewayConfig, path: str, timeout: float, allow_missing: bool = False) -> int:
    """Print what each backend says: 1 when one does not answer or lacks a configured model (0 with
    allow_missing, since the configuration itself is valid by now), else 0."""
    print(f"{path}: configuration valid ({backends(len(cfg.backends))}, routing policy {cfg.routing.policy})")
    reports = asyncio.run(check_all(cfg, timeout))
    for r in reports:
        print("\n".join(describe(r)))
    print(summary(reports, allow_missing))
    return 1 if failed(reports) and not allow_missing else 0
