"""Figures and tables of the routing benchmark: per class and overall, medians of the repeats with their spread."""

from __future__ import annotations

import math
import statistics
from collections import Counter

from benchmarks import routing_workload as W

KIND_BY_NAME = {k.name: k for k in W.KINDS}
CLASS_ORDER = ("generation", "summarization", "agent", "interactive", "long_chat")


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def meets_slo(r: dict) -> bool:
    k = KIND_BY_NAME[r["kind"]]
    return bool(r["ok"] and not r["censored"] and r["ttft"] is not None and r["ttft"] <= k.ttft_slo
                and (r["itl"] is None or r["itl"] <= k.itl_slo))


def run_figures(run: dict) -> dict:
    recs = run["records"]
    out: dict = {"classes": {}}
    for kind in CLASS_ORDER:
        rs = [r for r in recs if r["kind"] == kind]
        if not rs:
            continue
        done = [r for r in rs if r["ok"] and not r["censored"]]
        out["classes"][kind] = {
            "n": len(rs),
            "ttft_p50": pct([r["ttft"] for r in done], 0.5), "ttft_p99": pct([r["ttft"] for r in done], 0.99),
            "itl_p50": pct([r["itl"] for r in done if r["itl"] is not None], 0.5),
            "e2e_mean": statistics.fmean(r["e2e"] for r in rs if r["e2e"] is not None),
            "slo": sum(meets_slo(r) for r in rs) / len(rs),
            "backends": dict(Counter(r["backend"] or "?" for r in rs)),
        }
    tokens = sum(r["tokens"] for r in recs if r["ok"] and not r["censored"])
    out["overall"] = {
        "n": len(recs),
        # Requests cut at the drain cap count with the time they had run: a lower bound on their e2e.
        "e2e_mean": statistics.fmean(r["e2e"] for r in recs if r["e2e"] is not None) if recs else None,
        "slo": sum(meets_slo(r) for r in recs) / len(recs) if recs else None,
        "throughput_tps": tokens / run["wall_s"],
        "censored": sum(r["censored"] for r in recs),
        "errors": sum(1 for r in recs if not r["ok"] and not r["censored"]),
        # A request refused as too long although some engine of the portfolio holds it fails a policy.
        "too_long": sum(1 for r in recs if r.get("status") == 400),
    }
    return out


def agg(values: list) -> dict | None:
    """Median of the repeats and the spread (max - min) / median."""
    v = [x for x in values if x is not None]
    if not v:
        return None
    med = statistics.median(v)
    return {"median": med, "spread": (max(v) - min(v)) / med if med else 0.0, "values": v}


def summarize(runs: list[dict], loads: list[str], policies: tuple[str, ...]) -> dict:
    out: dict = {}
    for load in loads:
        for policy in policies:
            figs = [run_figures(r) for r in runs if r["load"] == load and r["policy"] == policy]
            entry = {"overall": {m: agg([f["overall"][m] for f in figs])
                                 for m in ("e2e_mean", "slo", "throughput_tps", "censored", "errors", "too_long",
                                           "n")},
                     "classes": {}}
            for kind in CLASS_ORDER:
                rows = [f["classes"][kind] for f in figs if kind in f["classes"]]
                if rows:
                    mix: Counter = Counter()
                    for row in rows:
                        mix.update(row["backends"])
                    entry["classes"][kind] = {m: agg([row[m] for row in rows])
                                              for m in ("n", "ttft_p50", "ttft_p99", "itl_p50", "e2e_mean", "slo")}
                    entry["classes"][kind]["backends"] = dict(mix)
            health = [h for r in runs if r["load"] == load and r["policy"] == policy for h in r["sim_health"].values()
                      if h is not None]
            entry["sim_late_share_max"] = max((h["late_share"] for h in health), default=None)
            out[f"{load}/{policy}"] = entry
    for load in loads:
        out[f"{load}/verdict"] = verdict(out, load, policies)
    return out


def verdict(summary: dict, load: str, policies: tuple[str, ...]) -> dict:
    """shape against round_robin and against the best of the others, on mean e2e and SLO attainment."""
    def med(policy: str, metric: str) -> float:
        return summary[f"{load}/{policy}"]["overall"][metric]["median"]

    others = [p for p in policies if p != "shape"]
    best_e2e = min(others, key=lambda p: med(p, "e2e_mean"))
    best_slo = max(others, key=lambda p: med(p, "slo"))
    s_e2e, s_slo = med("shape", "e2e_mean"), med("shape", "slo")
    return {
        "e2e_vs_round_robin": 1 - s_e2e / med("round_robin", "e2e_mean"),
        "e2e_vs_best_other": 1 - s_e2e / med(best_e2e, "e2e_mean"), "best_other_e2e": best_e2e,
        "slo_vs_round_robin": s_slo / med("round_robin", "slo") - 1 if med("round_robin", "slo") else None,
        "slo_vs_best_other": s_slo / med(best_slo, "slo") - 1 if med(best_slo, "slo") else None,
        "best_other_slo": best_slo,
    }


def _m(a: dict | None, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    if a is None:
        return "-"
    return f"{a['median'] * scale:.{digits}f}{unit} ±{a['spread'] * 50:.0f}%"


def markdown(meta: dict, summary: dict, loads: list[str], policies: tuple[str, ...]) -> str:
    lines = [
        "# Routing policies on the simulated R9700 portfolio",
        "",
        f"Machine: {meta['machine']}. {meta['repeats']} repeats; each repeat runs every (policy, load) stack at "
        f"the same time, each stack with its own four simulated engines (real time) and its own gateway process.",
        f"Per run: {meta['warmup']['requests']} warm-up requests (not measured), then {meta['window_s']:g} s of "
        f"Poisson arrivals; requests still running {meta['drain_s']:g} s after the window are cut (counted as "
        f"SLO misses, with the time they had run as their e2e: a lower bound).",
        "",
        "Portfolio (gateway backend id: sim profile): "
        + ", ".join(f"`{b}`: {p}{' (interactive = true)' if i else ''}" for b, _, p, i in meta["portfolio"]) + ".",
        "Context windows (tokens one request may hold): "
        + ", ".join(f"`{b}` {n:,}" for b, n in meta.get("windows", {}).items()) + ".",
        "",
        "| class | prompt tokens | output tokens | SLO |",
        "|---|---|---|---|",
    ]
    for k in W.KINDS:
        extra = (f" (grows by {W.USER_TURN_TOKENS} + the reply each turn, {W.SESSION_TURNS} turns, "
                 f"{W.THINK_S:g} s think time)" if k is W.INTERACTIVE else "")
        extra += f" ({W.AGENT_SYSTEM_PROMPTS} shared system prompts)" if k is W.AGENT else ""
        lines.append(f"| {k.name} | ~{k.prompt_tokens}{extra} | {k.output_tokens} | TTFT <= {k.ttft_slo:g} s and "
                     f"ITL <= {k.itl_slo * 1000:g} ms |")
    for load in loads:
        rates = meta["loads"][load]
        lines += ["", f"## {load} load: generation {rates['generation']}/s, summarization {rates['summarization']}/s, "
                  f"agent {rates['agent']}/s, sessions {rates['sessions']}/s, long chats {rates.get('long_chat', 0)}/s",
                  "", "Median of the repeats, ± half the spread (max - min) / median.", "",
                  "| policy | e2e mean | SLO attainment | output tok/s | requests | cut at drain | failed |",
                  "|---|---|---|---|---|---|---|"]
        for p in policies:
            o = summary[f"{load}/{p}"]["overall"]
            lines.append(f"| {p} | {_m(o['e2e_mean'], unit=' s')} | {_m(o['slo'], 100, 1, ' %')} | "
                         f"{_m(o['throughput_tps'], digits=0)} | {o['n']['median']:.0f} | "
                         f"{o['censored']['median']:.0f} | {o['errors']['median']:.0f} |")
        failed = {p: summary[f"{load}/{p}"]["overall"] for p in policies}
        lines += ["", "Failed requests, all repeats: " + ", ".join(
            f"{p} {sum(o['errors']['values']):.0f} (400 too long: {sum((o.get('too_long') or {'values': [0]})['values']):.0f})"
            for p, o in failed.items()) + "."]
        lines += ["", "Per repeat (repeat 1 / 2 / 3; the policies of one repeat ran side by side):", ""]
        for p in policies:
            o = summary[f"{load}/{p}"]["overall"]
            e2e = " / ".join(f"{v:.2f}" for v in o["e2e_mean"]["values"])
            slo = " / ".join(f"{v * 100:.0f}" for v in o["slo"]["values"])
            lines.append(f"- {p}: e2e mean {e2e} s; SLO attainment {slo} %")
        lines += ["", "| class | policy | TTFT p50 | TTFT p99 | ITL p50 | e2e mean | SLO | backends (all repeats) |",
                  "|---|---|---|---|---|---|---|---|"]
        for kind in CLASS_ORDER:
            for p in policies:
                c = summary[f"{load}/{p}"]["classes"].get(kind)
                if c is None:
                    continue
                mix = ", ".join(f"{b} {n}" for b, n in sorted(c["backends"].items()))
                lines.append(f"| {kind} | {p} | {_m(c['ttft_p50'], 1000, 0, ' ms')} | {_m(c['ttft_p99'], 1000, 0, ' ms')}"
                             f" | {_m(c['itl_p50'], 1000, 1, ' ms')} | {_m(c['e2e_mean'], unit=' s')} | "
                             f"{_m(c['slo'], 100, 0, ' %')} | {mix} |")
        v = summary[f"{load}/verdict"]
        lines += ["", f"**shape** vs round_robin: mean e2e {-v['e2e_vs_round_robin']:+.0%}, SLO attainment "
                  f"{v['slo_vs_round_robin']:+.0%} (relative); vs the best of the others ({v['best_other_e2e']} on "
                  f"e2e, {v['best_other_slo']} on SLO): mean e2e {-v['e2e_vs_best_other']:+.0%}, SLO attainment "
                  f"{v['slo_vs_best_other']:+.0%}."]
        late = [summary[f"{load}/{p}"]["sim_late_share_max"] for p in policies]
        if any(x is not None for x in late):
            lines.append(f"Simulator loop health: at most {max(x for x in late if x is not None):.0%} of engine "
                         f"steps delivered more than 2 ms late.")
    lines += ["", "## Reading the numbers", "",
              "- The engines are simulated in real time on the same 2 cores as the gateways and the load generator "
              "(and whatever else runs on the machine): the loop-health line gives the share of engine steps that "
              "went out late. Late steps slow every policy's stacks alike, since all of a repeat run side by side.",
              "- `shape` scores long outputs on e2e, so it will wait a few seconds for a fast-decoding llama.cpp slot "
              "rather than start at once on a slower engine: the generation TTFT p99 shows that price.",
              "- `prefix_affinity` runs with SGLang's router thresholds (abs 64, rel 1.5): at these request counts "
              "its overload escape rarely fires, so sessions and prefixes stay on whatever engine served them "
              "first, slow ones included.",
              "- The backends column is where each class went, summed over the repeats.",
              "", f"Generated by `python -m benchmarks.routing` in {meta['elapsed_s']:.0f} s; raw records in "
              "`routing.json`; `python -m benchmarks.routing --from-json routing.json` re-renders this page."]
    return "\n".join(lines) + "\n"
