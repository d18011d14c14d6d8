"""Decision cost of each routing policy at 8 backends: rank() per request, 3 repeats, median and spread.

Also times the stages around it that scale with the prompt (classification with prefix hashing, the
affinity lookup and record), so the whole routing overhead per request is on one page.

Usage: python3 -m benchmarks.policy_cost [--backends 8] [--decisions 20000] [--repeats 3]
Writes benchmarks/results/routing_policy_cost.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import policies
from benchmarks import kit
from gateway.config import ShapeConfig
from gateway.contracts import BackendView, LatencyEstimate, LoadSample, RouteInput
from gateway.routing.affinity import AffinityIndex
from gateway.apis.chat import CHAT
from gateway.routing.shape import classify, session_of

TARGET_US = 50.0


def backends(n: int, rng: random.Random) -> list[BackendView]:
    out = []
    for i in range(n):
        slot_engine = i % 3 == 2
        est = LatencyEstimate(ttft_t0=rng.uniform(0.005, 0.3), prefill_rate=rng.uniform(1000, 8000),
                              itl_a=rng.uniform(0.005, 0.06), itl_b=rng.uniform(0.0002, 0.003), samples=50,
                              ttft_per_running=0.001, service_s=rng.uniform(2, 20))
        load = (LoadSample(running=2, waiting=0, idle_slots=2, total_slots=4, at=0.0) if slot_engine
                else LoadSample(running=rng.randrange(20), waiting=rng.choice((0, 0, 3)), kv_usage=0.5, at=0.0))
        out.append(BackendView(id=f"b{i}", engine="llamacpp" if slot_engine else "vllm", in_flight=rng.randrange(30),
                               latency=est, load=load, interactive=slot_engine and i == 2))
    return out


def bodies(rng: random.Random) -> list[tuple[dict, dict]]:
    system = "You are an agent with tools. " * 300  # ~9,000 characters: a long shared prefix
    out = []
    for i in range(64):
        kind = i % 4
        if kind == 0:
            out.append(({"model": "m", "messages": [{"role": "user", "content": "write " * 30}], "max_tokens": 1000,
                         "stream": True}, {}))
        elif kind == 1:
            out.append(({"model": "m", "messages": [{"role": "user", "content": "doc " * 1000}], "max_tokens": 100,
                         "stream": True}, {}))
        elif kind == 2:
            out.append(({"model": "m", "messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": f"task {rng.random()}"}],
                         "max_tokens": 150}, {}))
        else:
            out.append(({"model": "m", "messages": [{"role": "user", "content": "turn " * 150}], "max_tokens": 120,
                         "stream": True}, {"x-session-id": f"s{i}"}))
    return out


def time_per_call(fn, args: list, n: int) -> float:
    """Microseconds per call of fn over n calls cycling through args (GC off while timing)."""
    k = len(args)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for i in range(n):
            fn(args[i % k])
        return (time.perf_counter_ns() - t0) / n / 1000
    finally:
        gc.enable()


def measure(n_backends: int, decisions: int, seed: int) -> dict:
    rng = random.Random(seed)
    cfg = ShapeConfig()
    views = tuple(backends(n_backends, rng))
    reqs = bodies(rng)
    shapes = [classify(api=CHAT, body=b, session=session_of(CHAT, b, h), principal="p", cfg=cfg) for b, h in reqs]
    index = AffinityIndex(max_entries=100_000, ttl_s=600.0, block_chars=cfg.prefix_block_chars)
    for i, s in enumerate(shapes):
        index.record(s, views[i % n_backends].id)
    inputs = []
    for s in shapes:
        aff, cached = index.lookup(s)
        inputs.append(RouteInput(s, views, aff, 0.0, cached))
    out = {}
    for name, (cls, params) in policies.REGISTRY.items():
        policy = cls(params())
        out[f"rank:{name}"] = time_per_call(policy.rank, inputs, decisions)
    out["classify (parse excluded, prefix hashes on)"] = time_per_call(
        lambda bh: classify(api=CHAT, body=bh[0], session=session_of(CHAT, *bh), principal="p", cfg=cfg), reqs,
        decisions // 4)
    out["affinity lookup"] = time_per_call(index.lookup, shapes, decisions)
    out["affinity record"] = time_per_call(lambda s: index.record(s, "b1"), shapes, decisions // 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", type=int, default=8)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default=str(kit.RESULTS / "routing_policy_cost"))
    args = ap.parse_args(argv)
    runs = [measure(args.backends, args.decisions, seed=r) for r in range(args.repeats)]
    rows = {}
    for key in runs[0]:
        v = [r[key] for r in runs]
        med, spread = kit.median_spread(v)
        rows[key] = {"median_us": med, "spread": spread, "values_us": v}
    machine = kit.host()
    lines = ["# Routing decision cost", "",
             f"{args.backends} backends, {args.decisions} decisions per repeat over a mix of the four request "
             f"classes (long shared prefixes included), {args.repeats} repeats; {machine}. "
             f"Target for rank(): under {TARGET_US:g} us per request.", "",
             "| stage | median us per request | spread (max - min) / median |", "|---|---|---|"]
    for key, r in rows.items():
        lines.append(f"| {key} | {r['median_us']:.1f} | {r['spread']:.0%} |")
    worst = max(r["median_us"] for k, r in rows.items() if k.startswith("rank:"))
    lines += ["", f"Slowest policy decision: {worst:.1f} us ({'within' if worst < TARGET_US else 'OVER'} the "
              f"{TARGET_US:g} us target).", "", "Generated by `python -m benchmarks.policy_cost`."]
    kit.write_result(Path(args.output), {"machine": machine, "args": vars(args), "rows": rows}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if worst < TARGET_US else 1


if __name__ == "__main__":
    sys.exit(main())
