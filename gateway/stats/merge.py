"""The /stats feed: each process's mergeable summary, summaries merged (workers, replicas) and rendered as figures."""

from __future__ import annotations

import logging
import math
import time

from gateway.contracts import CLASSES, ENGINE_ERROR, LatencyEstimate
from gateway.stats import sketch
from gateway.stats.rolling import ATTEMPT_RESULTS, DISTRIBUTIONS, RESULT_INDEX

log = logging.getLogger("shapegate.stats")

VERSION = 1
FIT_FIELDS = ("ttft_t0", "prefill_rate", "itl_a", "itl_b", "samples", "ttft_per_running", "service_s")
# Where workers disagree about a backend, the merged row shows the state that matters most to an operator.
HEALTH_RANK = {"ready": 0, "starting": 1, "draining": 2, "unhealthy": 3}
BREAKER_RANK = {"closed": 0, "half_open": 1, "open": 2}
LOAD_FIELDS = ("running", "waiting", "kv_usage", "idle_slots")
MAX_COUNT = 2 ** 53  # a count above this is no count (and sums of such would not fit the feed's JSON)
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, ArithmeticError)  # what a summary can raise


def fold_counters(g, now: float) -> None:
    """Failovers and breaker openings counted since the last fold, into the rolling tally (and /metrics)."""
    for b in g.pool.all():
        g.tally.fold(("failovers", b.id), g.metrics.failovers.get(b.id, 0), now)
        opened = g.tally.fold(("breaker_openings", b.id), b.breaker.openings, now)
        if opened:
            g.metrics.breaker_opened(b.id, opened)


def take_summary(g, now_m: float | None = None, now_wall: float | None = None) -> dict:
    """This process's figures over the window, in a form that adds up across processes (JSON-ready)."""
    now_m = time.monotonic() if now_m is None else now_m
    now_wall = time.time() if now_wall is None else now_wall
    fold_counters(g, now_m)
    window = g.cfg.stats.window_s
    tallied = g.tally.window(now_m, window)
    backends = {}
    for b in g.pool.all():
        s = b.stats.summary(now_m, window)
        load = b.fresh_load(now_m)
        est = b.latency.estimate()
        backends[b.id] = {
            "engine": b.engine, "health": b.health.state, "breaker": b.breaker.state(now_m), "in_flight": b.in_flight,
            "seats": g.queue.seats(b, now_m),  # as the queue knows them: configured, slots or learned (0: not yet)
            "load": None if load is None else {
                "running": load.running, "waiting": load.waiting, "kv_usage": load.kv_usage,
                "idle_slots": load.idle_slots, "age_s": max(now_m - load.at, 0.0)},
            "fit": {f: getattr(est, f) for f in FIT_FIELDS},
            "failovers": tallied.get(("failovers", b.id), 0),
            "breaker_openings": tallied.get(("breaker_openings", b.id), 0),
            "unsupported": dict(b.unsupported), "misconfigured": b.misconfigured, "span_s": s["span_s"],
            "classes": s["classes"]}
    rejected: dict[str, int] = {}
    reasons: dict[str, dict[str, int]] = {}
    for key, n in tallied.items():
        if key[0] == "rejected":
            rejected[key[1]] = n
        elif key[0] == "reason":
            reasons.setdefault(key[1], {})[key[2]] = n
    sh = g.sharing
    return {"v": VERSION, "worker": sh.worker, "replica": sh.replica, "taken_at": now_wall, "window_s": window,
            "enabled": g.cfg.stats.enabled, "backends": backends, "rejected": rejected, "reasons": reasons,
            "keys": g.key_usage.summary(now_m, window),  # per key id (gateway/stats/key_usage.py)
            "queue": g.queue.report()}  # requests waiting for a seat in this process (gateway/queueing/)


# -- merging ------------------------------------------------------------------------------------------
def _acc() -> dict:
    return {"n": [0] * len(ATTEMPT_RESULTS), "tokens": 0, "rps": 0.0, "tps": 0.0, "samples": 0,
            **{d: {} for d in DISTRIBUTIONS}}


def _count(v: object) -> int:
    n = int(v)  # (a float's fraction dropped, as ever)
    if not 0 <= n <= MAX_COUNT:
        raise ValueError(f"a count of {n}")
    return n


def _finite(v: object, least: float = 0.0) -> float:
    x = float(v)
    if not least <= x < math.inf:
        raise ValueError(f"{x!r} where a figure of at least {least:g} belongs")
    return x


def _read_class(c: dict, span: float) -> dict:
    """One class entry of a summary, checked, as an accumulator: rates add up per process (over its own span)."""
    n = [_count(v) for v in c["n"]]
    if len(n) != len(ATTEMPT_RESULTS):
        raise ValueError(f"{len(n)} result counts")
    tokens = _count(c["tokens"])
    return {"n": n, "tokens": tokens, "rps": sum(n) / span, "tps": tokens / span, "samples": _count(c["samples"]),
            **{d: sketch.decode(c.get(d)) for d in DISTRIBUTIONS}}


def _add_acc(into: dict, c: dict) -> None:
    for i, v in enumerate(c["n"]):
        into["n"][i] += v
    for k in ("tokens", "rps", "tps", "samples"):
        into[k] += c[k]
    for d in DISTRIBUTIONS:
        sketch.add(into[d], c[d])


def _read_load(load: dict, taken_at: float) -> dict:
    """The engine's own figures as a process saw them, `age_s` before it took its summary (never after it:
    the newest sample of any process is shown, and one from the future would always be)."""
    age = _finite(load["age_s"])
    figures = {k: load.get(k) for k in LOAD_FIELDS}
    for k, v in figures.items():
        if v is not None and not math.isfinite(float(v)):  # a number or nothing: it goes into the feed as it is
            raise ValueError(f"a load figure {k} of {v!r}")
    return {**figures, "taken_at": taken_at - age}


def _read_fit(fit: dict) -> dict:
    out = {f: _count(fit[f]) if f == "samples" else _finite(fit[f]) for f in FIT_FIELDS}
    if not out["prefill_rate"] > 0:
        raise ValueError("a prefill rate of 0")
    return out


def _read_backend(b: dict, taken_at: float) -> dict:
    """One backend of a summary, checked (a malformed one raises before anything is merged)."""
    load = b["load"]
    if load is not None:  # the engine's own figures: the newest sample of any process wins
        load = _read_load(load, taken_at)
    span = max(_finite(b["span_s"]), 1e-3)
    return {"engine": str(b["engine"]), "health": str(b["health"]), "breaker": str(b["breaker"]),
            "in_flight": _count(b["in_flight"]), "seats": _count(b.get("seats") or 0),  # (none before the queue)
            "failovers": _count(b["failovers"]),
            "breaker_openings": _count(b["breaker_openings"]), "load": load,
            "unsupported": {str(k): str(v) for k, v in (b.get("unsupported") or {}).items()},
            "misconfigured": str(b["misconfigured"])[:500] if b.get("misconfigured") else None,
            "fit": _read_fit(b["fit"]),
            "classes": {str(k): _read_class(c, span) for k, c in b["classes"].items()}}


def _merge_backend(m: dict | None, b: dict) -> dict:
    if m is None:
        m = {"engine": b["engine"], "views": {"health": {}, "breaker": {}}, "in_flight": 0, "seats": 0, "load": None,
             "fit": None, "failovers": 0, "breaker_openings": 0, "unsupported": {}, "misconfigured": None,
             "classes": {}}
    for view in ("health", "breaker"):
        counts = m["views"][view]
        counts[b[view]] = counts.get(b[view], 0) + 1
    for k in ("in_flight", "failovers", "breaker_openings"):
        m[k] += b[k]
    m["seats"] = max(m["seats"], b["seats"])  # the engine's: the most any process knows
    m["unsupported"].update(b["unsupported"])  # a model any process found unsupported there, with the reason
    m["misconfigured"] = m["misconfigured"] or b["misconfigured"]
    load = b["load"]
    if load is not None and (m["load"] is None or load["taken_at"] > m["load"]["taken_at"]):
        m["load"] = load
    if m["fit"] is None or b["fit"]["samples"] > m["fit"]["samples"]:
        m["fit"] = b["fit"]  # the latency fit of the process that learned from the most requests
    for klass, c in b["classes"].items():
        _add_acc(m["classes"].setdefault(klass, _acc()), c)
    return m


def read_summary(s: dict) -> tuple[dict[str, dict], dict[str, int], dict[str, dict[str, int]]]:
    """A process's summary, checked as a client's input would be (MALFORMED raised when it is not one a
    process writes): its backends, its refusals per class and their reasons."""
    taken_at = s["taken_at"]
    if isinstance(taken_at, bool) or not isinstance(taken_at, (int, float)) or not math.isfinite(taken_at):
        raise ValueError(f"taken at {taken_at!r}")
    read = {str(bid): _read_backend(b, taken_at) for bid, b in s["backends"].items()}
    refused = {str(k): _count(n) for k, n in s.get("rejected", {}).items()}
    why = {str(k): {str(kind): _count(n) for kind, n in kinds.items()} for k, kinds in s.get("reasons", {}).items()}
    return read, refused, why


def merge(summaries: list[dict]) -> dict:
    """Summaries of several processes as one: counts, rates and sketches add; states are shown per process."""
    backends: dict[str, dict] = {}
    rejected: dict[str, int] = {}
    reasons: dict[str, dict[str, int]] = {}
    used = []
    for s in summaries:
        try:
            read, refused, why = read_summary(s)
        except MALFORMED as e:
            log.warning("ignoring a malformed stats summary from worker %s: %r", s.get("worker"), e)
            continue
        for bid, b in read.items():
            backends[bid] = _merge_backend(backends.get(bid), b)
        for klass, n in refused.items():
            rejected[klass] = rejected.get(klass, 0) + n
        for klass, kinds in why.items():
            into = reasons.setdefault(klass, {})
            for kind, n in kinds.items():
                into[kind] = into.get(kind, 0) + n
        used.append(s)
    return {"backends": backends, "rejected": rejected, "reasons": reasons, "summaries": used}


# -- rendering ----------------------------------------------------------------------------------------
def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


def _pct(sk: sketch.Sketch) -> dict:
    return {"p50": _ms(sketch.quantile(sk, 0.5)), "p90": _ms(sketch.quantile(sk, 0.9)),
            "p99": _ms(sketch.quantile(sk, 0.99))}


def figures(acc: dict) -> dict:
    """What an operator reads for one backend or class: counts per outcome, rates, the engine's error rate
    (client_left and client_error are not the engine's errors) and latency percentiles of served requests."""
    n = sum(acc["n"])
    prompt = sketch.quantile(acc["prompt"], 0.5)
    return {
        "requests": n,
        "rps": acc["rps"],
        "error_rate": acc["n"][RESULT_INDEX[ENGINE_ERROR]] / n if n else 0.0,
        "outcomes": dict(zip(ATTEMPT_RESULTS, acc["n"])),
        "output_tps": acc["tps"],
        "ttft_ms": _pct(acc["ttft"]),
        "itl_ms": _pct(acc["itl"]),
        "e2e_ms": _pct(acc["e2e"]),
        "prompt_tokens_p50": None if prompt is None else round(prompt),
        "samples": acc["samples"],
    }


def _predicted(est: LatencyEstimate, prompt_tokens: float | None, running: int) -> dict:
    n = prompt_tokens or 0
    return {"prompt_tokens": n, "ttft_ms": _ms(est.ttft(n, running=running)), "itl_ms": _ms(est.itl(running + 1))}


def _worst(views: dict[str, int], rank: dict[str, int]) -> str | None:
    return max(views, key=lambda s: rank.get(s, len(rank))) if views else None


def _class_order(names) -> list[str]:
    return sorted(names, key=lambda k: (CLASSES.index(k) if k in CLASSES else len(CLASSES), k))


def _backend_row(bid: str, m: dict, now_wall: float) -> dict:
    overall = _acc()
    for acc in m["classes"].values():
        _add_acc(overall, acc)
    est = LatencyEstimate(**m["fit"])
    classes = {k: figures(m["classes"][k]) for k in _class_order(m["classes"])}
    rep = {"overall": figures(overall), "classes": classes}
    # What the latency model predicts right now for each class's typical prompt (queue wait aside).
    for s in (rep["overall"], *classes.values()):
        s["predicted"] = _predicted(est, s["prompt_tokens_p50"], m["in_flight"])
    load = m["load"] or {}
    return {
        "id": bid, "engine": m["engine"], "health": _worst(m["views"]["health"], HEALTH_RANK),
        "breaker": _worst(m["views"]["breaker"], BREAKER_RANK), "in_flight": m["in_flight"],
        "seats": m["seats"] or None,  # the requests its engine runs at once, as far as the queue knows (null: not yet)
        "load": {"running": load.get("running"), "waiting": load.get("waiting"), "kv_usage": load.get("kv_usage"),
                 "idle_slots": load.get("idle_slots"), "fresh": bool(load),
                 "age_s": round(now_wall - load["taken_at"], 3) if load else None},
        **rep,
        "failovers": m["failovers"], "breaker_openings": m["breaker_openings"],
        "unsupported": m["unsupported"],  # [probe] at_start: models not routed here, and why
        "misconfigured": m["misconfigured"],  # why the backend takes no requests though its engine is up
        "views": m["views"],  # how many processes see the backend in each state
        "model": {"ttft_t0_ms": round(est.ttft_t0 * 1000, 3), "prefill_tps": round(est.prefill_rate, 1),
                  "itl_a_ms": round(est.itl_a * 1000, 3), "itl_b_ms": round(est.itl_b * 1000, 4),
                  "ttft_per_running_ms": round(est.ttft_per_running * 1000, 4),
                  "service_ms": round(est.service_s * 1000, 3), "samples": est.samples},
    }


def render(summaries: list[dict], now_wall: float) -> dict:
    """The feed's figures for the processes whose summaries are given (the first one's settings apply)."""
    group = merge(summaries)
    rows = [_backend_row(bid, m, now_wall) for bid, m in group["backends"].items()]
    mix: dict[str, dict] = {}
    for r in rows:
        for klass, s in r["classes"].items():
            m = mix.setdefault(klass, _class_mix())
            m["requests"] += s["requests"]
            m["backends"][r["id"]] = s["requests"]
            for k, v in s["outcomes"].items():
                m["outcomes"][k] += v
    for klass in (*group["rejected"], *group["reasons"]):
        if klass:  # "": refused before its class was known; it counts in the totals only
            mix.setdefault(klass, _class_mix())
    total = sum(r["overall"]["requests"] for r in rows)
    engine_errors = sum(r["overall"]["outcomes"][ENGINE_ERROR] for r in rows)
    for klass, m in mix.items():
        m["share"] = m["requests"] / total if total else 0.0
        m["error_rate"] = m["outcomes"][ENGINE_ERROR] / m["requests"] if m["requests"] else 0.0
        m["rejected"] = group["rejected"].get(klass, 0)
        m["reasons"] = dict(sorted(group["reasons"].get(klass, {}).items(), key=lambda kv: -kv[1]))
    first = group["summaries"][0] if group["summaries"] else {}
    return {
        "now": now_wall, "window_s": first.get("window_s"), "enabled": first.get("enabled"), "backends": rows,
        "classes": {k: mix[k] for k in _class_order(mix)},
        "totals": {"requests": total, "rps": sum(r["overall"]["rps"] for r in rows),
                   "error_rate": engine_errors / total if total else 0.0,
                   "outcomes": {k: sum(r["overall"]["outcomes"][k] for r in rows) for k in ATTEMPT_RESULTS},
                   "rejected": sum(group["rejected"].values()),
                   "failovers": sum(r["failovers"] for r in rows),
                   "breaker_openings": sum(r["breaker_openings"] for r in rows),
                   "in_flight": sum(r["in_flight"] for r in rows)},
        "workers": _workers(group["summaries"], now_wall),
        "queue": merge_queues(s.get("queue") for s in group["summaries"]),
    }


def merge_queues(reports) -> dict:
    """Every process's queue in one: lengths and how waits ended added up (each process keeps its own queue)."""
    out: dict = {"length": 0, "priorities": {}}
    for q in reports:
        if not isinstance(q, dict):
            continue  # (a process from before the queue, or a malformed summary)
        try:
            out["length"] += _count(q["length"])
            for p, row in q["priorities"].items():
                m = out["priorities"].setdefault(str(p), {"length": 0, "ended": {}})
                m["length"] += _count(row["length"])
                for outcome, e in row["ended"].items():
                    n = _count(e["count"])
                    t = m["ended"].setdefault(str(outcome), {"count": 0, "mean_wait_s": 0.0, "max_wait_s": 0.0})
                    total = t["count"] + n
                    if total:
                        waited = t["mean_wait_s"] * t["count"] + float(e["mean_wait_s"]) * n
                        t["mean_wait_s"] = round(waited / total, 4)
                    t["count"] = total
                    t["max_wait_s"] = max(t["max_wait_s"], float(e["max_wait_s"]))
        except MALFORMED as e:
            log.warning("a queue summary was malformed and skipped: %s", type(e).__name__)
    return out


def _class_mix() -> dict:
    return {"requests": 0, "share": 0.0, "backends": {}, "outcomes": dict.fromkeys(ATTEMPT_RESULTS, 0)}


def _workers(summaries: list[dict], now_wall: float) -> dict:
    return {"count": len(summaries),
            "summaries": [{"worker": s.get("worker"), "taken_at": s["taken_at"],
                           "age_s": round(max(now_wall - s["taken_at"], 0.0), 3)} for s in summaries]}


# -- the feeds ----------------------------------------------------------------------------------------
def group_report(g) -> dict:
    """/stats and the dashboard: this process group (every worker of `serve --workers N`) merged.

    This worker's summary is taken now; the others' are the ones they published last (at most ~1 s old).
    """
    now_wall = time.time()
    own = take_summary(g, now_wall=now_wall)
    summaries = [own, *g.sharing.peers(now_wall)]
    rep = render(summaries, now_wall)
    rep["scope"] = "group"
    rep["workers"]["expected"] = g.sharing.expected
    rep["workers"]["answering"] = own["worker"]
    if g.sharing.redis is not None:
        rep["replicas"] = [_replica_line(rid, r, rid == g.sharing.replica)
                           for rid, r in _replicas(g, summaries, now_wall)]
    return rep


def replicas_report(g) -> dict:
    """/stats?scope=replicas: every replica sharing the Redis store, each labelled, and all of them merged."""
    now_wall = time.time()
    own = take_summary(g, now_wall=now_wall)
    group = [own, *g.sharing.peers(now_wall)]
    replicas = _replicas(g, group, now_wall)
    everything = [s for rid, _ in replicas for s in _group_of(g, rid, group)]
    return {"now": now_wall, "scope": "replicas", "shared": g.sharing.redis is not None,
            "replicas": [{"replica": rid, "self": rid == g.sharing.replica, **r} for rid, r in replicas],
            "fleet": render(everything, now_wall)}


def _group_of(g, replica: str, local: list[dict]) -> list[dict]:
    if replica == g.sharing.replica:
        return local  # this replica's own workers, fresher locally than through Redis
    return [s for s in g.sharing.remote if s.get("replica") == replica]


def _replicas(g, local: list[dict], now_wall: float) -> list[tuple[str, dict]]:
    ids = [g.sharing.replica]
    for s in g.sharing.remote:
        rid = s.get("replica")
        if isinstance(rid, str) and rid not in ids:
            ids.append(rid)
    return [(rid, render(_group_of(g, rid, local), now_wall)) for rid in ids]


def _replica_line(rid: str, r: dict, own: bool) -> dict:
    t = r["totals"]
    return {"replica": rid, "self": own, "workers": r["workers"]["count"],
            "taken_at": min((w["taken_at"] for w in r["workers"]["summaries"]), default=None),
            **{k: t[k] for k in ("requests", "rps", "error_rate", "rejected", "in_flight")}}
