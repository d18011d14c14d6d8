"""Which OpenAI features an engine supports for each model: the probe, also run when a backend gets ready."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Mapping

import aiohttp

from backends.openai_http import printable
from gateway.config import BackendConfig
from gateway.config_experiments import PROBE_CHECKS as CHECKS
from gateway.fleet.probe_checks import ERROR, MODEL_CHECKS, YES, Cell, Target, TimedOut, Verdict, check_answers, clip

log = logging.getLogger("shapegate.probe")
# On readiness, a model whose required check ended in an error is probed again after at most this long.
MAX_RETRY_PAUSE_S = 300.0


def redacted(cell: Cell, secret: str | None) -> Cell:
    """An engine may quote the key it was sent: the key never reaches a terminal or a log."""
    if secret and secret in cell.reason:
        return Cell(cell.verdict, cell.reason.replace(secret, "<key>"), cell.window)
    return cell


def api_key(bc: BackendConfig) -> str | None:
    return os.environ.get(bc.api_key_env) if bc.api_key_env else None


async def probe_backend(adapter, models: Mapping[str, str], max_context: int | None, timeout: float,
                        checks: tuple[str, ...] = CHECKS, secret: str | None = None) -> dict[str, dict[str, Cell]]:
    """public model -> check -> cell for the `checks` named, one check at a time (an engine on a CPU has few
    slots); the health route's answer is shared by every model. After a timeout the rest is not tried."""
    answers, answered = await check_answers(adapter, timeout)
    skip = None if answered else Cell(ERROR, "not tried: the engine did not answer")
    out: dict[str, dict[str, Cell]] = {}
    for public, native in models.items():
        target = Target(adapter, native, max_context, timeout)
        cells: dict[str, Cell] = {"answers": answers}
        for name in checks:
            if name == "answers":
                continue
            if skip is not None:
                cells[name] = skip
                continue
            try:
                cells[name] = await MODEL_CHECKS[name](target)
            except TimedOut as v:
                cells[name] = v.cell
                skip = Cell(ERROR, f"not tried: the engine timed out on {name}")
            except Verdict as v:
                cells[name] = v.cell
            except (aiohttp.ClientError, OSError, ValueError) as e:  # refusals of the network seam itself
                cells[name] = Cell(ERROR, f"{type(e).__name__}: {clip(str(e))}")
        out[public] = {name: redacted(cells[name], secret) for name in checks}
    return out


# -- on readiness ([probe] at_start) ----------------------------------------------------------------
async def verify(b, timeout: float, require: tuple[str, ...]) -> None:
    """Probe a backend that just became ready for the required checks; a model failing one is no longer routed
    there (b.unsupported names it with the reason), a model passing them all is routed there again."""
    models, pause = dict(b.models), timeout
    while models:  # the configuration only names known checks (gateway.config.PROBE_CHECKS)
        rows = await probe_backend(b.adapter, models, b.cfg.max_context, timeout, require, api_key(b.cfg))
        for public, cells in rows.items():
            failed = next((f"probe: {name}: {cell.describe()}" for name, cell in cells.items()
                           if cell.verdict != YES), None)
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
