"""The overhead benchmark's markdown: conditions, table and reading, all computed from the run's own numbers."""

from __future__ import annotations

import statistics
from collections import Counter

from benchmarks import kit

EVENTS = 203  # data events per stream of 200 chunks: role, 200 tokens, finish, usage ([DONE] not counted)
LABEL = {"nonstream": "non-streamed", "stream": "streams"}


def by_rep(pts: list[dict], kind: str, conc: int, target: str) -> dict[int, dict]:
    return {p["rep"]: p for p in pts if (p["kind"], p["conc"], p["target"]) == (kind, conc, target)}


def cells(results: dict) -> list[tuple[str, int]]:
    return sorted({(p["kind"], p["conc"]) for p in results["points"]}, key=lambda k: (k[0] != "nonstream", k[1]))


def gateways(results: dict) -> list[str]:
    return ["before", "after"] if results["conditions"].get("baseline_ref") else ["gateway"]


def ratios(pts: list[dict], kind: str, conc: int, key: str) -> list[float]:
    """after/before per repeat: the two ran seconds apart in the same repeat, on a machine in a like state."""
    after, before = by_rep(pts, kind, conc, "after"), by_rep(pts, kind, conc, "before")
    return [after[r][key] / before[r][key] for r in sorted(after) if r in before and before[r][key]]


def fmt(values: list[float], spread: bool = True) -> str:
    return kit.pm(kit.median_spread(values)) if spread and len(values) > 1 else f"{statistics.median(values):,.0f}"


def fmt_ratio(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.2f}" if values else "-"
    return kit.span(values)


def table(results: dict) -> str:
    pts, gws = results["points"], gateways(results)
    two = len(gws) == 2
    head = ("| kind | conc | target | p50 us | p99 us | added p50 us | req/s | CPU/req us | chunks/s |"
            + (" CPU/req after/before | req/s after/before |" if two else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for kind, conc in cells(results):
        direct = by_rep(pts, kind, conc, "direct")
        for i, target in enumerate(["direct", *gws, "floor"]):
            s = by_rep(pts, kind, conc, target)
            if not s:
                continue
            v = [s[r] for r in sorted(s)]
            added = [s[r]["p50"] - direct[r]["p50"] for r in sorted(s) if r in direct]
            rps = [p["rps"] for p in v]
            cpu = fmt([p["cpu_per_req_us"] for p in v]) if v[0]["cpu_per_req_us"] is not None else "-"
            row = (f"| {kind if i == 0 else ''} | {conc if i == 0 else ''} | {target} | {fmt([p['p50'] for p in v])} | "
                   f"{fmt([p['p99'] for p in v], False)} | {fmt(added, False) if target != 'direct' else '-'} | "
                   f"{fmt(rps)} | {cpu} | {fmt([x * EVENTS for x in rps], False) if kind == 'stream' else '-'} |")
            if two:
                after = target == "after"
                row += (f" {fmt_ratio(ratios(pts, kind, conc, 'cpu_per_req_us')) if after else ''} |"
                        f" {fmt_ratio(ratios(pts, kind, conc, 'rps')) if after else ''} |")
            lines.append(row)
    return "\n".join(lines)


def judged(values: list[float]) -> str:
    """An after/before ratio with its range, and only what that range allows one to say."""
    m = statistics.median(values)
    if len(values) < 2:
        return f"after/before {m:.2f}"  # one repeat: no range; markdown() says so once
    text = f"after/before {m:.2f}, range {min(values):.2f}-{max(values):.2f}"
    if min(values) <= 1.0 <= max(values):
        return text + ": the range includes 1.0, the difference is not resolved"
    every = "both repeats" if len(values) == 2 else f"all {len(values)} repeats"
    return text + f": {'below' if max(values) < 1 else 'above'} 1.0 in {every}"


def med(s: dict[int, dict], key: str) -> float:
    return statistics.median(p[key] for p in s.values())


def compared(pts: list[dict], kind: str, conc: int) -> str:
    """One bullet: the two gateways' CPU per request and rate at one point."""
    b, a = by_rep(pts, kind, conc, "before"), by_rep(pts, kind, conc, "after")
    cpu, rps = judged(ratios(pts, kind, conc, "cpu_per_req_us")), judged(ratios(pts, kind, conc, "rps"))
    what, rate, scale = (("non-streamed request", "Requests/s", 1) if kind == "nonstream" else
                         ("200-chunk stream", "Chunks/s", EVENTS))
    return (f"- CPU per {what} at c={conc}: before {med(b, 'cpu_per_req_us'):,.0f} us, after "
            f"{med(a, 'cpu_per_req_us'):,.0f} us ({cpu}). {rate}: before {med(b, 'rps') * scale:,.0f}, after "
            f"{med(a, 'rps') * scale:,.0f} ({rps}).")


def alone(pts: list[dict], kind: str, conc: int) -> str:
    """One bullet: the single gateway against direct and the floor at one point."""
    g, d, f = (by_rep(pts, kind, conc, t) for t in ("gateway", "direct", "floor"))
    what, rate, scale = (("non-streamed request", "Requests/s", 1) if kind == "nonstream" else
                         ("200-chunk stream", "Chunks/s", EVENTS))
    return (f"- CPU per {what} at c={conc}: {med(g, 'cpu_per_req_us'):,.0f} us (floor {med(f, 'cpu_per_req_us'):,.0f}"
            f" us). {rate}: {med(g, 'rps') * scale:,.0f} (direct {med(d, 'rps') * scale:,.0f}, floor "
            f"{med(f, 'rps') * scale:,.0f}).")


def notes(results: dict) -> list[str]:
    """Bullets over all points: against the floor, latency at the lowest concurrency, errors, noise."""
    c, pts, gws = results["conditions"], results["points"], gateways(results)
    out = []
    for kind in ("nonstream", "stream"):
        convs = [conc for k, conc in cells(results) if k == kind]
        if not convs:
            continue
        vs_floor = {g: [med(by_rep(pts, kind, n, g), "cpu_per_req_us")
                        / med(by_rep(pts, kind, n, "floor"), "cpu_per_req_us") for n in convs] for g in gws}
        added = {g: med(by_rep(pts, kind, convs[0], g), "p50") - med(by_rep(pts, kind, convs[0], "direct"), "p50")
                 for g in gws}
        out.append(f"- {LABEL[kind].capitalize()}, CPU per request as a multiple of the floor's at "
                   f"c={'/'.join(map(str, convs))}: " + ", ".join(
                       f"{g} {min(v):.2f}-{max(v):.2f}x" if len(v) > 1 else f"{g} {v[0]:.2f}x"
                       for g, v in vs_floor.items())
                   + f". At c={convs[0]} the p50 lies above direct's by "
                   + ", ".join(f"{v:,.0f} us ({g})" for g, v in added.items()) + ".")
    below = [f"{k} c={n} ({t})" for k, n in cells(results) for t in [*gws, "floor"]
             if statistics.median(p["p50"] - by_rep(pts, k, n, "direct")[p["rep"]]["p50"]
                                  for p in by_rep(pts, k, n, t).values()) < 0]
    if below:
        out.append("- Added p50 is negative at " + ", ".join(below) + ": there the proxy's p50 was below direct's in "
                   "the same repeat, so at these points added p50 does not measure what the proxy costs.")
    errors = Counter()
    for p in pts:
        errors[f"{p['target']} {p['kind']} c={p['conc']}"] += p["errors"]
    errors = +errors  # only the points that had any
    out.append("- wrk counted no errors (non-2xx, connect, read, write, timeout) on any target." if not errors else
               "- wrk counted errors, which the rates and CPU per request above include: "
               + "; ".join(f"{k}: {v:,}" for k, v in errors.items()) + ".")
    if c["repeats"] > 1:
        spreads = [kit.median_spread([p["cpu_per_req_us"] for p in by_rep(pts, k, n, g).values()])[1] * 100
                   for k, n in cells(results) for g in gws]
        out.append(f"- The gateways' CPU per request varied between repeats by {statistics.median(spreads):.0f}% "
                   f"(median over the points; largest {max(spreads):.0f}%).")
    return out


def preface(results: dict) -> list[str]:
    """What before and after differ by, and what a single repeat cannot show."""
    c, out = results["conditions"], []
    if c.get("baseline_ref") and c["baseline_rev"] == c["head"]:
        out.append("- The baseline is the work tree's HEAD; " + (
            f"after adds the uncommitted changes ({c['dirty_gateway_paths']} paths under gateway/, backends/, "
            "policies/)." if c["dirty_gateway_paths"] else "gateway/, backends/ and policies/ have no uncommitted "
            "changes, so before and after run the same code: the differences below are what two processes of it "
            "differ by in this run."))
    if c.get("baseline_ref") and c["repeats"] < 2:
        out.append("- One repeat per point gives no range for the after/before ratios: none of the differences "
                   "below is resolved.")
    return out


def conditions(c: dict) -> str:
    two = bool(c.get("baseline_ref"))
    tree = ("clean" if not c["dirty_paths"] else f"with uncommitted changes in {c['dirty_paths']} paths, "
            f"{c['dirty_gateway_paths']} of them under gateway/, backends/, policies/")
    base = f"; baseline `{c['baseline_ref']}` = {c['baseline_rev']}" if two else ""
    load = " → ".join(" / ".join(f"{x:.2f}" for x in c[k]) for k in ("loadavg_before", "loadavg_after"))
    order = ", the two gateways' order alternating between repeats" if two else ""
    return (f"Run {c['date']}; work tree at {c['head']} ({tree}){base}. {c['cpus']} cores shared by wrk "
            f"({c['wrk']}), the engine, the floor proxy and the gateway{'s' if two else ''}; load average "
            f"(1 / 5 / 15 min) before → after the run: {load}. Each (kind, concurrency) point: {c['repeats']} x "
            f"{c['seconds']:g} s of wrk per target, the targets one after the other{order}; each proxy was first "
            f"warmed with 1 s of wrk per kind.")


TARGETS = {
    "gateway": "**gateway** = the work tree's gateway",
    "before": "**before** = the gateway of `{baseline_ref}` ({baseline_rev}), exported with `git archive` and run with "
              "its own packages on PYTHONPATH; **after** = the work tree's gateway",
}

METHOD = """Targets: **direct** = wrk straight to `benchmarks/fast_engine.py`, a zero-delay engine; {gateways}; \
**floor** = `benchmarks/floor_proxy.py`, a bare aiohttp proxy without auth, routing, stats or log. The gateway \
config: one backend, API-key auth, stats and the JSON access log on (stdout to /dev/null).

Figures are medians of the repeats, ± = (max-min)/median. Latencies are wrk's, in microseconds; added p50 = \
the target's p50 minus direct's in the same repeat. CPU/req = the process's user+system time (/proc) over the \
requests wrk completed; for streams a request is one stream of 200 chunks, and chunks/s counts its {events} data \
events (role, 200 tokens, finish, usage).{ratios}"""


def points(n: int) -> str:
    return "none" if n == 0 else "1 point" if n == 1 else f"{n} points"


def markdown(results: dict) -> str:
    c, pts, gws = results["conditions"], results["points"], gateways(results)
    method = METHOD.format(gateways=TARGETS[gws[0]].format(**c), events=EVENTS, ratios=(
        " after/before = the median of the per-repeat ratios, with their range." if len(gws) == 2 else ""))
    bullets = preface(results) + [(compared if len(gws) == 2 else alone)(pts, k, n) for k, n in cells(results)]
    if len(gws) == 2 and c["repeats"] > 1:
        rs = [ratios(pts, k, n, "cpu_per_req_us") for k, n in cells(results)]
        below, above = sum(max(r) < 1 for r in rs), sum(min(r) > 1 for r in rs)
        bullets.append(f"- CPU per request, after/before, over the {len(rs)} points: below 1.0 in every repeat at "
                       f"{points(below)}, above 1.0 in every repeat at {points(above)}, a range including 1.0 at "
                       f"{points(len(rs) - below - above)}.")
    return (f"# Gateway overhead\n\n{conditions(c)}\n\n{method}\n\n{table(results)}\n\n## Reading\n\n"
            + "\n".join(bullets + notes(results)) + "\n")
