"""The 10,000-stream benchmark's report: a section per build, each with its own figures and checks."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from benchmarks import streams_10k

ROOT = Path(__file__).resolve().parents[2]

RECORDED = json.loads((ROOT / "benchmarks" / "results" / "streams_10k.json").read_text())


def sources_only() -> dict:
    """The recorded run's rounds of the sources, as a run from before builds were measured has them."""
    data = copy.deepcopy(RECORDED)
    data["rounds"] = [r for r in data["rounds"] if r.pop("build", "sources") == "sources"][:3]
    data["conditions"].pop("builds", None)
    return data


def two_builds() -> dict:
    """Those rounds twice over: as the sources, and as a compiled build with less memory, one round of it with a
    stream that never ended."""
    data = sources_only()
    rounds = [{**r, "build": "sources"} for r in data["rounds"]]
    compiled = [{**copy.deepcopy(r), "build": "compiled", "rss_held_mb": r["rss_idle_mb"] + 100.0}
                for r in data["rounds"]]
    compiled[1]["client"]["completed"] -= 1
    data["rounds"] = [x for pair in zip(rounds, compiled) for x in pair]
    data["conditions"]["builds"] = ["sources", "compiled"]
    return data


def test_each_build_has_its_own_table_and_checks():
    md = streams_10k.markdown(two_builds())
    assert md.count("| figure | round 1 | round 2 | round 3 |") == 2
    sources, compiled = md.split("## The plain sources")[1].split("## Compiled")
    assert "Checks (sources):" in sources and "- 0 errors: met" in sources
    asked = sum(r["client"]["requested"] for r in sources_only()["rounds"])
    assert "Checks (compiled):" in compiled and f"- 0 errors: NOT met (1 of {asked:,} streams" in compiled
    per_stream = 100 * 1024 / sources_only()["rounds"][0]["client"]["opened"]
    assert f"Medians of the rounds: {per_stream:,.1f} KB of memory per open stream" in compiled
    assert "take turns within each round" in md


def test_a_run_of_the_sources_alone_renders_without_build_headings():
    md = streams_10k.markdown(sources_only())
    assert "## The plain sources" not in md and "the gateway runs from the plain sources" in md
    assert md.count("| figure |") == 1 and "Checks:" in md
