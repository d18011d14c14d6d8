"""The instruction-count benchmark: each target's config switches off only its own feature, a window's timer-driven
work is taken out at the idle rate, and the report has one table per kind of request."""

from __future__ import annotations

import pytest

from benchmarks import path_instructions as pi
from gateway.config import load_config
from gateway.runtime import build_policy


@pytest.mark.parametrize("off", [None, *pi.FEATURES])
def test_each_target_turns_off_its_own_feature_and_nothing_else(tmp_path, off):
    cfg = load_config(pi.config(tmp_path / "g.toml", "http://127.0.0.1:9", off), build_policy)
    assert cfg.server.access_log is (off != "no access log")
    assert cfg.stats.enabled is (off != "no stats upkeep")
    assert cfg.auth.enabled is (off != "no API-key auth")
    assert cfg.routing.policy == ("round_robin" if off == "round robin" else "shape")
    assert cfg.health.interval_s == 3600 and cfg.health.load_interval_s == 3600  # no probe inside a window


def _point(kind: str, target: str, rnd: int, busy: float, wall: float, idle: float = 1_000.0) -> dict:
    return {"kind": kind, "target": target, "round": rnd, "requests": 10,
            "busy": {"instructions": busy, "wall_s": wall}, "idle": {"instructions": idle, "wall_s": 1.0}}


def test_a_windows_timer_work_is_taken_out_at_the_idle_rate():
    # 1,000 instructions a second with nothing in flight; a 3 s window of 10 requests held 3,000 of them.
    assert pi.per_request(_point("nonstream", "defaults", 0, 13_000, 3.0)) == 1_000


def test_the_report_has_a_table_per_kind_with_each_target_against_the_defaults():
    targets = ["defaults", "no access log", "baseline abc1234"]
    points = [_point(kind, t, r, busy, 1.0) for kind in ("nonstream", "stream")
              for r in range(3) for t, busy in zip(targets, (20_000 + r, 18_000 + r, 22_000 + r))]
    conditions = {"commit": "abc1234", "dirty_paths": [], "date": "2026-12-03 07:00 UTC", "machine": "test",
                  "load_before": [0.1, 0.1, 0.1], "load_after": [0.2, 0.2, 0.2], "command": "x", "rounds": 3,
                  "requests": {"nonstream": 10, "stream": 10}, "idle_s": 1.0, "warm": 5, "baseline": "abc1234",
                  "stream_tokens": 50, "stream_interval_s": 0.002}
    text = pi.markdown({"conditions": conditions, "targets": targets, "points": points})
    assert text.count("| target | instructions / request |") == 2
    assert "## Non-streamed request" in text and "## Stream of 50 tokens" in text
    assert "| no access log ([server] access_log = false) | 1,700 (±0.0%) | -200 (-10.5 %) |" in text
    assert "| baseline abc1234 (this tree's source at an earlier commit) | 2,100 (±0.0%) | +200 (+10.5 %) |" in text
