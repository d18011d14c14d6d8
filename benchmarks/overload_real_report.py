"""Figures, checks and the markdown page of the real-engine overload benchmark (benchmarks/overload_real.py)."""

from __future__ import annotations

import statistics

from benchmarks.routing_report import pct

CLASSES = ("interactive", "agent", "summarization", "generation")
NAMES = {"interactive": "interactive sessions", "agent": "agent requests", "summarization": "long prompts",
         "generation": "bulk long outputs", "flood": "the flooding key's bulk"}
VARIANTS = ("queue off", "queue on", "queue on + flood")


# The gateway class of each kind of the workload (benchmarks/routing_real.py's table).
CLASS_OF = {"interactive": "interactive", "agent": "default", "summarization": "long_prompt",
            "generation": "long_output", "flood": "long_output"}


def targets(args) -> dict[str, float]:
    """TTFT targets per kind, in seconds: the gateway's own class targets ([queue] ttft_target_s, its defaults),
    unless given."""
    from gateway.config_queue import QueueConfig
    given = {"interactive": args.interactive_ttft, "agent": args.agent_ttft,
             "summarization": args.long_prompt_ttft, "generation": args.generation_ttft}
    given["flood"] = given["generation"]
    defaults = QueueConfig().ttft_target_s
    return {kind: given[kind] if given[kind] is not None else defaults[klass] for kind, klass in CLASS_OF.items()}


def failed(r: dict, outputs: dict[str, int]) -> bool:
    """No answer, an error, cut at the drain cap, or fewer tokens than asked."""
    return not r["ok"] or r["censored"] or r["tokens"] < outputs[r["kind"]]


def attained(r: dict, tg: dict[str, float], outputs: dict[str, int]) -> bool:
    return not failed(r, outputs) and r["ttft"] is not None and r["ttft"] <= tg[r["kind"]]


def _group(rs: list[dict], tg: dict[str, float], outputs: dict[str, int], window: float) -> dict:
    done = [r for r in rs if not failed(r, outputs)]
    return {"n": len(rs), "attained": sum(attained(r, tg, outputs) for r in rs) / len(rs) if rs else None,
            "failed": len(rs) - len(done), "tokens": sum(r["tokens"] for r in done),
            "tokens_in_window": sum(r["tokens"] for r in done if r["at"] + r["e2e"] <= window),
            "ttft_p50": pct([r["ttft"] for r in done], 0.5), "ttft_p90": pct([r["ttft"] for r in done], 0.9),
            "statuses": sorted({r["status"] for r in rs if r["status"] not in (200, None)})}


def _load(samples: list[dict], engine: str) -> dict | None:
    rows = [s[engine] for s in samples if s.get(engine) is not None]
    if not rows:
        return None
    return {"running_mean": statistics.fmean(r[0] for r in rows), "running_max": max(r[0] for r in rows),
            "waiting_mean": statistics.fmean(r[1] for r in rows), "waiting_max": max(r[1] for r in rows)}


def run_figures(run: dict, tg: dict[str, float]) -> dict:
    outputs = {"interactive": 64, "agent": 128, "summarization": 32, "generation": 1000, "flood": 1000}
    recs = [dict(r, kind="flood" if r["key"] == "flood" else r["kind"]) for r in run["records"]]
    first = [r for r in recs if r["key"] == "first"]
    queue = [s["queue"] for s in run["samples"] if s.get("queue") is not None]
    w = run["window_s"]
    return {"classes": {k: _group([r for r in first if r["kind"] == k], tg, outputs, w) for k in CLASSES},
            "first": _group(first, tg, outputs, w),
            "flood": _group([r for r in recs if r["key"] == "flood"], tg, outputs, w),
            "load": {"llamacpp": _load(run["samples"], "llamacpp"), "vllm": _load(run["samples"], "vllm"),
                     "queue_mean": statistics.fmean(queue) if queue else None,
                     "queue_max": max(queue) if queue else None}}


def _mean(values: list) -> float | None:
    v = [x for x in values if x is not None]
    return statistics.fmean(v) if v else None


def summarize(runs: list[dict], meta: dict) -> dict:
    tg = meta["targets"]
    figs = {v: [run_figures(r, tg) for r in runs if r["variant"] == v] for v in VARIANTS}
    mean = {v: {"classes": {k: _mean([f["classes"][k]["attained"] for f in fs]) for k in CLASSES},
                "first": _mean([f["first"]["attained"] for f in fs]),
                "tokens": _mean([f["first"]["tokens"] for f in fs]),
                "tokens_in_window": _mean([f["first"]["tokens_in_window"] for f in fs]),
                "failed": sum(f["first"]["failed"] for f in fs)}
            for v, fs in figs.items() if fs}
    # The flood run against the queue-on run of the same repeat: the same arrivals of the first key (its seed).
    pairs = [(run_figures(on, tg), run_figures(fl, tg)) for fl in runs if fl["variant"] == "queue on + flood"
             for on in runs if on["variant"] == "queue on" and on["repeat"] == fl["repeat"]]
    return {"runs": figs, "mean": mean, "checks": checks(mean, figs, pairs)}


def checks(mean: dict, figs: dict, pairs: list[tuple[dict, dict]]) -> list[dict]:
    out = []
    off, on = mean.get("queue off"), mean.get("queue on")
    if off and on:
        for k in ("agent", "summarization"):
            d = (on["classes"][k] - off["classes"][k]) * 100
            out.append({"what": f"{NAMES[k]}: TTFT-target attainment, queue on against off", "target": "+20 points",
                        "got": f"{d:+.1f} points ({off['classes'][k]:.0%} -> {on['classes'][k]:.0%})",
                        "met": d >= 20})
        d = (on["tokens"] - off["tokens"]) / off["tokens"] * 100 if off["tokens"] else 0.0
        out.append({"what": "completed tokens of the first key, queue on against off", "target": "-10 % at most",
                    "got": f"{d:+.1f} % ({off['tokens']:,.0f} -> {on['tokens']:,.0f})", "met": d >= -10})
        w_off, w_on = off["tokens_in_window"], on["tokens_in_window"]
        d = (w_on - w_off) / w_off * 100 if w_off else 0.0
        out.append({"what": "...of them, completed by the end of the arrivals' window", "target": "(shown)",
                    "got": f"{d:+.1f} % ({w_off:,.0f} -> {w_on:,.0f})", "met": d >= -10})
    ons = figs.get("queue on", []) + figs.get("queue on + flood", [])
    if ons:
        lowest = min(f["classes"]["interactive"]["attained"] or 0.0 for f in ons)
        out.append({"what": "interactive sessions, every queue-on run", "target": "100 %", "got": f"{lowest:.0%} "
                    "(the lowest run)", "met": lowest >= 1.0})
        n = sum(f["first"]["failed"] for f in ons)
        flood = sum(f["flood"]["failed"] for f in ons)
        out.append({"what": "failed requests of the first key, every queue-on run", "target": "none",
                    "got": f"{n} (the flooding key's own: {flood}, refused past the queue's bounds by design)",
                    "met": n == 0})
    if pairs:
        drops = [(a["first"]["attained"] - b["first"]["attained"]) * 100 for a, b in pairs]
        d = statistics.fmean(drops)
        each = ", ".join(f"{a['first']['attained']:.0%} -> {b['first']['attained']:.0%}" for a, b in pairs)
        out.append({"what": "the first key's attainment, lowered by the flooding key (queue on, against the queue-on "
                    "run with the same arrivals)", "target": "5 points at most",
                    "got": f"{d:+.1f} points, the mean of {len(pairs)} ({each})", "met": d <= 5})
    return out


def _p(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} s"


def _l(load: dict | None) -> str:
    if load is None:
        return "—"
    return (f"running {load['running_mean']:.1f} (max {load['running_max']:.0f}), waiting {load['waiting_mean']:.1f} "
            f"(max {load['waiting_max']:.0f})")


def markdown(meta: dict, summary: dict) -> str:
    cal, tg = meta["calibration"], meta["targets"]
    lines = ["# The gateway's queue under overload on the real engines (llama.cpp + vLLM CPU)", "",
             f"- Commit `{meta['commit']}`{' (uncommitted changes present)' if meta['dirty'] else ''}; run "
             f"{meta['date']}; {meta['elapsed_s'] / 60:.1f} min in all; machine: {meta['machine']}; load average "
             f"(1/5/15 min) {', '.join(f'{x:.2f}' for x in meta['load_before'])} before, "
             f"{', '.join(f'{x:.2f}' for x in meta['load_after'])} after.",
             f"- Command: `{meta['command']}`; runs in this order: "
             f"{', '.join(f'{v} #{r + 1}' for v, r in meta['schedule'])}"
             + ("." if meta.get("complete", True) else " (**not all ran: this report holds the runs that did**)."),
             f"- Offered load: {meta['offered_load']:g} x the better engine's single-request busy time "
             f"(`benchmarks/routing_real.py` runs at 0.6: this is ~{meta['offered_load'] / 0.6:.1f}x), "
             f"{meta['window_s']:g} s of arrivals per run, requests still running {meta['drain_s']:g} s later cut "
             "(failed). Rates /s: " + ", ".join(f"{k} {v:.3f}" for k, v in cal["rates"].items()) +
             f"; plus {meta['workload']['session_users']} interactive session users (think time "
             f"{meta['workload']['think_s']:g} s).",
             f"- Flood run: a second key sends bulk generations at {meta['flood_factor']:g}x the first key's "
             "generation rate, on top of the first key's same arrivals.",
             "- Variants: `queue off` = shape routing alone (`[queue] enabled = false`); `queue on` = "
             "`[queue] enabled = true`, the rest of it " + (
                 f"at its defaults but `{meta['queue_settings']}`" if meta.get("queue_settings") else
                 "at its defaults") + " (vLLM's seats learned from its gauges, "
             "llama.cpp's from `/slots`). A fresh gateway per run, the same engines; both engines idle before each run."]
    for e in meta["engines"].values():
        lines.append(f"- {e['version']}, started in {e['startup_s']:.1f} s: `{' '.join(e['argv'])}`")
    lines += ["", "## Reference runs (one request at a time, straight to each engine)", "",
              "| kind | engine | TTFT | ITL | e2e |", "|---|---|---|---|---|"]
    for kind, engines in cal["per_engine"].items():
        for engine, f in engines.items():
            itl = "—" if f["itl"] is None else f"{f['itl'] * 1000:.1f} ms"
            lines.append(f"| {kind} | {engine} | {f['ttft'] * 1000:.1f} ms | {itl} | {f['e2e']:.2f} s |")
    lines += ["", "TTFT targets: " + ", ".join(f"{NAMES[k]} {v:.3g} s" for k, v in tg.items() if k != "flood") +
              " (the gateway's own class targets, `[queue] ttft_target_s`, unless the command gave others).", "",
              "## Checks", "",
              "| check | target | measured | met |", "|---|---|---|---|"]
    for c in summary["checks"]:
        lines.append(f"| {c['what']} | {c['target']} | {c['got']} | {'yes' if c['met'] else 'no'} |")
    lines += ["", "## Per run (the first key's requests; the flood's own bulk apart)", "",
              "| run | " + " | ".join(NAMES[k] for k in CLASSES) + " | all | failed | completed tokens (by the "
              "window's end) | "
              "flood: attained, failed | vLLM held | llama.cpp held | gateway queue |",
              "|---" * (len(CLASSES) + 8) + "|"]
    for v, fs in summary["runs"].items():
        for i, f in enumerate(fs):
            cells = [f"{_p(c['attained'])} of {c['n']} (p50 {_s(c['ttft_p50'])})"
                     for c in (f["classes"][k] for k in CLASSES)]
            flood = f["flood"]
            fl = "—" if not flood["n"] else f"{_p(flood['attained'])} of {flood['n']}, {flood['failed']}"
            ld = f["load"]
            q = "—" if ld["queue_max"] is None else f"mean {ld['queue_mean']:.1f}, max {ld['queue_max']}"
            lines.append(f"| {v} #{i + 1} | " + " | ".join(cells) + f" | {_p(f['first']['attained'])} | "
                         f"{f['first']['failed']}{' ' + str(f['first']['statuses']) if f['first']['statuses'] else ''}"
                         f" | {f['first']['tokens']:,} ({f['first']['tokens_in_window']:,}) | {fl} | "
                         f"{_l(ld['vllm'])} | {_l(ld['llamacpp'])} | {q} |")
    lines += ["", "Attainment: the share of a class's requests whose first token came within its target and that "
              "completed (failed ones count as missed). Load: the engines' own running and waiting gauges and the "
              "gateway's queue length, sampled every 0.5 s from the window's start to the end of the drain.", ""]
    return "\n".join(lines)
