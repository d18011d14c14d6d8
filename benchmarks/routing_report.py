"""Figures of the routing benchmark: per run, per class over the repeats pooled, and against the references."""

from __future__ import annotations

import math
import statistics
from collections import Counter

from benchmarks import kit
from benchmarks import routing_workload as W

KIND_BY_NAME = {k.name: k for k in W.KINDS}
CLASS_ORDER = tuple(k.name for k in W.KINDS)
# Fewer samples than this give no p90: with n < 20 the nearest-rank p90 is one of the two largest values.
MIN_P90 = 20


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


def agg(values: list) -> dict | None:
    """Median of the repeats and the spread (max - min) / median."""
    v = [x for x in values if x is not None]
    if not v:
        return None
    med, spread = kit.median_spread(v)
    return {"median": med, "spread": spread, "values": v}


def run_overall(run: dict) -> dict:
    recs = run["records"]
    tokens = sum(r["tokens"] for r in recs if r["ok"] and not r["censored"])
    return {
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


def class_figures(recs: list[dict]) -> dict:
    """One class's requests of every accepted repeat, pooled: n, percentiles, SLO share, placements."""
    done = [r for r in recs if r["ok"] and not r["censored"]]
    ttft = [r["ttft"] for r in done]
    itl = [r["itl"] for r in done if r["itl"] is not None]
    return {"n": len(recs), "done": len(done),
            "ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9) if len(ttft) >= MIN_P90 else None,
            "itl_p50": pct(itl, 0.5), "itl_p90": pct(itl, 0.9) if len(itl) >= MIN_P90 else None,
            "e2e_mean": statistics.fmean(r["e2e"] for r in recs if r["e2e"] is not None),
            "slo": sum(meets_slo(r) for r in recs) / len(recs),
            "backends": dict(Counter(r["backend"] or "?" for r in recs))}


def summarize(runs: list[dict], loads: list[str], policies: tuple[str, ...]) -> dict:
    """Per (load, policy): overall figures as medians of the accepted repeats, classes pooled over them."""
    out: dict = {}
    for load in loads:
        for policy in policies:
            ok = [r for r in runs if r["load"] == load and r["policy"] == policy and not r["rejected"]]
            per_run = [run_overall(r) for r in ok]
            recs = [rec for r in ok for rec in r["records"]]
            out[f"{load}/{policy}"] = {
                "repeats": len(ok),
                "overall": {m: agg([f[m] for f in per_run]) for m in per_run[0]} if per_run else {},
                "classes": {k: class_figures([r for r in recs if r["kind"] == k])
                            for k in CLASS_ORDER if any(r["kind"] == k for r in recs)}}
    return out


def reference_figures(references: list[dict], load: str, policies: tuple[str, ...]) -> dict:
    """Per reference (bound, greedy, each policy replayed): SLO attainment per seed, overall and per class."""
    refs = [r for r in references if r["load"] == load]
    out: dict = {}
    for name, pick in [("bound", lambda r: r["bound"]), ("greedy", lambda r: r["greedy"])] + [
            (f"replay/{p}", lambda r, p=p: r["replay"].get(p)) for p in policies]:
        figs = [f for f in map(pick, refs) if f is not None]
        if not figs:
            continue
        classes = {}
        for k in CLASS_ORDER:
            rows = [f["classes"][k] for f in figs if k in f["classes"]]
            if rows:
                n = sum(c["n"] for c in rows)
                mix: Counter = Counter()
                for c in rows:
                    mix.update(c["backends"])
                classes[k] = {"n": n, "slo": sum(c["slo"] * c["n"] for c in rows) / n, "backends": dict(mix)}
        out[name] = {"slo": agg([f["slo"] for f in figs]), "classes": classes}
    return out


def gaps(summary: dict, refs: dict, load: str) -> dict:
    """shape's distance, in points of SLO attainment (medians over the repeats), from the references."""
    live = summary[f"{load}/shape"]["overall"].get("slo")
    replayed = refs.get("replay/shape", {}).get("slo")

    def med(a: dict | None) -> float | None:
        return a["median"] if a else None

    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    return {"live": med(live), "replay": med(replayed), "greedy": med(refs["greedy"]["slo"]),
            "bound": med(refs["bound"]["slo"]),
            "greedy_minus_replay": diff(med(refs["greedy"]["slo"]), med(replayed)),
            "bound_minus_live": diff(med(refs["bound"]["slo"]), med(live)),
            "replay_minus_live": diff(med(replayed), med(live))}


def misses(runs: list[dict], load: str, policy: str) -> list[tuple[str, str, int, int]]:
    """(class, backend, SLO misses, requests sent there) over the accepted repeats, most misses first."""
    sent: Counter = Counter()
    missed: Counter = Counter()
    for run in runs:
        if run["load"] == load and run["policy"] == policy and not run["rejected"]:
            for r in run["records"]:
                sent[r["kind"], r["backend"] or "?"] += 1
                missed[r["kind"], r["backend"] or "?"] += not meets_slo(r)
    return sorted(((k, b, m, sent[k, b]) for (k, b), m in missed.items() if m), key=lambda x: (-x[2], x[0], x[1]))
