"""benchmarks/results/failover.md from the repeats of benchmarks/failover.py: every figure and sentence from the data."""

from __future__ import annotations

import statistics
from collections import Counter

ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp"}


def _num(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"


def _two(v: float) -> str:
    return f"{v:.2f}"


def _pct(v: float) -> str:
    return f"{100 * v:.0f}"


def _rate(v: float) -> str:
    return f"{v:.2f}"


UNIT = {_num: "", _two: " s", _pct: "%", _rate: ""}


def _one(v: float | None, fmt=_two) -> str:
    return "-" if v is None else fmt(v) + UNIT[fmt]


def _agg(values, fmt=_num) -> str:
    """Median of the repeats' values and, when there are several, their min..max."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    text = _one(statistics.median(vals), fmt)
    return text if len(vals) == 1 else f"{text} ({fmt(min(vals))}..{fmt(max(vals))}{UNIT[fmt]})"


def _d(run: dict, field: str, stat: str):
    return run[field].get(stat)


def _per_kind(run: dict, kind: str) -> dict | None:
    """One repeat's figures for one fault kind: medians of the times, sums of the counts."""
    fs = [f for f in run["faults"] if f["kind"] == kind]
    if not fs:
        return None
    outs = [f["out_of_rotation_s"] for f in fs if f["out_of_rotation_s"] is not None]
    backs = [f["traffic_back_s"] for f in fs if f["traffic_back_s"] is not None]
    return {"faults": len(fs), "out": statistics.median(outs) if outs else None,
            "failovers": sum(f["failovers"] for f in fs), "errors": sum(f["errors"] for f in fs),
            "back": statistics.median(backs) if backs else None}


def _header(meta: dict, runs: list[dict]) -> list[str]:
    g = meta["gateway"]
    dirty = ("a clean tree" if not meta["dirty_paths"] else
             f"uncommitted changes in {meta['dirty_paths']} paths, {meta['dirty_gateway_paths']} of them under "
             "gateway/ or backends/ (the code under test)")
    deadlines = set(g["ttft_deadline_s"].values())
    deadline = (f"TTFT deadline {deadlines.pop():g} s for every class" if len(deadlines) == 1 else
                "TTFT deadlines " + ", ".join(f"{k} {v:g} s" for k, v in g["ttft_deadline_s"].items()))
    deadline += f" while another engine is left to try, else {g['first_byte_timeout_s']:g} s"
    groups: dict[tuple, list[str]] = {}
    for i, e in meta["engines"].items():
        groups.setdefault((e["engine"], e["profile"], e["max_running"]), []).append(i)
    engines = "; ".join(f"{', '.join(ids)}: {ENGINE_NAMES.get(e, e)} `{p}`, "
                        + (f"{m} slots" if e == "llamacpp" else f"up to {m} running")
                        for (e, p, m), ids in groups.items())
    cut = sum(1 for r in runs for f in r["faults"] if f["cut_short"])
    loads = [" / ".join(f"{x:.2f}" for x in meta[k]) for k in ("load_before", "load_after")]
    return [
        "# Failover under injected faults", "",
        (f"Commit {meta['commit']} with {dirty}; {meta['date']}; {meta['machine']}, {meta['cores']} cores, Python "
        f"{meta['python']}; load average (1 / 5 / 15 min) {loads[0]} before, {loads[1]} after; "
        f"{meta['elapsed_s']:.0f} s in all. Command: `{meta['command']}`."),
        "",
        f"{len(runs)} repeat(s), each with fresh engines and gateway: {meta['requests']} streamed chat requests at "
        f"concurrency {meta['concurrency']} through the gateway (`python -m gateway.cli serve`: {g['policy']}, "
        f"{deadline}, up to {g['max_attempts']} attempts, breaker {g['breaker_failures']} failures / "
        f"{g['breaker_open_s']:g} s open, health probes every {g['probe_interval_s']:g} s, SGLang's every "
        f"{g['sglang_probe_interval_s']:g} s) in front of {len(meta['engines'])} simulated engines run as processes "
        f"(`python -m gateway.sim`; {engines}), {meta['max_tokens'][0]}-{meta['max_tokens'][1]} output tokens "
        "each. Client, gateway and engines share the one machine, loopback only. Faults cycle through each "
        f"repeat, each held {meta['hold_s']:g} s and followed by {meta['settle_s']:g} s of healthy running: "
        + ", ".join(f"{k} ({', '.join(t)})" for k, t in meta["schedule"])
        + f"; {_agg([len(r['faults']) for r in runs])} faults per repeat, {cut} in all cut short when the "
        "load ended. Every figure is the median over the repeats with their min..max in brackets.", ""]


def _tables(runs: list[dict], margin: float) -> list[str]:
    rows = [("served", [r["served"] for r in runs], _num),
            ("failed with a clear error", [r["error"] for r in runs], _num),
            ("**lost or truncated silently**", [r["lost"] for r in runs], _num),
            ("duration", [r["duration_s"] for r in runs], _two),
            ("failovers (failed on an engine before the first byte, served by another)",
             [r["failovers_total"] for r in runs], _num),
            (f"false alarms: failovers started outside every fault window ±{margin:g} s",
             [r["false_alarms"] for r in runs], _num),
            ("share of the run inside those windows", [r["fault_window_share"] for r in runs], _pct),
            ("false alarms per minute of the rest (fault-free time)",
             [r["false_alarms_per_fault_free_min"] for r in runs], _rate),
            (f"failovers off an engine with no fault of its own within ±{margin:g} s",
             [r["failovers_off_unfaulted_engine"] for r in runs], _num)]
    for label, field, stats in (("TTFT served directly", "ttft_direct_s", ("median", "p99")),
                                ("TTFT failed over", "ttft_failed_over_s", ("median", "max")),
                                ("fault to out of rotation", "out_of_rotation_s", ("median", "max")),
                                ("recovery to traffic back", "traffic_back_s", ("median", "max"))):
        rows += [(f"{label}, {s}", [_d(r, field, s) for r in runs], _two) for s in stats]
    out = [f"| figure | median of {len(runs)} | min..max |", "|---|---|---|"]
    for label, vals, fmt in rows:
        present = [v for v in vals if v is not None]
        spread = f"{fmt(min(present))}..{fmt(max(present))}{UNIT[fmt]}" if present else "-"
        out.append(f"| {label} | {_one(statistics.median(present), fmt) if present else '-'} | {spread} |")
    out += ["", ("| repeat | load (1 min) before → after | served | clear errors | lost | duration | failovers | "
            "false alarms | windows' share of the run | false alarms / fault-free min | TTFT direct median | "
            "TTFT failed over median | out of rotation median / max | traffic back median / max |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        out.append(
            f"| {i} | {r['load_before'][0]:.2f} → {r['load_after'][0]:.2f} | {r['served']} | {r['error']} | "
            f"**{r['lost']}** | {_one(r['duration_s'])} | {r['failovers_total']} | {r['false_alarms']} | "
            f"{_one(r['fault_window_share'], _pct)} | {_one(r['false_alarms_per_fault_free_min'], _rate)} | "
            f"{_one(_d(r, 'ttft_direct_s', 'median'))} | {_one(_d(r, 'ttft_failed_over_s', 'median'))} | "
            f"{_one(_d(r, 'out_of_rotation_s', 'median'))} / {_one(_d(r, 'out_of_rotation_s', 'max'))} | "
            f"{_one(_d(r, 'traffic_back_s', 'median'))} / {_one(_d(r, 'traffic_back_s', 'max'))} |")
    return out + [""]


def _codes(runs: list[dict], field: str) -> str:
    codes = sorted({c for r in runs for c in r[field]})
    return ", ".join(f"{c} {_agg([r[field].get(c, 0) for r in runs])}" for c in codes) or "none"


def _span(e: dict) -> str:
    return f"{e['first_t']:.1f} s" if e["first_t"] == e["last_t"] else f"{e['first_t']:.1f}-{e['last_t']:.1f} s"


def _errors(runs: list[dict]) -> list[str]:
    out = [f"- Not served, by code: {_codes(runs, 'errors_by_code')}."]
    cut, errors = [r["errors_cut_by_kill"] for r in runs], [r["error"] for r in runs]
    if any(cut):
        share = "All the clear errors of every repeat were" if cut == errors else f"{_agg(cut)} clear errors were"
        out.append(f"  {share} streams already under way (status 200 sent) on an engine when it was killed, "
                   f"{_agg([r['errors_cut_with_tokens'] for r in runs])} of them with tokens at the client; they "
                   "ended with an error event and `[DONE]` rather than moving to another engine, their reply "
                   "having started.")
    if any(r["refused"] for r in runs):
        states = sum((Counter(r["refused_by_states"]) for r in runs), Counter())
        out.append(f"  Refused at once with no_backend_available: {_agg([r['refused'] for r in runs])}. The load "
                   "generator sends its next request as soon as a reply ends, without waiting out Retry-After; the "
                   f"most refusals sent within one second: {_agg([r['refused_most_in_1s'] for r in runs])}. The "
                   "engines' states at the last /stats poll before each refusal (breaker state when ready, else "
                   "health), all repeats: " + ", ".join(f"{k} x{v}" for k, v in states.most_common()) + ".")
    others = [f"repeat {i}: " + ", ".join(f"{code} x{e['n']} (requests sent " + _span(e) + " into the repeat)"
                                          for code, e in r["other_errors"].items())
              for i, r in enumerate(runs, 1) if r["other_errors"]]
    if others:
        out.append(f"  The other clear errors: {'; '.join(others)}.")
    lost = [(i, x) for i, r in enumerate(runs, 1) for x in r["not_served"] if x["kind"] == "lost"]
    if lost:
        out.append("  Lost: " + "; ".join(f"repeat {i} at {x['t']} s on {x['backend'] or 'no backend'} (status "
                                          f"{x['status']}, {x['error'] or 'no error code'})" for i, x in lost) + ".")
    return out


def _pooled(runs: list[dict], field: str) -> str:
    """Every repeat's listed failovers, counted by the engines they left and the error they moved after."""
    counts = Counter(f"{','.join(x['failed_on'])} after {x['after']}" for r in runs for x in r[field])
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def _failovers(runs: list[dict], margin: float) -> list[str]:
    hidden = [r["failovers_off_unfaulted_engine"] - r["false_alarms"] for r in runs]
    out = [(f"- Failovers {_agg([r['failovers_total'] for r in runs])}, by the fault whose window (±{margin:g} s) "
           f"they started in and whose engine they left: {_codes(runs, 'failovers_by_cause')}. False alarms, "
           f"failovers that started outside every fault window: {_agg([r['false_alarms'] for r in runs])}. Those "
           f"windows cover {_agg([r['fault_window_share'] for r in runs], _pct)} of the run, "
           f"{_agg([r['fault_windows_s'] for r in runs], _two)} of its {_agg([r['duration_s'] for r in runs], _two)}; "
           "there a false alarm would pass for a fault's failover. The remaining "
           f"{_agg([r['fault_free_s'] for r in runs], _two)} of fault-free time give "
           f"{_agg([r['false_alarms_per_fault_free_min'] for r in runs], _rate)} false alarms per minute."),
           ("  Excusing a failover only by a fault on the engine it left (such windows cover "
           f"{_agg([r['engine_window_share'] for r in runs], _pct)} of an engine's time on average) counts "
           f"{_agg([r['failovers_off_unfaulted_engine'] for r in runs])} failovers off an engine with no fault of "
           f"its own, {_agg(hidden)} of them inside another engine's fault window; that is "
           f"{_agg([r['off_unfaulted_per_engine_min'] for r in runs], _rate)} per engine-minute without a fault.")]
    if any(r["unexcused_list"] for r in runs):
        out.append("  Those failovers of all repeats, by the engines they left and their last error: "
                   f"{_pooled(runs, 'unexcused_list')}.")
    return out


def _ttft(runs: list[dict]) -> list[str]:
    deadline = runs[0]["deadline_s"]
    by = [r["ttft_failed_over_by_cause_s"] for r in runs]
    by_cause = "; ".join(f"{c} median {_agg([b.get(c, {}).get('median') for b in by], _two)}, max "
                         f"{_agg([b.get(c, {}).get('max') for b in by], _two)}"
                         for c in sorted({c for b in by for c in b}))
    out = [(f"- Time to first token, client-measured: requests served directly median "
           f"{_agg([_d(r, 'ttft_direct_s', 'median') for r in runs], _two)}, p99 "
           f"{_agg([_d(r, 'ttft_direct_s', 'p99') for r in runs], _two)}, max "
           f"{_agg([_d(r, 'ttft_direct_s', 'max') for r in runs], _two)}; requests that failed over median "
           f"{_agg([_d(r, 'ttft_failed_over_s', 'median') for r in runs], _two)}, max "
           f"{_agg([_d(r, 'ttft_failed_over_s', 'max') for r in runs], _two)}. By the fault of the engine they left: "
           f"{by_cause or 'none'}.")]
    beyond = [r["timeout_moves_beyond_deadline_s"] for r in runs]
    moved, over = sum(b.get("n", 0) for b in beyond), sum(r["timeout_moves_over_direct_p99"] for r in runs)
    if not moved:
        out.append("  No request moved off a hung or slow engine after a first-byte timeout: the data say nothing "
                   "of what such an engine costs a request.")
        return out
    p99 = _agg([_d(r, "ttft_direct_s", "p99") for r in runs], _two)
    verdict = (
        f"None of them took longer after the deadline than the p99 of direct first tokens in its repeat ({p99}): "
        f"the data agree that a hung or slow engine cost a request the {deadline:g} s deadline plus an ordinary "
        "first token elsewhere." if not over else
        f"{over} of {moved} (all repeats) took longer after the deadline than the p99 of direct first tokens in "
        f"their repeat ({p99}): for them the data do not bound the cost of a hung or slow engine by the "
        f"{deadline:g} s deadline plus an ordinary first token.")
    out.append(f"  Requests that moved off a hung or slow engine after a first-byte timeout "
               f"({_agg([b.get('n') for b in beyond])} per repeat) had their first token a median "
               f"{_agg([b.get('median') for b in beyond], _two)}, at most {_agg([b.get('max') for b in beyond], _two)}, "
               f"after waiting out the {deadline:g} s deadline on each engine they left. {verdict}")
    return out


def _rotation(meta: dict, runs: list[dict]) -> list[str]:
    deadline, poll_s, timeout_kinds = runs[0]["deadline_s"], meta["poll_s"], meta["timeout_kinds"]
    faults = [f for r in runs for f in r["faults"]]
    kinds = list(dict.fromkeys(f["kind"] for f in faults))
    first = [k for k in kinds if k not in timeout_kinds]

    def group(ks: list[str], stat) -> list:
        vals = [[f["out_of_rotation_s"] for f in r["faults"] if f["kind"] in ks and f["out_of_rotation_s"] is not None]
                for r in runs]
        return [stat(v) if v else None for v in vals]

    out = [(f"- Fault to out of rotation (the gateway's own /stats, polled every {poll_s:g} s, until the fault's "
           f"recovery): {', '.join(first)}: median {_agg(group(first, statistics.median), _two)}, max "
           f"{_agg(group(first, max), _two)}.")]
    timed = [f for f in faults if f["kind"] in timeout_kinds]
    seen = [f["out_of_rotation_s"] for f in timed if f["out_of_rotation_s"] is not None]
    if seen:
        early = sum(1 for s in seen if s < deadline)
        out.append(
            f"  {' and '.join(k for k in kinds if k in timeout_kinds)}: median "
            f"{_agg(group(list(timeout_kinds), statistics.median), _two)}, max "
            f"{_agg(group(list(timeout_kinds), max), _two)}; "
            + (f"the earliest of the {len(seen)} that left rotation (all repeats)" if len(seen) > 1 else
               "the one that left rotation") + f" left {_one(min(seen))} after the fault, "
            + (f"{'none' if len(seen) > 1 else 'not'} before the {deadline:g} s deadline had passed, consistent with such an engine being found "
               "out only by a request that reaches the deadline." if not early else
               f"{early} of {len(seen)} before the {deadline:g} s deadline had passed."))
    already = [f for f in faults if f["already_out"]]
    if already:
        out.append(f"  {len(already)} fault(s) of all repeats found their engine already out of rotation (breaker "
                   "open or health not ready at the last poll before), timed from when it was next seen in rotation: "
                   + ", ".join(f"{f['kind']} ({', '.join(f['already_out'])}, "
                               + ("not back in before recovery)" if f["out_of_rotation_s"] is None else
                                  f"out {_one(f['out_of_rotation_s'])} after the fault)") for f in already) + ".")
    never = [f for f in faults if f["out_of_rotation_s"] is None and not f["already_out"]]
    if never:
        out.append(f"  {len(never)} fault(s) of all repeats never took their engine out before recovery: "
                   + ", ".join(f"{f['kind']}{' (cut short)' if f['cut_short'] else ''}" for f in never) + ".")
    none_back = [(i, f) for i, r in enumerate(runs, 1) for f in r["faults"] if f["traffic_back_s"] is None]
    out.append(
        "- Recovery to traffic back (recovery = fault lifted, or the restarted process answering its health "
        "route; traffic back = the first request served by that engine after it): median "
        f"{_agg([_d(r, 'traffic_back_s', 'median') for r in runs], _two)}, max "
        f"{_agg([_d(r, 'traffic_back_s', 'max') for r in runs], _two)}."
        + (f" {len(none_back)} recoveries of all repeats had no request served after them on that engine: "
           + "; ".join(f"repeat {i}, {f['kind']} at {f['t_fault']:.1f} s, "
                       + (f"the load ending {f['run_left_s']:.2f} s after the recovery" if f["run_left_s"] > 0 else
                          "recovered after the load had ended") for i, f in none_back) + "." if none_back else ""))
    return out


def _kind_table(meta: dict, runs: list[dict]) -> list[str]:
    out = [("| fault | backends | in repeats | faults per repeat | out of rotation after | failovers off it | "
           "clear errors while it lasted | traffic back after |"), "|---|---|---|---|---|---|---|---|"]
    for kind, targets in meta["schedule"]:
        per = [p for p in (_per_kind(r, kind) for r in runs) if p is not None]
        if per:
            out.append(f"| {kind} | {', '.join(targets)} | {len(per)} of {len(runs)} | "
                       f"{_agg([p['faults'] for p in per])} | {_agg([p['out'] for p in per], _two)} | "
                       f"{_agg([p['failovers'] for p in per])} | {_agg([p['errors'] for p in per])} | "
                       f"{_agg([p['back'] for p in per], _two)} |")
    out += ["", ("Every fault (t from the repeat's first request; failovers: those started within its window "
            f"±{meta['fault_margin_s']:g} s off its engine; clear errors: those ending while it lasted):"), "",
            ("| repeat | t (s) | fault | backends | out of rotation after | failovers | clear errors | "
            "traffic back after |"), "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        out += [f"| {i} | {f['t_fault']:.1f} | {f['kind']}{' (cut short)' if f['cut_short'] else ''} | "
                f"{', '.join(f['backends'])} | {_one(f['out_of_rotation_s'])} | {f['failovers']} | {f['errors']} | "
                f"{_one(f['traffic_back_s'])} |" for f in r["faults"]]
    return out


def markdown(data: dict) -> str:
    meta, runs = data["meta"], data["runs"]
    lines = [*_header(meta, runs), *_tables(runs, meta["fault_margin_s"]),
             ("- *Served*: the stream ended with a finish_reason and `[DONE]`. *Failed with a clear error*: an "
             "OpenAI-shaped error body, or an error event then `[DONE]`. *Lost*: anything else (a cut stream, a "
             "dropped connection, a `[DONE]` with neither). Every stream was checked."),
             *_errors(runs), *_failovers(runs, meta["fault_margin_s"]), *_ttft(runs),
             *_rotation(meta, runs), "", "By fault kind (medians over the repeats it occurred in):", "",
             *_kind_table(meta, runs), "",
             ("Generated by `benchmarks/failover.py` (report: `benchmarks/failover_report.py`); raw figures in "
             "`failover.json`.")]
    return "\n".join(lines) + "\n"
