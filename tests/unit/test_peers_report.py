"""The peers benchmark's report: figures, failures and target checks computed from a small saved sample."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import peers_report
from benchmarks.peers import round_order

ROOT = Path(__file__).resolve().parents[2]

# Per target, per round: (p50, p99, cpu/req, req/s) at the non-stream points and (ttft p50, ttft p99, cpu/stream,
# tokens/s) at the stream points; c=1 and c=64 share them, which is enough for the renderer.
SAMPLE = {
    "direct": [(50, 900, None, 60_000), (60, 1_000, None, 58_000)],
    "shapegate": [(150, 8_000, 40, 9_000), (170, 9_000, 50, 10_000)],
    "vllm-router": [(300, 10_000, 100, 8_000), (320, 11_000, 110, 7_000)],
    "nginx": [(70, 2_000, 10, 40_000), (75, 2_500, 12, 42_000)],
}
FAILED = "exited with code 1: ValueError: the port is taken"


def sample() -> dict:
    points = []
    for target, rounds in SAMPLE.items():
        for rnd, (p50, p99, cpu, rate) in enumerate(rounds):
            for kind in ("nonstream", "stream"):
                for conc in (1, 64):
                    stream = kind == "stream"
                    points.append({
                        "target": target, "kind": kind, "conc": conc, "round": rnd, "requests": 1000, "errors": 0,
                        "error_kinds": {}, "window_s": 5.0, "client_cpu_s": 2.5, "load_before": [0.5, 0.4, 0.3],
                        "p50_us": p50 * 10 if stream else p50, "p99_us": p99 * 10 if stream else p99,
                        "ttft_p50_us": p50 if stream else None, "ttft_p99_us": p99 if stream else None,
                        "cpu_per_req_us": cpu * 10 if stream and cpu else cpu, "rps": rate / 200 if stream else rate,
                        "tokens_per_s": rate if stream else 0, "tokens_min": 200 if stream else 0,
                        "tokens_max": 200 if stream else 0})
    labels = {"direct": "direct", "shapegate": "shapegate", "shapegate-w2": "shapegate --workers 2",
              "vllm-router": "vLLM router", "nginx": "nginx"}
    targets = {t: {"label": labels[t], "status": "ok", "version": "1.0", "command": f"run {t}",
                   "shape": {"processes": 1, "threads": 4}} for t in SAMPLE}
    targets["shapegate-w2"] = {"label": labels["shapegate-w2"], "status": "failed", "stage": "start",
                               "error": FAILED}
    return {"conditions": {"commit": "abc1234", "dirty_paths": [], "date": "2026-01-01 00:00 UTC",
                           "machine": "test cpu, 2 cores", "load_before": [0.5, 0.4, 0.3],
                           "load_after": [1.5, 0.8, 0.4], "busy_cores_before": 0.1, "cores": 2,
                           "command": "python3 benchmarks/peers.py", "seconds": 5.0, "warmup": 1.0, "rounds": 2,
                           "wrk": "wrk 4.1.0", "wrk_seconds": 5.0, "engines": "2 x fast_engine", "duration_s": 600},
            "targets": targets, "orders": [list(SAMPLE), list(SAMPLE)[::-1]], "points": points,
            "wrk": [{"target": "shapegate", "round": 0, "rps": 9_900.0}, {"target": "shapegate", "round": 1,
                                                                           "rps": 9_500.0}]}


def cells(md: str, label: str) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| {label} "))
    return [c.strip() for c in line.strip("|").split("|")]


def test_added_is_the_target_minus_direct_in_the_same_round():
    md = peers_report.markdown(sample())
    row = cells(md, "shapegate")
    assert row[1] == "105 us (±10%)"  # rounds: 150-50 = 100 and 170-60 = 110
    assert row[2] == "45 us (±22%)" and row[3] == "9,500 (±11%)"
    assert row[5] == "105 us (±10%)"  # TTFT: the same per-round differences
    assert cells(md, "direct")[1] == "ref: p50 55 us (±18%)"


def test_a_peer_that_did_not_start_is_reported_with_its_error():
    md = peers_report.markdown(sample())
    assert cells(md, "shapegate --workers 2 (did not run)")[1:] == ["-"] * 8
    assert f"shapegate --workers 2: failed (start): {FAILED}" in md
    assert "req/s at c=64 with --workers 2, at least 1.2x the vLLM router's: not judged" in md


def test_target_checks_are_computed_from_the_medians():
    lines = {x.split(":")[0]: x for x in peers_report.markdown(sample()).splitlines() if x.startswith("- ")}
    cpu = lines["- CPU per non-streamed request at c=64, at most 0.8x the vLLM router's (us)"]
    assert "**met**, shapegate 45 against vLLM router 105: 0.43x" in cpu and "met in 2 of 2 rounds" in cpu
    added = lines["- added p50 at c=1, at most 0.6x the vLLM router's (us)"]
    assert "**met**, shapegate 105 against vLLM router 255: 0.41x" in added
    ttft = lines["- added first-token latency (p50) at c=1, under 300 us"]
    assert "**met**, 105 against 300" in ttft
    p99 = lines["- p99 of non-streamed requests at c=64, at most the vLLM router's (us)"]
    assert "**met**" in p99


def test_a_missed_target_says_not_met():
    data = sample()
    for p in data["points"]:
        if p["target"] == "shapegate" and p["kind"] == "stream":
            p["ttft_p50_us"] += 1_000
    assert "under 300 us: **not met**, 1,105 against 300" in peers_report.markdown(data)


def test_wrk_cross_check_and_notes():
    md = peers_report.markdown(sample())
    assert "shapegate 9,700 (±4%), 1.02x the client's" in md
    assert "Every counted stream carried 200 tokens." in md
    assert "The client counted no failed request" in md


def test_a_run_with_a_rate_point_has_its_column_check_and_note():
    data = sample()
    data["conditions"]["stream_rate"] = 400
    for target, rounds in SAMPLE.items():
        for rnd, (_, p99, _, _) in enumerate(rounds):
            data["points"].append({
                "target": target, "kind": "stream-rate", "conc": 64, "round": rnd, "requests": 2000, "errors": 0,
                "error_kinds": {}, "window_s": 5.0, "client_cpu_s": 1.0, "load_before": [0.5, 0.4, 0.3],
                "p50_us": 900, "p99_us": 2_000, "ttft_p50_us": 300, "ttft_p99_us": p99 / 10, "cpu_per_req_us": 300,
                "rps": 400.0, "tokens_per_s": 80_000, "tokens_min": 200, "tokens_max": 200, "rate": 400,
                "late_starts": 3 if target == "vllm-router" else 0})
    md = peers_report.markdown(data)
    header = next(x for x in md.splitlines() if x.startswith("| target |"))
    assert header.endswith("| TTFT p99 c=64 | TTFT p99 at 400 streams/s |")
    assert cells(md, "shapegate")[9] == "850 us (±12%)" and cells(md, "direct")[9] == "95 us (±11%)"
    assert cells(md, "shapegate --workers 2 (did not run)")[1:] == ["-"] * 9
    rate = next(x for x in md.splitlines() if x.startswith("- p99 of first tokens at 400 streams/s"))
    assert "**met**, shapegate 850 against vLLM router 1,050: 0.81x" in rate
    assert "came to 400-400 a second" in md and "vLLM router 6." in md


def test_rounds_change_the_order():
    ids = ["direct", "shapegate", "shapegate-w2", "vllm-router", "sglang-router", "nginx"]
    orders = [round_order(ids, r) for r in range(3)]
    assert orders[0] == ids and orders[1] == ids[::-1]
    assert all(sorted(o) == sorted(ids) for o in orders)
    assert len({o[0] for o in orders}) == 3 and len({o[-1] for o in orders}) == 3


def test_the_recorded_report_is_what_its_data_renders():
    recorded = ROOT / "benchmarks" / "results" / "peers.json"
    data = json.loads(recorded.read_text())
    assert peers_report.markdown(data) == recorded.with_suffix(".md").read_text()
