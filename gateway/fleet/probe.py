"""`shapegate probe`: which OpenAI features each engine supports for each of its models; also run on readiness."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Mapping

import aiohttp
import orjson

from backends.openai_http import printable
from gateway.config_experiments import PROBE_CHECKS as CHECKS
from gateway.config import BackendConfig, GatewayConfig
from gateway.fleet.probe_checks import (
    ERROR,
    MODEL_CHECKS,
    YES,
    Cell,
    Target,
    TimedOut,
    Verdict,
    check_answers,
    clip,
)

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


# -- the command ----------------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    native: str
    backend: str
    engine: str
    cells: dict[str, Cell]

    def to_json(self) -> dict:
        return {"model": self.model, "native": self.native, "backend": self.backend, "engine": self.engine,
                "checks": {name: cell.to_json() for name, cell in self.cells.items()}}


async def probe_all(cfg: GatewayConfig, timeout: float) -> list[Row]:
    """Every backend at once, each model a backend serves in turn; rows by model, then in the file's order."""
    from gateway.runtime import (
        Gateway,  # runtime imports the pool, the pool health, and health this module
    )

    async with aiohttp.ClientSession() as session:
        g = Gateway(cfg, session)
        made = [g.make_backend(bc) for bc in cfg.backends]  # as serving makes them: routes, key, limits
        try:
            results = await asyncio.gather(*(probe_backend(b.adapter, b.models, b.cfg.max_context, timeout,
                                                           CHECKS, api_key(b.cfg)) for b in made))
        finally:
            for b in made:
                b.adapter.close()
    by_backend = dict(zip((bc.id for bc in cfg.backends), results))
    models = dict.fromkeys(public for bc in cfg.backends for public in bc.models)
    return [Row(public, bc.models[public], bc.id, bc.engine, by_backend[bc.id][public])
            for public in models for bc in cfg.backends if public in bc.models]


def failures(rows: list[Row], require: tuple[str, ...]) -> list[tuple[Row, str]]:
    return [(r, name) for r in rows for name in require if r.cells[name].verdict != YES]


def cell_text(cell: Cell) -> str:
    return str(cell.window) if cell.verdict == YES and cell.window is not None else cell.verdict


def render(rows: list[Row], require: tuple[str, ...]) -> list[str]:
    """The matrix, then the reason of every cell that is not a plain yes, then whether the required checks pass."""
    head = ["model", "backend", "engine", *CHECKS]
    table = [head] + [[printable(r.model if r.model == r.native else f"{r.model} ({r.native})"),
                       r.backend, r.engine, *(cell_text(r.cells[c]) for c in CHECKS)] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    lines = ["  ".join(text.ljust(w) for text, w in zip(line, widths)).rstrip() for line in table]
    notes = []
    for r in rows:
        # Checks that failed alike (an engine that is down, a model it does not know) share one line.
        alike: dict[str, list[str]] = {}
        for name, cell in r.cells.items():
            if cell.verdict != YES and cell.reason:
                alike.setdefault(cell.describe(), []).append(name)
        notes += [f"  {printable(r.model)} @ {r.backend}: {', '.join(names)}: {why}" for why, names in alike.items()]
    if notes:
        lines += ["", "reasons:", *notes]
    failed = failures(rows, require)
    lines.append("")
    if failed:
        bad = len({(r.model, r.backend) for r, _ in failed})
        lines.append(f"required ({', '.join(require)}): failed on {bad} of {len(rows)} model-backend pairs")
    else:
        lines.append(f"required ({', '.join(require)}): passed on all {len(rows)} model-backend pairs")
    return lines


def run(cfg: GatewayConfig, timeout: float, as_json: bool) -> int:
    """Probe, print, and answer 0 when every required check passed everywhere, else 1."""
    require = cfg.probe.require
    rows = asyncio.run(probe_all(cfg, timeout))
    if as_json:
        report = {"checks": list(CHECKS), "require": list(require), "timeout_s": timeout,
                  "passed": not failures(rows, require), "rows": [r.to_json() for r in rows]}
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    else:
        print("\n".join(render(rows, require)))
    return 1 if failures(rows, require) else 0
