"""An experiment's report: per-arm figures and every verdict (mean, median, tail), from a snapshot, off the loop."""

from __future__ import annotations

from gateway.experiments.experiment import ALL
from gateway.experiments.verdict import METRICS, compare, describe, stats_of, summary


def report(snap: dict) -> dict:
    """An experiment's state, per-arm figures and every comparison (each arm against the first) with its
    verdict, from Experiment.snapshot() (pure: runs in a thread).

    A comparison is one request class and metric: the means' verdict, with the quantiles' (p50, p99) under
    `quantiles`, each a full verdict of its own."""
    classes = snap.pop("classes")
    shadow, agreement = snap.pop("shadow"), snap.pop("agreement")
    # The share each arm gets now in this process: an arm the error guard stopped here gets none.
    weights = {a["name"]: (a["weight"] or 0) if a.get("serving", True) else 0 for a in snap["arms"]}
    total = sum(weights.values()) or 1.0
    for a in snap["arms"]:
        n = a["name"]
        a["share"] = round(weights[n] / total, 4) if a["weight"] is not None else None
        a["classes"] = {key.split("|", 1)[1]: {"requests": c["requests"], "errors": c["errors"],
                                               **{m: summary(c["samples"][m]) for m in METRICS if m != "error_rate"}}
                        for key, c in classes.items() if key.split("|", 1)[0] == n}
        if snap["mode"] == "shadow" and a["weight"] is not None:
            a["shadow"] = _shadow(a.pop("in_flight"), n, shadow, agreement)
        else:
            a.pop("in_flight", None)
    snap["comparisons"] = _comparisons(snap, classes)
    return snap


def _shadow(in_flight: int | None, arm: str, shadow: dict, agreement: dict) -> dict:
    """A shadow arm's copies (sent, skipped, failed) and how often it said what the primary said."""
    ag = agreement.get(arm) or {"compared": 0, "exact": 0, "prefix_share": [], "prefix_tokens": []}
    return {"in_flight": in_flight,
            **{key.split("|", 1)[1]: v for key, v in shadow.items() if key.split("|", 1)[0] == arm},
            "agreement": {"compared": ag["compared"], "exact": ag["exact"],
                          "exact_rate": round(ag["exact"] / ag["compared"], 4) if ag["compared"] else None,
                          "common_prefix_share": summary(ag["prefix_share"]),
                          "common_prefix_tokens": summary(ag["prefix_tokens"])}}


def _comparisons(snap: dict, classes: dict) -> list[dict]:
    names = [a["name"] for a in snap["arms"]]
    margin = snap.get("practical_margin", 0.05)
    klasses = sorted({key.split("|", 1)[1] for key in classes}, key=lambda k: (k != ALL, k))
    comparisons = []
    for other in names[1:]:
        for k in klasses:
            ca, cb = classes.get(f"{names[0]}|{k}"), classes.get(f"{other}|{k}")
            for m in METRICS:
                sa = ca["samples"][m] if ca else []
                sb = cb["samples"][m] if cb else []
                if not sa and not sb:
                    continue
                c, *quantiles = (_verdict(k, m, names[0], sa, other, sb, stat, margin) for stat in stats_of(m))
                c["quantiles"] = {q["stat"]: q for q in quantiles}
                comparisons.append(c)
    return comparisons


def _verdict(klass: str, metric: str, a: str, sa: list, b: str, sb: list, stat: str, margin: float) -> dict:
    c = compare(klass, metric, a, sa, b, sb, stat=stat, margin=margin)
    c["summary"] = describe(c)
    return c
