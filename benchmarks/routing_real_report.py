"""Figures, checks and the markdown page of the real-engine routing benchmark (benchmarks/routing_real.py)."""

from __future__ import annotations

import re
from collections import Counter

from benchmarks.routing_report import agg, pct

CLASSES = ("interactive", "generation", "summarization", "agent")
BURST_ITL_S = 1e-4  # a whole answer in one read: its tokens arrive microseconds apart
PREDICTED = re.compile(r"(?:ttft|e2e)=([\d.]+)s vs ([\d.]+)s")


def failed(r: dict, outputs: dict[str, int]) -> bool:
    """No answer, an error, cut at the drain cap, or fewer tokens than asked (a stream that broke)."""
    return not r["ok"] or r["censored"] or r["tokens"] < outputs[r["kind"]]


def meets_slo(r: dict, slo: dict, outputs: dict[str, int]) -> bool:
    s = slo[r["kind"]]
    return (not failed(r, outputs) and r["ttft"] <= s["ttft"]
            and (r["itl"] is None or r["itl"] <= s["itl"]))


def run_figures(run: dict, slo: dict, outputs: dict[str, int]) -> dict:
    recs = run["records"]
    out: dict = {"classes": {}}
    for kind in CLASSES:
        rs = [r for r in recs if r["kind"] == kind]
        if not rs:
            continue
        done = [r for r in rs if not failed(r, outputs)]
        out["classes"][kind] = {
            "n": len(rs), "ttft_p50": pct([r["ttft"] for r in done], 0.5),
            "ttft_p90": pct([r["ttft"] for r in done], 0.9),
            "itl_p50": pct([r["itl"] for r in done if r["itl"] is not None], 0.5),
            "e2e_p50": pct([r["e2e"] for r in done], 0.5),
            "slo": sum(meets_slo(r, slo, outputs) for r in rs) / len(rs),
            "failed": sum(failed(r, outputs) for r in rs),
            "backends": dict(Counter(r["backend"] or "none" for r in rs)),
        }
    out["overall"] = {"n": len(recs), "slo": sum(meets_slo(r, slo, outputs) for r in recs) / len(recs) if recs else 0.0,
                      "failed": sum(failed(r, outputs) for r in recs)}
    return out


def predicted(reason: str) -> tuple[float, float] | None:
    """(chosen, runner-up) predicted metric of a `shape` decision: 'shape:long_output e2e=1.20s vs 2.31s'."""
    m = PREDICTED.search(reason)
    return (float(m.group(1)), float(m.group(2))) if m else None


def reason_kind(reason: str) -> str:
    """x-shapegate-reason without its numbers: 'shape:long_output e2e=1.20s vs 2.31s' -> 'shape:long_output e2e'."""
    return re.sub(r"\s+vs\s*$", "", re.sub(r"=\S+|\s\d\S*", "", reason)).strip() or "none"


def summarize(runs: list[dict], meta: dict) -> dict:
    slo = meta["calibration"]["slo"]
    outputs = {k["name"]: k["output"] for k in meta["kinds"]}
    out: dict = {}
    for p in meta["placements"]:
        mine = sorted((r for r in runs if r["placement"] == p), key=lambda r: r["repeat"])
        figs = [run_figures(r, slo, outputs) for r in mine]
        entry: dict = {"overall": {m: agg([f["overall"][m] for f in figs]) for m in ("n", "slo", "failed")},
                       "classes": {}, "load1": [r["load1_at_start"] for r in mine],
                       "idle_wait_s": max(r["idle_wait_s"] for r in mine)}
        for kind in CLASSES:
            rows = [f["classes"][kind] for f in figs if kind in f["classes"]]
            if not rows:
                continue
            c = {m: agg([row[m] for row in rows]) for m in ("n", "ttft_p50", "ttft_p90", "itl_p50", "e2e_p50", "slo",
                                                            "failed")}
            c["backends"] = dict(sum((Counter(row["backends"]) for row in rows), Counter()))
            recs = [x for r in mine for x in r["records"] if x["kind"] == kind]
            c["reasons"] = Counter(f"{x['backend'] or 'none'}: {reason_kind(x['reason'])}" for x in recs).most_common(4)
            pairs = [pr for x in recs if (pr := predicted(x["reason"]))]
            c["predicted"] = {"n": len(pairs), "chosen": pct([a for a, _ in pairs], 0.5),
                              "other": pct([b for _, b in pairs], 0.5),
                              "chosen_slower": sum(a > b for a, b in pairs)}
            entry["classes"][kind] = c
        # vLLM on two cores may hold a whole answer and send it at once: how often, as the client saw it
        on_vllm = [x for r in mine for x in r["records"] if x["backend"] == "vllm" and x["itl"] is not None]
        entry["vllm_bursts"] = (sum(x["itl"] < BURST_ITL_S for x in on_vllm), len(on_vllm))
        out[p] = entry
    out["checks"] = checks(out)
    out["by_backend"] = by_backend(runs, outputs)
    return out


def by_backend(runs: list[dict], outputs: dict[str, int]) -> dict:
    """Per class and engine, every placement and repeat pooled: what each engine delivered under this load."""
    out: dict = {}
    for kind in CLASSES:
        done = [x for r in runs for x in r["records"] if x["kind"] == kind and not failed(x, outputs)]
        for b in sorted({x["backend"] for x in done}):
            rs = [x for x in done if x["backend"] == b]
            out.setdefault(kind, {})[b] = {"n": len(rs), "ttft_p50": pct([x["ttft"] for x in rs], 0.5),
                                           "itl_p50": pct([x["itl"] for x in rs if x["itl"] is not None], 0.5),
                                           "e2e_p50": pct([x["e2e"] for x in rs], 0.5)}
    return out


def _med(summary: dict, p: str, *path: str) -> float | None:
    node = summary[p]
    for key in path:
        node = node.get(key) if node else None
    return node["median"] if node else None


def _values(summary: dict, p: str, *path: str) -> list[float]:
    node = summary[p]
    for key in path:
        node = node.get(key) if node else None
    return node["values"] if node else []


def checks(summary: dict) -> list[dict]:
    """The three checks on the medians of the repeats, and how many repeats pass each on their own."""
    others = ("round_robin", "least_loaded", "prefix_affinity")
    shape, pinned = _med(summary, "shape", "overall", "slo"), _med(summary, "pinned", "overall", "slo")
    best = max(others, key=lambda p: _med(summary, p, "overall", "slo"))
    other = _med(summary, best, "overall", "slo")
    s_ttft = _med(summary, "shape", "classes", "interactive", "ttft_p50")
    p_ttft = _med(summary, "pinned", "classes", "interactive", "ttft_p50")
    ratio = s_ttft / p_ttft if s_ttft is not None and p_ttft else None
    # per repeat: the same comparisons between the placements of one repeat (they ran minutes apart)
    per_shape, per_pinned = _values(summary, "shape", "overall", "slo"), _values(summary, "pinned", "overall", "slo")
    per_other = [max(v) for v in zip(*(_values(summary, p, "overall", "slo") for p in others), strict=True)]
    n = len(per_shape)
    per_ttft = list(zip(_values(summary, "shape", "classes", "interactive", "ttft_p50"),
                        _values(summary, "pinned", "classes", "interactive", "ttft_p50"), strict=True))
    return [
        {"name": "`shape` within 5 points of the pinned placement's overall SLO attainment (or above it)",
         "met": shape >= pinned - 0.05,
         "repeats": (sum(s >= p - 0.05 for s, p in zip(per_shape, per_pinned, strict=True)), n),
         "detail": f"shape {shape:.1%}, pinned {pinned:.1%}: {100 * (shape - pinned):+.1f} points"},
        {"name": "`shape` at least 10 points above the best other policy",
         "met": shape - other >= 0.10,
         "repeats": (sum(s - o >= 0.10 for s, o in zip(per_shape, per_other, strict=True)), n),
         "detail": f"shape {shape:.1%}, best other `{best}` {other:.1%}: {100 * (shape - other):+.1f} points"},
        {"name": "`shape`'s interactive TTFT p50 within 2x of the pinned placement's",
         "met": ratio is not None and ratio <= 2.0, "repeats": (sum(s <= 2 * p for s, p in per_ttft), len(per_ttft)),
         "detail": (f"shape {s_ttft * 1000:.1f} ms, pinned {p_ttft * 1000:.1f} ms: {ratio:.2f}x" if ratio is not None
                    else "no interactive TTFT for one of them")},
    ]


def _m(a: dict | None, scale: float = 1000.0, digits: int = 0, unit: str = " ms") -> str:
    """Median of the repeats (min-max)."""
    if a is None:
        return "-"
    v = a["values"]
    if len(v) == 1:
        return f"{a['median'] * scale:.{digits}f}{unit}"
    return f"{a['median'] * scale:.{digits}f}{unit} ({min(v) * scale:.{digits}f}-{max(v) * scale:.{digits}f})"


def _loads(v: list[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in v)


def markdown(meta: dict, summary: dict) -> str:
    cal, wl = meta["calibration"], meta["workload"]
    kinds = {k["name"]: k for k in meta["kinds"]}
    eng = meta["engines"]
    placements = meta["placements"]
    per_word = cal["prompt_tokens"]["summarization"] / kinds["summarization"]["words"]
    dirty = " (working tree dirty: uncommitted changes by others were present)" if meta["dirty"] else " (clean tree)"
    lines = [
        "# Routing policies on the real engines (llama.cpp + vLLM CPU)", "",
        "The real engines of the e2e suite, started once and kept warm, serve one public model through the gateway: "
        "llama-server with 2 slots (`interactive = true`) and vLLM CPU. Per repeat, each placement in turn gets a "
        "fresh gateway process in front of the same engines and the same seeded arrivals; the order of the "
        "placements rotates by one per repeat. The prompt texts are new for every run, so no run finds its prompts "
        "in a cache that an earlier run filled. Before each run both engines must report nothing running or waiting "
        f"on their `/metrics`, then {meta['pause_s']:g} s pass. The load generator (one asyncio process) measures "
        "TTFT, ITL and e2e per request as a client sees them, and reads the serving backend from "
        "`x-shapegate-backend`.", "",
        f"- Commit `{meta['commit']}`{dirty}; run {meta['date']}; {meta['elapsed_s'] / 60:.1f} min in all.",
        f"- Machine: {meta['machine']}, shared with other work: load average (1/5/15 min) "
        f"{_loads(meta['load_before'])} before, {_loads(meta['load_after'])} after.",
        f"- Command: `{meta['command'].strip()}`: {meta['repeats']} repeat(s) x {len(placements)} placements, "
        f"{meta['window_s']:g} s of arrivals per run, requests still running {meta['drain_s']:g} s after the window "
        "are cut (counted as failed).",
    ]
    for e in eng.values():
        lines.append(f"- {e['version']}, started in {e['startup_s']:.2f} s: `{' '.join(e['argv'])}`")
    lines += [
        "", "## Placements", "",
        "- `round_robin`, `least_loaded`, `prefix_affinity`, `shape`: the policy, both backends take every class.",
        "- `pinned`: what an operator would write by hand: `round_robin` with `classes = [\"interactive\"]` on "
        "llama.cpp and `classes = [\"long_output\", \"long_prompt\", \"default\"]` on vLLM (sessions on llama.cpp "
        "only, everything else on vLLM).",
        f"- Gateway settings common to all: `[shape] long_prompt_tokens = {wl['long_prompt_tokens']}` (scaled: the "
        f"gateway estimates 4 characters per token, and this tiny vocabulary makes ~{per_word:.1f} tokens of each "
        "4-character word, so the default 768 would only take prompts longer than a llama.cpp slot holds); health "
        "timeout 30 s "
        "and load samples stale after 10 s (a busy vLLM on two cores can leave `/health` and `/metrics` "
        f"unanswered for seconds); {wl['warmup_requests']} small warm-up requests per run before the measured "
        "window, the same for every placement.",
        "", "## Workload", "",
        "| kind | gateway class | prompt | output tokens | arrivals |", "|---|---|---|---|---|",
    ]
    toks = cal["prompt_tokens"]
    rates = cal["rates"]
    lines.append(f"| interactive | interactive | {kinds['interactive']['words']} words of system prompt "
                 f"(~{toks.get('interactive', '?')} tokens with the first turn), then +{wl['user_turn_words']} words "
                 f"and the previous reply per turn | {kinds['interactive']['output']} | {wl['session_users']} users, "
                 f"each running {wl['session_turns']}-turn sessions back to back (`x-session-id`), next turn "
                 f"{wl['think_s'] / 2:g}-{wl['think_s'] * 1.5:g} s (uniform) after the reply |")
    lines.append(f"| generation | long_output | {kinds['generation']['words']} words (~{toks.get('generation', '?')} "
                 f"tokens) | {kinds['generation']['output']} | Poisson, {rates['generation']:.2f}/s |")
    lines.append(f"| summarization | long_prompt | {kinds['summarization']['words']} words "
                 f"(~{toks.get('summarization', '?')} tokens) | {kinds['summarization']['output']} | Poisson, "
                 f"{rates['summarization']:.2f}/s |")
    lines.append(f"| agent | default | {kinds['agent']['words']}-word system prompt, one of {wl['agent_systems']} "
                 f"shared per run, + {wl['agent_user_words']} words (~{toks.get('agent', '?')} tokens) | "
                 f"{kinds['agent']['output']} | Poisson, {rates['agent']:.2f}/s |")
    lines += ["", "Every request streams with `ignore_eos`, so it generates exactly its output tokens. Token counts "
              "are llama-server's `/tokenize` of the message texts (both engines use the same vocabulary).", "",
              "## Single-request speed, SLOs and rates", "",
              f"Measured after start-up, directly on each engine (no gateway), {wl['calibration_requests']} requests "
              "of each kind one at a time (the agent requests share one system prompt, as in the workload; a session "
              "turn is a mid-session prompt with two earlier turns). Medians; ITL leaves out bursts (a whole answer "
              "in one read, tokens under 0.1 ms apart).", "",
              "| kind | llama.cpp TTFT / ITL / e2e | vLLM TTFT / ITL / e2e | SLO: TTFT / ITL | rate |",
              "|---|---|---|---|---|"]
    for name in CLASSES:
        cells = []
        for e in ("llamacpp", "vllm"):
            f = cal["per_engine"][name][e]
            itl = f"{f['itl'] * 1000:.2f}" if f["itl"] is not None else "-"
            cell = f"{f['ttft'] * 1000:.1f} / {itl} / {f['e2e'] * 1000:.0f} ms"
            cells.append(f"**{cell}**" if cal["best"][name] == e else cell)
        s = cal["slo"][name]
        rate = f"{rates[name]:.2f}/s" if name in rates else f"{wl['session_users']} session users"
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {s['ttft'] * 1000:.0f} ms / {s['itl'] * 1000:.2f} ms | "
                     f"{rate} |")
    lines += [
        "", f"- SLO of a kind: from the better engine for it (the lower median e2e, in bold): TTFT <= "
        f"{cal['factor']:g} x its median TTFT, but not under {cal['ttft_floor_s'] * 1000:.0f} ms (tighter TTFTs "
        f"would measure this shared machine's scheduling noise, not the routing), and ITL <= {cal['factor']:g} x "
        "its median ITL (the other engine's if it only burst). A request meets its SLO when it completes with both.",
        f"- Rates: the offered load is set so that, served one at a time at the better engine's single-request "
        f"e2e, the requests would keep one server busy {cal['load']:.0%} of the time. The session users take "
        f"{cal['session_busy']:.0%} of that (e2e / (e2e + mean think time) each); the rest is split generation "
        f"{kinds['generation']['share']:.0%}, summarization {kinds['summarization']['share']:.0%}, agent "
        f"{kinds['agent']['share']:.0%}, and each kind's rate is its share / its better engine's e2e. Batching lets "
        "the pair serve more than one request at a time, but both engines share the same two cores, so this is a "
        "loaded machine, not an idle one.",
        "", "## Results", "",
        "Medians over the repeats, (min-max) of the repeats in brackets. SLO attainment: the share of requests "
        "meeting both their TTFT and ITL SLO; failed requests count as misses.", "",
        "| placement | overall SLO attainment | per repeat | requests | failed | load average (1 min) at each run's "
        "start |",
        "|---|---|---|---|---|---|",
    ]
    for p in placements:
        o = summary[p]["overall"]
        per = " / ".join(f"{v * 100:.0f}" for v in o["slo"]["values"])
        lines.append(f"| {p} | {_m(o['slo'], 100, 1, ' %')} | {per} % | {_m(o['n'], 1, 0, '')} | "
                     f"{_m(o['failed'], 1, 0, '')} | {_loads(summary[p]['load1'])} |")
    lines += ["", "### Checks", ""]
    for c in summary["checks"]:
        lines.append(f"- {c['name']}: **{'met' if c['met'] else 'not met'}** ({c['detail']}); taken repeat by "
                     f"repeat (against that repeat's own figures): met in {c['repeats'][0]} of {c['repeats'][1]}.")
    lines += ["", "### Per class", "",
              "| class | placement | requests | TTFT p50 | TTFT p90 | ITL p50 | e2e p50 | SLO | failed | backends "
              "(all repeats) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for kind in CLASSES:
        for p in placements:
            c = summary[p]["classes"].get(kind)
            if c is None:
                continue
            total = sum(c["backends"].values())
            mix = ", ".join(f"{b} {n / total:.0%}" for b, n in sorted(c["backends"].items()))
            lines.append(f"| {kind} | {p} | {_m(c['n'], 1, 0, '')} | {_m(c['ttft_p50'])} | {_m(c['ttft_p90'])} | "
                         f"{_m(c['itl_p50'], 1000, 2)} | {_m(c['e2e_p50'])} | {_m(c['slo'], 100, 0, ' %')} | "
                         f"{_m(c['failed'], 1, 0, '')} | {mix} |")
    lines += ["", "### What each engine delivered, per class", "",
              "Every placement and repeat pooled (completed requests), whoever sent the request there; what else "
              "ran beside it differs between the placements.", "",
              "| class | engine | requests | TTFT p50 | ITL p50 | e2e p50 |", "|---|---|---|---|---|---|"]
    for kind, engines in summary["by_backend"].items():
        for b, f in engines.items():
            lines.append(f"| {kind} | {b} | {f['n']} | {f['ttft_p50'] * 1000:.0f} ms | {f['itl_p50'] * 1000:.2f} ms | "
                         f"{f['e2e_p50'] * 1000:.0f} ms |")
    lines += ["", "### Why `shape` sent each class where it did", "",
              "The most frequent `x-shapegate-reason` per class (numbers removed), over all repeats; then, of the "
              "decisions that name two predictions (`ttft=` or `e2e=` of the chosen backend `vs` the next one), the "
              "median of each and how often the chosen backend's own prediction was the slower one (it won on the "
              "queue, herd or slow-stream terms of the score, not on the predicted latency):", ""]
    for kind in CLASSES:
        c = summary["shape"]["classes"].get(kind)
        if c is None:
            continue
        line = f"- {kind}: " + "; ".join(f"`{r}` x{n}" for r, n in c["reasons"])
        pr = c["predicted"]
        if pr["n"]:
            line += (f". Predicted: chosen {pr['chosen']:.2f} s vs next {pr['other']:.2f} s (medians of {pr['n']}); "
                     f"chosen predicted slower in {pr['chosen_slower']} of {pr['n']}")
        lines.append(line + ".")
    lines += ["", "## Reading the numbers", ""]
    bursts = [(p, *summary[p]["vllm_bursts"]) for p in placements if summary[p]["vllm_bursts"][1]]
    if bursts:
        lines.append("- vLLM on two cores often holds tokens and sends a whole answer (or a large part) at once: "
                     "such a request shows an ITL near zero and a TTFT close to its e2e. Share of vLLM-served "
                     "requests that arrived as one burst: " + ", ".join(f"{p} {b}/{n}" for p, b, n in bursts) + ".")
    swing = max(max(v) - min(v) for p in placements if (v := summary[p]["overall"]["slo"]["values"]))
    lines += [
        f"- Between the repeats of one placement the overall attainment moved by up to {100 * swing:.0f} points "
        "(max - min): differences between placements smaller than that are within this machine's noise.",
        "- The SLOs are tight by design (a few times an unloaded engine's latency): with both engines on the same "
        "two cores, one engine's work slows the other, and the rest of the machine's load (see the load averages) "
        "adds noise that hits every placement of a repeat alike.",
        "- The backends column is where each class went, from `x-shapegate-backend` (`none`: no answer).",
        "- Both engines were idle (nothing running or waiting) before every run; the longest wait for that was "
        f"{max(summary[p]['idle_wait_s'] for p in placements):.1f} s.",
        "", f"Generated by `python -m benchmarks.routing_real` on {meta['date']}; "
        "raw records in `routing_real.json`; `python -m benchmarks.routing_real --from-json "
        "benchmarks/results/routing_real.json` re-renders this page.",
    ]
    return "\n".join(lines) + "\n"
