"""Routing benchmark: round_robin, least_loaded, prefix_affinity and shape on the simulated R9700 portfolio.

One stack per (policy, load): a process with four simulated engines (vLLM, SGLang, llama.cpp Vulkan
marked interactive, llama.cpp HIP; calibrated R9700 profiles, real time) and a gateway process in
front of them. Stacks run one after another, each alone on the machine (the simulated engines keep
their modelled timing only with cores to spare), in an order rotated per repeat; a run whose engines
delivered more than 5 % of their steps late is rejected and run again (at most twice). Every policy
gets the same arrivals per repeat (same seed): generation, summarization, agents sharing long system
prompts, multi-turn interactive sessions and long chats, as Poisson arrivals over a fixed window.
The load generator (this process) measures TTFT, ITL and e2e per request like GenAI-Perf. The same
arrivals are then placed on the virtual clock by a clairvoyant reference (benchmarks/routing_bound.py).

Usage: python3 -m benchmarks.routing [--quick] [--repeats 3] [--window 36] [--drain 52]
Writes benchmarks/results/routing.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import uvloop

from benchmarks import kit, routing_bound
from benchmarks import routing_conditions as C
from benchmarks import routing_markdown, routing_report
from benchmarks import routing_workload as W
from benchmarks.stack import record_request, serve_gateway, serve_sims, stack_config, stop_children, wait_ready

POLICIES = ("round_robin", "least_loaded", "prefix_affinity", "shape")
# id, engine, sim profile, marked for interactive sessions
PORTFOLIO = (("vllm", "vllm", "r9700-vllm", False), ("sglang", "sglang", "r9700-sglang", False),
             ("llama-vk", "llamacpp", "r9700-llamacpp-vulkan", True),
             ("llama-hip", "llamacpp", "r9700-llamacpp-hip", False))
# Low load keeps every engine well under capacity; high load puts the portfolio near the decode
# capacity that stays within the 50 ms ITL objective. Rates are high enough for ~20 requests per
# class over three repeats except long chats, whose n the report gives instead of percentiles.
LOADS = {"low": W.Load("low", generation=0.2, summarization=0.3, agent=0.25, sessions=0.1, long_chat=0.06),
         "high": W.Load("high", generation=0.4, summarization=0.6, agent=0.6, sessions=0.3, long_chat=0.1)}
WARMUP = W.Kind("warmup", 200, 16, 99.0, 99.0)
WARMUP_REQUESTS = 16
WARMUP_SPACING_S = 0.15
# The longest e2e a request can take and still meet its SLO (generation: 2 s + 999 x 50 ms): cutting
# requests this long after the window never turns a met SLO into a miss.
DRAIN_S = float(math.ceil(max(k.ttft_slo + (k.output_tokens - 1) * k.itl_slo for k in W.KINDS)))
MAX_ATTEMPTS = 3  # a run rejected for late engine steps is run again at most twice


# -- the processes of one stack ------------------------------------------------------------------------
def context_windows() -> dict[str, int]:
    """Tokens one request may hold on each engine of the portfolio (llama.cpp: one slot's share of -c)."""
    from gateway.sim.options import SimOptions

    out = {}
    for bid, engine, profile, _ in PORTFOLIO:
        p = SimOptions(engine=engine, profile=profile).resolve_profile()
        out[bid] = p.slot_ctx() if engine == "llamacpp" else p.max_model_len
    return out


def gateway_config(policy: str, sim_ports: list[int]) -> dict:
    backends = [{"id": bid, "engine": engine, "url": f"http://127.0.0.1:{port}", "models": [W.MODEL],
                 "interactive": interactive}
                for (bid, engine, _, interactive), port in zip(PORTFOLIO, sim_ports)]
    return stack_config(backends, auth={"enabled": False}, routing={"policy": policy},
                        upstream={"first_byte_timeout_s": 300.0, "idle_timeout_s": 120.0})


@dataclass
class Stack:
    policy: str
    load: str
    procs: list
    url: str
    sim_urls: list[str]

    @classmethod
    def start(cls, ctx, policy: str, load: str) -> "Stack":
        sim_ports = [kit.free_port() for _ in PORTFOLIO]
        gw_port = kit.free_port()
        engines = [(engine, profile) for _, engine, profile, _ in PORTFOLIO]
        sims = ctx.Process(target=serve_sims, args=(sim_ports, engines), daemon=True)
        gw = ctx.Process(target=serve_gateway, args=(gateway_config(policy, sim_ports), gw_port), daemon=True)
        sims.start()
        gw.start()
        return cls(policy, load, [gw, sims], f"http://127.0.0.1:{gw_port}",
                   [f"http://127.0.0.1:{p}" for p in sim_ports])

    async def wait_ready(self, http: aiohttp.ClientSession) -> None:
        await wait_ready(http, self.url, f"stack {self.policy}/{self.load}")

    async def sim_health(self, http: aiohttp.ClientSession) -> dict:
        out = {}
        for (bid, *_), url in zip(PORTFOLIO, self.sim_urls):
            try:
                async with http.get(url + "/sim/state") as r:
                    s = await r.json()
                out[bid] = {"steps": s["steps"], "late_steps": s["late_steps"],
                            "late_share": s["late_steps"] / max(s["steps"], 1), "rebases": s["rebases"]}
            except (aiohttp.ClientError, ValueError, KeyError):
                out[bid] = None
        return out

    def stop(self) -> None:
        stop_children(self.procs)


# -- the load generator -------------------------------------------------------------------------------
async def drive(http: aiohttp.ClientSession, url: str, load: W.Load, window_s: float, drain_s: float,
                seed: int) -> dict:
    """Warm-up requests, then the arrivals of one run; requests still running at the drain cap are cut.

    Each record's id is the arrival's index in the schedule (and ".turn" for a session's turns), the
    same ids the virtual-clock references use.
    """
    records: list[dict] = []
    tasks: set[asyncio.Task] = set()
    warm = random.Random(seed)
    t0 = time.perf_counter() + WARMUP_REQUESTS * WARMUP_SPACING_S

    async def one(kind: W.Kind, rid: str, body: dict, headers: dict) -> str:
        rec = {"id": rid, "kind": kind.name, "at": time.perf_counter() - t0, "ok": False, "censored": False,
               "ttft": None, "itl": None, "e2e": None, "tokens": 0, "backend": "", "reason": ""}
        records.append(rec)
        return await record_request(http, url, body, headers, rec)

    async def session(a: W.Arrival, rid: str) -> None:
        history: list[dict] = []
        for turn in range(W.SESSION_TURNS):
            reply = await one(W.INTERACTIVE, f"{rid}.{turn}", W.turn_body(a, history, turn),
                              {"x-session-id": a.session})
            history += [{"role": "user", "content": a.turn_texts[turn]}, {"role": "assistant", "content": reply}]
            await asyncio.sleep(W.THINK_S)

    warm_tasks = []
    for i in range(WARMUP_REQUESTS):
        body = W.body(WARMUP, [{"role": "user", "content": W.words(warm, WARMUP.prompt_tokens - 10)}])
        warm_tasks.append(asyncio.create_task(one(WARMUP, f"w{i}", body, {})))
        await asyncio.sleep(WARMUP_SPACING_S)
    for i, a in enumerate(W.schedule(load, window_s, seed)):
        delay = t0 + a.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        coro = session(a, str(i)) if a.body is None else one(a.kind, str(i), a.body, {})
        tasks.add(asyncio.create_task(coro))
    rest = t0 + window_s - time.perf_counter()
    if rest > 0:
        await asyncio.sleep(rest)
    _, pending = await asyncio.wait(tasks | set(warm_tasks), timeout=drain_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return {"records": [r for r in records if r["kind"] != WARMUP.name], "wall_s": time.perf_counter() - t0}


async def one_run(ctx, policy: str, load: str, window_s: float, drain_s: float, seed: int) -> dict:
    """One stack, alone on the machine: start it, drive it, read its engines' loop health, stop it."""
    stack = Stack.start(ctx, policy, load)
    try:
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=drain_s + window_s)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
            await stack.wait_ready(http)
            cpu = kit.CpuMeter([p.pid for p in stack.procs])
            run = await drive(http, stack.url, LOADS[load], window_s, drain_s, seed)
            health = await stack.sim_health(http)
            cores = cpu.read()
    finally:
        stack.stop()
    return {"policy": policy, "load": load, "seed": seed, "sim_health": health, "cores": cores, **run}


def checked_run(ctx, policy: str, load: str, args, repeat: int) -> dict:
    """A run whose engines kept their modelled timing, after at most MAX_ATTEMPTS tries (else marked rejected)."""
    tries = []
    for attempt in range(MAX_ATTEMPTS):
        # Before a re-run, wait longer for whatever slowed the engines to go away.
        quiet = kit.wait_quiet(args.quiet_wait * (1 if attempt == 0 else 3))
        started = time.monotonic()
        run = uvloop.run(one_run(ctx, policy, load, args.window, args.drain, seed=100 + repeat))
        worst, rejected = C.late_verdict(run["sim_health"])
        tries.append({"quiet": quiet, "late_worst": worst, "rejected": rejected, "cores": run["cores"],
                      "run_s": round(time.monotonic() - started, 1),
                      "late": {b: h and round(h["late_share"], 4) for b, h in run["sim_health"].items()}})
        print(f"{load}/{policy} repeat {repeat + 1} attempt {attempt + 1} ({tries[-1]['run_s']:.0f} s, "
              f"waited {quiet['waited_s']:.0f} s): worst late share {worst if worst is None else f'{worst:.1%}'}; "
              f"cores used by the run {run['cores']['ours']}, by others {run['cores']['others']}"
              f"{' REJECTED' if rejected else ''}", file=sys.stderr)
        if not rejected:
            break
    return {**run, "repeat": repeat, "rejected": rejected, "attempts": tries}


def render(data: dict) -> str:
    loads = list(data["meta"]["loads"])
    return routing_markdown.markdown(data["meta"], routing_report.summarize(data["runs"], loads, POLICIES),
                                     data["references"], data["runs"], loads, POLICIES)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=float, default=36.0, help="seconds of arrivals per run")
    ap.add_argument("--drain", type=float, default=DRAIN_S, help="seconds after the window before cutting requests")
    ap.add_argument("--loads", nargs="+", default=["low", "high"], choices=sorted(LOADS))
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="longest wait for a quiet machine before a run (three times that before a re-run)")
    ap.add_argument("--quick", action="store_true", help="one repeat, 15 s window, 30 s drain")
    ap.add_argument("--output", default=str(kit.RESULTS / "routing"), help="path prefix of the .md and .json")
    ap.add_argument("--from-json", help="re-render the .md of an earlier run's .json (no run)")
    args = ap.parse_args(argv)
    if args.from_json:
        print(kit.render_again(Path(args.from_json), render))
        return 0
    if args.quick:
        args.repeats, args.window, args.drain = 1, 15.0, 30.0
    ctx = multiprocessing.get_context("spawn")
    meta = {**kit.provenance(), "command": kit.command("benchmarks.routing", argv),
            "windows": context_windows(), "repeats": args.repeats, "window_s": args.window, "drain_s": args.drain,
            "loads": {k: vars(LOADS[k]) for k in args.loads}, "portfolio": PORTFOLIO,
            "kinds": {k.name: vars(k) for k in W.KINDS}, "late_limit": C.LATE_LIMIT, "min_steps": C.MIN_STEPS,
            "quiet_wait_s": args.quiet_wait,
            "warmup": {"requests": WARMUP_REQUESTS, "prompt_tokens": WARMUP.prompt_tokens,
                       "output_tokens": WARMUP.output_tokens}}
    t_start = time.time()
    runs = []
    for r in range(args.repeats):
        order = POLICIES[r % len(POLICIES):] + POLICIES[:r % len(POLICIES)]
        for load in args.loads:
            for policy in order:
                runs.append(checked_run(ctx, policy, load, args, r))
        print(f"repeat {r + 1}/{args.repeats} done after {time.time() - t_start:.0f} s", file=sys.stderr)
    meta["load_after"] = os.getloadavg()
    meta["live_s"] = round(time.time() - t_start, 1)
    references = routing_bound.references(runs, {k: LOADS[k] for k in args.loads}, args.window, PORTFOLIO,
                                          meta["windows"])
    meta["elapsed_s"] = round(time.time() - t_start, 1)
    data = {"meta": meta, "references": references, "runs": runs}
    md = render(data)
    kit.write_result(Path(args.output), data, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
