"""Which APIs and features an engine serves for each model: the probe, its report, and its run on readiness."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import aiohttp

from backends.openai_http import printable
from gateway.config import BackendConfig
from gateway.config_experiments import PROBE_CHECKS as CHECKS
from gateway.fleet.probe_apis import API_CHECKS, LOCAL_CHECKS
from gateway.fleet.probe_checks import CHAT_CHECKS, check_answers
from gateway.fleet.probe_target import ERROR, PASSING, Cell, CheckTable, Target, TimedOut, Verdict, clip

log = logging.getLogger("shapegate.probe")
MODEL_CHECKS: CheckTable = {**CHAT_CHECKS, **API_CHECKS}
# On readiness, a model whose required check ended in an error is probed again after at most this long.
MAX_RETRY_PAUSE_S = 300.0


def redacted(cell: Cell, secret: str | None) -> Cell:
    """An engine may quote the key it was sent: the key never reaches a terminal or a log."""
    if secret and secret in cell.reason:
        return Cell(cell.verdict, cell.reason.replace(secret, "<key>"), cell.window, cell.status)
    return cell


def api_key(bc: BackendConfig) -> str | None:
    return os.environ.get(bc.api_key_env) if bc.api_key_env else None


class Run:
    """One backend's checks: at most `concurrency` at once, each within `timeout` (its requests together); after a
    timeout, or past the deadline, the checks not yet started are not tried."""

    def __init__(self, adapter, max_context: int | None, timeout: float, concurrency: int,
                 deadline: float | None) -> None:
        self.adapter, self.max_context, self.timeout = adapter, max_context, timeout
        self.gate = asyncio.Semaphore(concurrency)
        self.deadline = deadline  # the event loop's clock
        self.timed_out: str | None = None  # the first check that timed out

    async def check(self, native: str, name: str) -> Cell:
        if name in LOCAL_CHECKS:
            return await MODEL_CHECKS[name](Target(self.adapter, native, self.max_context, self.timeout))
        async with self.gate:
            if self.timed_out is not None:
                return Cell(ERROR, f"not tried: the engine timed out on {self.timed_out}")
            budget = self.timeout
            if self.deadline is not None:
                budget = min(budget, self.deadline - asyncio.get_running_loop().time())
                if budget <= 0:
                    return Cell(ERROR, "not tried: the probe's time ran out")
            try:
                async with asyncio.timeout(budget):
                    return await MODEL_CHECKS[name](Target(self.adapter, native, self.max_context, budget))
            except (TimedOut, TimeoutError) as e:
                self.timed_out = self.timed_out or name
                return e.cell if isinstance(e, TimedOut) else Cell(ERROR, f"no whole reply within {budget:.3g} s")
            except Verdict as v:
                return v.cell
            except (aiohttp.ClientError, OSError, ValueError) as e:  # refusals of the network seam itself
                return Cell(ERROR, f"{type(e).__name__}: {clip(str(e))}")


async def probe_backend(adapter, models: Mapping[str, str], max_context: int | None, timeout: float,
                        checks: tuple[str, ...] = CHECKS, secret: str | None = None, concurrency: int = 1,
                        deadline: float | None = None) -> dict[str, dict[str, Cell]]:
    """public model -> check -> cell for the `checks` named, every model's checks sharing the backend's
    `concurrency` (in order: a check starts before the ones after it); the health route's answer is shared by
    every model, and an engine that does not answer it is asked nothing else."""
    answers, answered = await check_answers(adapter, timeout)
    skip = None if answered else Cell(ERROR, "not tried: the engine did not answer")
    run = Run(adapter, max_context, timeout, concurrency, deadline)

    async def cell(native: str, name: str) -> Cell:
        if name == "answers":
            return answers
        return skip if skip is not None and name not in LOCAL_CHECKS else await run.check(native, name)

    order = [(public, name) for public in models for name in checks]
    cells = await asyncio.gather(*(cell(models[public], name) for public, name in order))
    out: dict[str, dict[str, Cell]] = {public: {} for public in models}
    for (public, name), c in zip(order, cells):
        out[public][name] = redacted(c, secret)
    return out


# -- the report: shapegate probe and GET /admin/probe --------------------------------------------------
@dataclass
class Row:
    model: str
    native: str
    backend: str
    engine: str
    cells: dict[str, Cell]

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "native": self.native, "backend": self.backend, "engine": self.engine,
                "checks": {name: cell.to_json() for name, cell in self.cells.items()}}


async def probe_fleet(backends: Sequence[Any], timeout: float, concurrency: int,
                      deadline: float | None = None) -> list[Row]:
    """Every backend at once (each a BackendState: its adapter, models and settings); rows by model, then in the
    backends' order."""
    results = await asyncio.gather(*(probe_backend(b.adapter, b.models, b.cfg.max_context, timeout, CHECKS,
                                                   api_key(b.cfg), concurrency, deadline) for b in backends))
    by_backend = dict(zip((b.id for b in backends), results))
    models = dict.fromkeys(public for b in backends for public in b.models)
    return [Row(public, b.models[public], b.id, b.engine, by_backend[b.id][public])
            for public in models for b in backends if public in b.models]


def failures(rows: Sequence[Row], require: Sequence[str]) -> list[tuple[Row, str]]:
    return [(r, name) for r in rows for name in require if r.cells[name].verdict not in PASSING]


def report(rows: Sequence[Row], require: Sequence[str], timeout: float) -> dict[str, Any]:
    """The probe as JSON: the checks in order, the required ones, whether they passed, one row per model and
    backend."""
    return {"checks": list(CHECKS), "require": list(require), "timeout_s": timeout,
            "passed": not failures(rows, require), "rows": [r.to_json() for r in rows]}


# -- on readiness ([probe] at_start) ----------------------------------------------------------------
async def verify(b, timeout: float, require: tuple[str, ...]) -> None:
    """Probe a backend that just became ready for the required checks; a model failing one is no longer routed
    there (b.unsupported names it with the reason), a model passing them all is routed there again."""
    models, pause = dict(b.models), timeout
    while models:  # the configuration only names known checks (gateway.config.PROBE_CHECKS)
        rows = await probe_backend(b.adapter, models, b.cfg.max_context, timeout, require, api_key(b.cfg),
                                   b.probe_cfg.concurrency)
        for public, cells in rows.items():
            failed = next((f"probe: {name}: {cell.describe()}" for name, cell in cells.items()
                           if cell.verdict not in PASSING), None)
            if failed is None:
                b.lacks.pop(public, None)  # it served the model just now: whatever its list said
                if b.unsupported.pop(public, None) is not None:
                    log.info("backend %s serves %s again", b.id, printable(public))
            elif b.unsupported.get(public) != failed:
                b.unsupported[public] = failed
                log.warning("backend %s no longer serves %s: %s", b.id, printable(public), failed)
        # An error says nothing about support (the engine was busy, or failing): those models stay out of
        # routing and are asked again, less and less often, until a verdict or the next promotion.
        models = {public: b.models[public] for public, cells in rows.items() if public in b.models
                  and any(cell.verdict == ERROR for cell in cells.values())}
        if models:
            await asyncio.sleep(pause)
            pause = min(pause * 2, MAX_RETRY_PAUSE_S)


def start_verifying(b) -> None:
    """On promotion to ready, with [probe] at_start: probe the backend in the background (requests never wait on
    it); a promotion while a probe still runs starts it over."""
    cfg = b.probe_cfg
    if not cfg.at_start:
        return
    if b.probe_task is not None:
        b.probe_task.cancel()
    b.probe_task = asyncio.create_task(verify(b, cfg.timeout_s, cfg.require), name=f"support-probe-{b.id}")


async def stop_verifying(b) -> None:
    """The backend's watcher is ending (removed, or the gateway stops): so does its probe."""
    task, b.probe_task = b.probe_task, None
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
