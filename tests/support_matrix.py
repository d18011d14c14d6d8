"""docs/apis.md's support matrix as the tests read it, to compare each row with what the probe finds."""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from gateway.config_experiments import PROBE_APIS
from gateway.fleet.probe import Row
from gateway.sim.main import add_arguments, options_from_args
from gateway.sim.options import SimOptions

DOC = Path(__file__).resolve().parents[1] / "docs" / "apis.md"
SIM_COMMAND = re.compile(r"`shapegate sim ([^`]+)`")


@dataclass(frozen=True)
class DocRow:
    target: str  # e.g. vllm-real, llamacpp-sim
    ran: str  # what ran: an engine's description, or a `shapegate sim ...` command
    cells: dict[str, str]  # API column -> the cell as written: yes, no (404), partial (405), gateway

    def sim_options(self) -> SimOptions | None:
        """The simulator the row's command starts (None for a real engine's row)."""
        m = SIM_COMMAND.fullmatch(self.ran)
        if m is None:
            return None
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return options_from_args(parser.parse_args(shlex.split(m.group(1))))


def split_row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def documented() -> dict[str, DocRow]:
    """The rows of the matrix by target. The header must name the probe's API columns in the probe's order."""
    section = DOC.read_text().split("## The matrix", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    head = split_row(lines[0])
    assert head == ["target", "what ran", *PROBE_APIS], f"docs/apis.md's matrix has the columns {head}"
    rows = {}
    for line in lines[2:]:
        target, ran, *cells = split_row(line)
        assert len(cells) == len(PROBE_APIS), line
        rows[target.strip("`")] = DocRow(target.strip("`"), ran, dict(zip(PROBE_APIS, cells)))
    return rows


def found(row: Row) -> dict[str, str]:
    """What the probe found for one model on one backend, written as the matrix writes it."""
    return {api: row.cells[api].short() for api in PROBE_APIS}
