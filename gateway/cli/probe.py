"""`shapegate probe`: which OpenAI features each engine supports for each of its models, as a table or JSON."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import orjson

from backends.openai_http import printable
from gateway.config import GatewayConfig
from gateway.config_experiments import PROBE_CHECKS as CHECKS
from gateway.fleet.probe import api_key, probe_backend
from gateway.fleet.probe_checks import YES, Cell
from gateway.runtime import Gateway


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
