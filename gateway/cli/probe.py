"""`shapegate probe`: which APIs and chat features each engine serves for each of its models, as tables or JSON."""

from __future__ import annotations

import asyncio
from typing import Sequence

import aiohttp
import orjson

from backends.openai_http import printable
from gateway.config import GatewayConfig
from gateway.config_experiments import PROBE_APIS, PROBE_FEATURES
from gateway.fleet.probe import Row, failures, probe_fleet, report
from gateway.fleet.probe_target import PASSING, YES, Cell
from gateway.runtime import Gateway


async def probe_all(cfg: GatewayConfig, timeout: float) -> list[Row]:
    """Every backend of the file at once, made as serving makes them (routes, key, connection limits)."""
    async with aiohttp.ClientSession() as session:
        g = Gateway(cfg, session)
        made = [g.make_backend(bc) for bc in cfg.backends]
        try:
            return await probe_fleet(made, timeout, cfg.probe.concurrency)
        finally:
            for b in made:
                b.adapter.close()


def cell_text(cell: Cell) -> str:
    return str(cell.window) if cell.verdict == YES and cell.window is not None else cell.short()


def table(rows: Sequence[Row], columns: Sequence[str]) -> list[str]:
    head = ["model", "backend", "engine", *columns]
    lines = [head] + [[printable(r.model if r.model == r.native else f"{r.model} ({r.native})"),
                       r.backend, r.engine, *(cell_text(r.cells[c]) for c in columns)] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return ["  ".join(text.ljust(w) for text, w in zip(line, widths)).rstrip() for line in lines]


def render(rows: Sequence[Row], require: Sequence[str]) -> list[str]:
    """The APIs, then the chat features, then the reason of every cell that is not a plain yes, then whether the
    required checks pass."""
    lines = ["APIs:", *table(rows, ("answers", *PROBE_APIS)), "", "chat features:", *table(rows, PROBE_FEATURES)]
    notes = []
    for r in rows:
        # Checks that failed alike (an engine that is down, a model it does not know) share one line.
        alike: dict[str, list[str]] = {}
        for name, cell in r.cells.items():
            if cell.verdict not in PASSING and cell.reason:
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
        print(orjson.dumps(report(rows, require, timeout), option=orjson.OPT_INDENT_2).decode())
    else:
        print("\n".join(render(rows, require)))
    return 1 if failures(rows, require) else 0
