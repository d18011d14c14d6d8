"""The peers benchmark's markdown: conditions, a row per target, the wrk cross-check and the targets, from the data."""

from __future__ import annotations

import statistics

from benchmarks import kit

ROWS = ("direct", "shapegate", "shapegate-w2", "shapegate-source", "python-floor", "vllm-router", "sglang-router",
        "nginx")
REF = "vllm-router"  # the peer the targets are set against


def fmt(values: list[float], unit: str = "") -> str:
    """The median, and its spread unless there is one value or the median is zero."""
    if not values:
        return "-"
    m, s = kit.median_spread(values)
    return f"{m:,.0f}{unit}" + (f" (±{s:.0%})" if m and len(values) > 1 else "")


class Data:
    """The run's points by (target, kind, conc) and round, and the figures the table and the checks read."""

    def __init__(self, results: dict) -> None:
        self.r = results
        self.pts: dict[tuple[str, str, int], dict[int, dict]] = {}
        for p in results["points"]:
            self.pts.setdefault((p["target"], p["kind"], p["conc"]), {})[p["round"]] = p

    def ok(self, target: str) -> bool:
        return self.r["targets"].get(target, {}).get("status") == "ok"

    def by_round(self, target: str, kind: str, conc: int, key: str) -> dict[int, float]:
        """round -> figure; rounds without it are left out."""
        rounds = self.pts.get((target, kind, conc), {})
        return {r: rounds[r][key] for r in sorted(rounds) if rounds[r].get(key) is not None}

    def added_by_round(self, target: str, kind: str, key: str) -> dict[int, float]:
        """round -> the target's figure at c=1 minus direct's in the same round."""
        mine, ref = self.by_round(target, kind, 1, key), self.by_round("direct", kind, 1, key)
        return {r: v - ref[r] for r, v in mine.items() if r in ref}

    def values(self, target: str, kind: str, conc: int, key: str) -> list[float]:
        return list(self.by_round(target, kind, conc, key).values())

    def added(self, target: str, kind: str, key: str) -> list[float]:
        return list(self.added_by_round(target, kind, key).values())


COLUMNS = ("target", "added p50 c=1, non-stream", "gateway CPU / request c=64", "req/s c=64", "p99 c=64",
           "added TTFT c=1, stream", "CPU / 200-chunk stream c=64", "tokens/s c=64", "TTFT p99 c=64")
RATE = "stream-rate"  # the point of streams started at one rate (conditions: stream_rate a second), 64 workers


def rate_of(d: Data) -> int | None:
    """Streams a second of the rate point, None for a run without one."""
    return d.r["conditions"].get("stream_rate")


def columns(d: Data) -> tuple[str, ...]:
    rate = rate_of(d)
    return COLUMNS + ((f"TTFT p99 at {rate} streams/s",) if rate else ())


def row(d: Data, t: str) -> list[str]:
    label = d.r["targets"][t]["label"]
    if not d.ok(t):
        when = "failed during the run" if d.r["targets"][t].get("stage") in ("run", "warm-up") else "did not run"
        return [f"{label} ({when})"] + ["-"] * (len(columns(d)) - 1)
    at_rate = [fmt(d.values(t, RATE, 64, "ttft_p99_us"), " us")] if rate_of(d) else []
    if t == "direct":  # the reference: its own c=1 figures where the others show what they add
        return [label, "ref: p50 " + fmt(d.values(t, "nonstream", 1, "p50_us"), " us"), "-",
                fmt(d.values(t, "nonstream", 64, "rps")), fmt(d.values(t, "nonstream", 64, "p99_us"), " us"),
                "ref: TTFT " + fmt(d.values(t, "stream", 1, "ttft_p50_us"), " us"), "-",
                fmt(d.values(t, "stream", 64, "tokens_per_s")), fmt(d.values(t, "stream", 64, "ttft_p99_us"), " us"),
                *at_rate]
    return [label, fmt(d.added(t, "nonstream", "p50_us"), " us"),
            fmt(d.values(t, "nonstream", 64, "cpu_per_req_us"), " us"), fmt(d.values(t, "nonstream", 64, "rps")),
            fmt(d.values(t, "nonstream", 64, "p99_us"), " us"), fmt(d.added(t, "stream", "ttft_p50_us"), " us"),
            fmt(d.values(t, "stream", 64, "cpu_per_req_us"), " us"), fmt(d.values(t, "stream", 64, "tokens_per_s")),
            fmt(d.values(t, "stream", 64, "ttft_p99_us"), " us"), *at_rate]


def table(d: Data) -> str:
    cols = columns(d)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(row(d, t)) + " |" for t in ROWS if t in d.r["targets"]]
    return "\n".join(lines)


def wrk_line(d: Data) -> str:
    """wrk's c=64 non-streamed rate per target, beside the client's."""
    parts = []
    for t in ROWS:
        runs = [w for w in d.r.get("wrk", []) if w["target"] == t and "rps" in w]
        if runs:
            mine = kit.median_or_none(d.values(t, "nonstream", 64, "rps"))
            ratio = f", {statistics.median(w['rps'] for w in runs) / mine:.2f}x the client's" if mine else ""
            parts.append(f"{d.r['targets'][t]['label']} {fmt([w['rps'] for w in runs])}{ratio}")
    failed = [f"{w['target']}: {w['error']}" for w in d.r.get("wrk", []) if "error" in w]
    if not parts and not failed:
        return f"- wrk was not run ({d.r['conditions']['wrk']}, {d.r['conditions']['wrk_seconds']:g} s per target)."
    return (f"- wrk (a second client: 2 threads, 64 connections, {d.r['conditions']['wrk_seconds']:g} s per target and "
            "round after the client's points, no warm-up of its own), non-streamed req/s at c=64: "
            + "; ".join(parts) + "."
            + (" wrk failed on " + "; ".join(failed) + "." if failed else ""))


def check(what: str, d: Data, mine: str, theirs: str | None, kind: str, key: str, limit: float,
          at_most: bool = True, conc: int = 64, added: bool = False) -> str:
    """One target line: `mine`'s figure against `limit` x `theirs`' (or against `limit` itself), met or not."""
    for t in (mine, theirs):
        if t is not None and not d.ok(t):
            err = d.r["targets"].get(t, {}).get("error", "not in this run")
            return f"- {what}: not judged, {d.r['targets'].get(t, {}).get('label', t)} did not run ({err})."
    def series(t: str) -> dict[int, float]:
        return d.added_by_round(t, kind, key) if added else d.by_round(t, kind, conc, key)

    a = kit.median_or_none(list(series(mine).values()))
    if a is None:
        return f"- {what}: not judged, no figure for {d.r['targets'][mine]['label']}."
    if theirs is None:
        ok = a <= limit if at_most else a >= limit
        return f"- {what}: **{'met' if ok else 'not met'}**, {a:,.0f} against {limit:,.0f}."
    mine_r, theirs_r = series(mine), series(theirs)
    b = kit.median_or_none(list(theirs_r.values()))
    if b is None or b <= 0:
        return f"- {what}: not judged, the {d.r['targets'][theirs]['label']}'s figure is {b} (not positive)."
    ratio = a / b
    ok = ratio <= limit if at_most else ratio >= limit
    per_round = [mine_r[r] / theirs_r[r] for r in mine_r if theirs_r.get(r, 0) > 0]
    held = sum((x <= limit) if at_most else (x >= limit) for x in per_round)
    return (f"- {what}: **{'met' if ok else 'not met'}**, {d.r['targets'][mine]['label']} {a:,.0f} against "
            f"{d.r['targets'][theirs]['label']} {b:,.0f}: {ratio:.2f}x (limit {limit:g}x; met in {held} of "
            f"{len(per_round)} rounds taken alone).")


def checks(d: Data) -> list[str]:
    sg, w2 = "shapegate", "shapegate-w2"
    return [
        check("CPU per non-streamed request at c=64, at most 0.8x the vLLM router's (us)", d, sg, REF, "nonstream",
              "cpu_per_req_us", 0.8),
        check("CPU per 200-chunk stream at c=64, at most 0.8x the vLLM router's (us)", d, sg, REF, "stream",
              "cpu_per_req_us", 0.8),
        check("p99 of non-streamed requests at c=64, at most the vLLM router's (us)", d, sg, REF, "nonstream",
              "p99_us", 1.0),
        check("p99 of first tokens at c=64, at most the vLLM router's (us)", d, sg, REF, "stream", "ttft_p99_us", 1.0),
        check("added p50 at c=1, at most 0.6x the vLLM router's (us)", d, sg, REF, "nonstream", "p50_us", 0.6,
              added=True),
        check("added first-token latency (p50) at c=1, under 300 us", d, sg, None, "stream", "ttft_p50_us", 300,
              added=True),
        check("req/s at c=64 with --workers 2, at least 1.2x the vLLM router's", d, w2, REF, "nonstream", "rps", 1.2,
              at_most=False),
        check("tokens/s at c=64 with --workers 2, at least 1.2x the vLLM router's", d, w2, REF, "stream",
              "tokens_per_s", 1.2, at_most=False),
    ] + ([check(f"p99 of first tokens at {rate_of(d)} streams/s (64 workers), at most the vLLM router's (us); a "
                "measure beside the c=64 one, not one of the targets", d, sg, REF, RATE, "ttft_p99_us", 1.0)]
         if rate_of(d) else [])


def rate_note(d: Data) -> list[str]:
    """Whether every target kept the rate point's schedule (a late start: all 64 workers were still busy)."""
    rate = rate_of(d)
    pts = [p for p in d.r["points"] if p["kind"] == RATE and p["requests"]]
    if not rate or not pts:
        return []
    done = [p["rps"] for p in pts]
    late = {d.r["targets"][p["target"]]["label"]: 0 for p in pts}
    for p in pts:
        late[d.r["targets"][p["target"]]["label"]] += p.get("late_starts", 0)
    behind = [f"{t} {n}" for t, n in late.items() if n]
    return [f"- At {rate} streams/s (200 tokens each, {rate * 200:,} tokens/s): the streams that ended in each window "
            f"came to {min(done):,.0f}-{max(done):,.0f} a second; "
            + ("no stream started later than 2 ms after its turn." if not behind else
               "streams started more than 2 ms after their turn (all 64 workers busy), over the rounds: "
               + ", ".join(behind) + ".")]


def notes(d: Data) -> list[str]:
    """Errors, what each stream carried, how busy the client was: what the figures rest on."""
    out = []
    errs = {f"{p['target']} {p['kind']} c={p['conc']} round {p['round'] + 1}": p["error_kinds"]
            for p in d.r["points"] if p["errors"]}
    out.append("- The client counted no failed request (non-200, malformed reply, closed connection, stream without "
               "tokens or [DONE], 30 s timeout)." if not errs else "- Failed requests (left out of the figures): "
               + "; ".join(f"{k}: {v}" for k, v in errs.items()) + ".")
    toks = {(p["tokens_min"], p["tokens_max"]) for p in d.r["points"] if p["kind"] == "stream" and p["requests"]}
    if toks:
        lo, hi = min(t[0] for t in toks), max(t[1] for t in toks)
        out.append(f"- Every counted stream carried {lo} tokens." if lo == hi else
                   f"- Counted streams carried {lo} to {hi} tokens.")
    busy = [p["client_cpu_s"] / p["window_s"] for p in d.r["points"] if p["conc"] == 64]
    if busy:
        out.append(f"- The client itself used {min(busy):.2f}-{max(busy):.2f} cores during the c=64 windows "
                   "(its own process; not counted as any target's CPU).")
    negative = [f"{d.r['targets'][t]['label']} ({what})" for t in ROWS if t != "direct" and d.ok(t)
                for what, kind, key in (("p50", "nonstream", "p50_us"), ("TTFT", "stream", "ttft_p50_us"))
                if d.added(t, kind, key) and statistics.median(d.added(t, kind, key)) < 0]
    if negative:
        out.append("- Added is negative for " + ", ".join(negative) + ": there the target's figure at c=1 was below "
                   "direct's in the same round, so it does not measure what the target adds (noise is larger).")
    floor, ours, ref = (d.values(t, "nonstream", 64, "cpu_per_req_us") for t in ("python-floor", "shapegate", REF))
    if floor and ours and ref:
        f, s, r = (statistics.median(v) for v in (floor, ours, ref))
        out.append(f"- CPU per non-streamed request at c=64: the Python floor {f:,.0f} us, {f / r:.2f}x the "
                   f"{d.r['targets'][REF]['label']}'s {r:,.0f} us; shapegate {s:,.0f} us, {s / f:.1f}x the floor's. "
                   "What shapegate spends beyond the floor is its own request path, not the language.")
    out += rate_note(d)
    loads = [p["load_before"][0] for p in d.r["points"]]
    if loads:
        out.append(f"- 1-minute load average at the start of the points: {min(loads):.2f}-{max(loads):.2f}.")
    return out


def failures(d: Data) -> list[str]:
    return [f"- {v['label']}: failed ({v.get('stage', '?')}): {v.get('error', '')}"
            for t, v in d.r["targets"].items() if v.get("status") != "ok"]


def versions(d: Data) -> str:
    return "; ".join(f"{v['label']} {v['version']}" for t, v in d.r["targets"].items()
                     if t not in ("direct", "shapegate-w2", "shapegate-source") and v.get("status") == "ok")


def shapes(d: Data) -> str:
    return "; ".join(f"{v['label']}: {v['shape']['processes']} / {v['shape']['threads']}"
                     for v in d.r["targets"].values() if "shape" in v) or "not recorded"


def commands(d: Data) -> list[str]:
    return [f"- {v['label']}: `{v['command']}`" for t, v in d.r["targets"].items()
            if t != "direct" and v.get("status") == "ok"]


FLOOR_TEXT = """

**Python floor** is `benchmarks/parsing_proxy.py`, not a product: what a Python process (uvloop, protocol \
callbacks, no task or future per request) spends when it reads what it routes and does nothing else: both sides \
framed by llhttp, the key compared, the body's JSON parsed, a reply head of its own, streams re-framed read by read. \
No health, limits, retries, routing policy, stats, metrics or logs. It shows how much of shapegate's figures is the \
language and how much is shapegate's own work."""

COMPILED_TEXT = "shapegate runs as its image does, the request path compiled by `deploy/compile.py` (mypyc)"
UNCOMPILED_ROW = ', except on the "shapegate, uncompiled" row (the same sources as plain Python)'


def rate_text(d: Data) -> str:
    rate = rate_of(d)
    if not rate:
        return ""
    return (f" The last column's point starts {rate} streams a second at even intervals from 64 workers (a worker "
            "whose turn comes while it is busy sends when it is free), whatever the target could relay: at c=64 "
            "without a rate, a target that relays faster also loads the engines and the client more (all share "
            "the cores), and their delays reach its first tokens; at one rate every target carries the same "
            "tokens a second.")


def markdown(results: dict) -> str:
    d, c = Data(results), results["conditions"]
    tree = "clean" if not c["dirty_paths"] else f"with uncommitted changes in {len(c['dirty_paths'])} paths"
    load = " → ".join(" / ".join(f"{x:.2f}" for x in c[k]) for k in ("load_before", "load_after"))
    rounds = ", ".join(f"{i + 1}: " + " → ".join(results["targets"][t]["label"] for t in o)
                       for i, o in enumerate(results["orders"]))
    fail = failures(d)
    floor = "python-floor" in results["targets"]
    floor_turn = ", the Python floor one engine per client connection, in turn" if floor else ""
    checkers = "shapegate and the Python floor check it" if floor else "only shapegate checks it"
    floor_text = FLOOR_TEXT if floor else ""
    build = (COMPILED_TEXT + (UNCOMPILED_ROW if "shapegate-source" in results["targets"] else "") + ". "
             if c.get("shapegate_build") == "compiled" else "")
    return f"""# shapegate beside the peer routers

Run {c['date']}, commit {c['commit']} ({tree}), `{c['command'].strip()}` ({c.get('duration_s', '?')} s). Machine: \
{c['machine']}. Load average (1 / 5 / 15 min) before → after the run: {load}; cores kept busy by others in the \
second before it started: {c['busy_cores_before']}. Versions: {versions(d) or 'no peer ran'}; {c['wrk']}.

All {c['cores']} cores are shared by the load client, wrk, the two engines and the target: nothing is pinned, \
and one target runs at a time while the others sit idle. {build}shapegate runs one process, except on the \
"shapegate --workers 2" row; nginx runs one worker process (`worker_processes 1`), so one process is compared \
with one process; the vLLM and SGLang routers run as they start, with their default thread pools. Processes / \
threads of each target after its warm-up: {shapes(d)}.

Setup: {c['engines']}. Every target routes over both engines (shapegate with its default policy, the routers \
round-robin, nginx its default round-robin with upstream keep-alive{floor_turn}); **direct** is the client \
straight to engine 1, the reference for the "added" columns (a target's figure minus direct's in the same round). \
shapegate has API-key auth on and its JSON access log on (stdout to /dev/null); the peers' stdout goes to /dev/null \
as well. Every target receives the same requests with the same `Authorization` header; {checkers}.{floor_text}

The client (`benchmarks/peers_client.py`, its own process, uvloop, one keep-alive connection per worker, replies \
parsed with llhttp) times each request, and for streams the first SSE data event carrying content (TTFT) and the \
tokens. Each point: {c['warmup']:g} s of load, then a {c['seconds']:g} s window in which the requests that finish \
are counted. CPU = user + system time (/proc) of the target's processes and threads over that window, divided by \
the requests that finished in it (a stream is one request of 200 tokens).{rate_text(d)} {c['rounds']} rounds, every \
target in each, in these orders: {rounds}. Figures are medians over the rounds, ± = (max-min)/median.

Commands (plus host, port and a free Prometheus port for the routers):
{chr(10).join(commands(d))}

{table(d)}
{chr(10) + '## Did not run, or stopped' + chr(10) + chr(10) + chr(10).join(fail) + chr(10) if fail else ''}
## Cross-check

{wrk_line(d)}

## Targets

{chr(10).join(checks(d))}

## Notes

{chr(10).join(notes(d))}
"""
