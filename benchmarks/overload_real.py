"""Overload benchmark on the real engines of tests/e2e (llama-server with 2 slots, vLLM CPU): the gateway's queue off
(shape routing alone, as before the queue) and on (the defaults), at ~3x the load the pair serves easily, and the
queue on while a second key floods bulk work."""

# The engines start once and stay warm; their single-request speed is measured first (benchmarks/routing_real.py's
# calibration: the reference runs), and the arrival rates are derived from it at --load (routing_real runs at 0.6;
# 1.8 is three times that). Every run gets a fresh gateway in front of the same engines, the same seeded arrivals
# of the first key's mix (interactive sessions on llama.cpp, bulk long generations, long prompts, agent requests
# with shared system prompts) and new prompt texts. The two variants run twice each in alternating order; the flood
# run adds a second key sending bulk generations. While a run lasts, each engine's running and waiting gauges and
# the gateway's queue are sampled (the load summaries). Between runs both engines must be idle.
#
# Usage: python3 -m benchmarks.overload_real [--window 40] [--drain 150] [--load 1.8] [--flood-factor 2]
#        python3 -m benchmarks.overload_real --from-json benchmarks/results/overload_real.json   (re-render the .md)
# Writes benchmarks/results/overload_real.{md,json}.

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import aiohttp
import orjson

from benchmarks import kit
from benchmarks import overload_real_report as report
from benchmarks import routing_real as rr
from benchmarks.stack import record_request, serve_gateway, stop_children, stream_request, wait_ready
from gateway.keys.principal import hash_key
from tests.e2e import wire
from tests.e2e.engines import EngineHandle, start_llama_server, start_vllm_server
from tests.e2e.quirks import QUIRKS

KEYS = {"first": "sk-overload-first", "flood": "sk-overload-flood", "ops": "sk-overload-ops"}
QUEUE_OFF, QUEUE_ON, FLOOD = "queue off", "queue on", "queue on + flood"
VARIANTS = (QUEUE_OFF, QUEUE_ON)
SAMPLE_S = 0.5


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[key]}"}


def gateway_config(variant: str, engines: list[EngineHandle], queue: dict | None = None) -> dict:
    """routing_real's shape placement, with keys; the queue off, or on with `queue`'s settings and the others at
    their defaults."""
    cfg = rr.gateway_config("shape", engines)
    cfg["auth"] = {"keys": [{"id": k, "sha256": hash_key(v), "admin": k == "ops"} for k, v in KEYS.items()]}
    cfg["queue"] = {**(queue or {}), "enabled": variant != QUEUE_OFF}
    return cfg


async def sample_load(http: aiohttp.ClientSession, url: str, engines: list[EngineHandle], out: list[dict],
                      stop: asyncio.Event) -> None:
    """Every SAMPLE_S: each engine's running and waiting gauges, and the gateway's queue length."""
    while not stop.is_set():
        row: dict = {"t": time.perf_counter()}
        for h in engines:
            q = QUIRKS[h.engine]
            try:
                fams = await asyncio.wait_for(wire.metric_families(http, h.url), 5.0)
                row[h.engine] = (wire.sample_value(fams, q.running_gauge), wire.sample_value(fams, q.waiting_gauge))
            except (aiohttp.ClientError, AssertionError, TimeoutError, KeyError, ValueError):
                row[h.engine] = None
        try:
            async with http.get(url + "/stats", headers=auth("ops"), timeout=aiohttp.ClientTimeout(total=5)) as r:
                row["queue"] = (await r.json()).get("queue", {}).get("length")
        except (aiohttp.ClientError, TimeoutError, ValueError):
            row["queue"] = None
        out.append(row)
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_S)
        except TimeoutError:
            pass


async def drive(http: aiohttp.ClientSession, url: str, rates: dict[str, float], flood_rate: float,
                args: argparse.Namespace, seed: int, text_seed: str) -> dict:
    """The first key's mix (and, with flood_rate, the second key's bulk generations) for the window, then the
    drain; records per request."""
    records: list[dict] = []
    by_name = {k.name: k for k in rr.KINDS}
    text = random.Random(text_seed)  # this run's own texts: no cache hits from another run
    systems = [rr.words(text, rr.AGENT.words) for _ in range(rr.AGENT_SYSTEMS)]

    async def one(kind: str, key: str, body: dict, headers: dict, at: float, measured: bool = True) -> str:
        rec = {"kind": kind, "key": key, "at": at, "ok": False, "censored": False, "ttft": None, "itl": None,
               "e2e": None, "tokens": 0, "backend": "", "reason": "", "status": None}
        if measured:
            records.append(rec)
        return await record_request(http, url, body, {**headers, **auth(key)}, rec)

    async def session_user(u: int, t0: float, start: float) -> None:
        await asyncio.sleep(start)
        rng = random.Random(f"{text_seed}-user{u}")
        pace = random.Random(f"{seed}-user{u}")
        n = 0
        while time.perf_counter() - t0 < args.window:
            n += 1
            sid, system, history = f"{text_seed}-u{u}-s{n}", rr.words(rng, rr.SESSION.words), []
            for _ in range(rr.SESSION_TURNS):
                if time.perf_counter() - t0 >= args.window:
                    return
                body, asked = rr.session_body(system, history, rng)
                reply = await one(rr.SESSION.name, "first", body, {"x-session-id": sid}, time.perf_counter() - t0)
                history += [{"role": "user", "content": asked}, {"role": "assistant", "content": reply}]
                await asyncio.sleep(rr.THINK_S * pace.uniform(0.5, 1.5))

    warm = random.Random(f"{text_seed}-warm")
    warm_tasks = []
    for _ in range(rr.WARMUP_REQUESTS):  # through this run's gateway, not measured; the same for every run
        body = rr.chat([{"role": "user", "content": rr.words(warm, 30)}], 32)
        warm_tasks.append(asyncio.create_task(one("warmup", "first", body, {}, -1.0, measured=False)))
        await asyncio.sleep(rr.WARMUP_SPACING_S)
    await asyncio.gather(*warm_tasks)
    plan = [(at, kind, "first") for at, kind in rr.arrivals(rates, args.window, seed)]
    if flood_rate > 0:  # Poisson too, from a seed of its own: the first key's arrivals stay the same
        rng, t = random.Random(seed + 7), 0.0
        while (t := t + rng.expovariate(flood_rate)) < args.window:
            plan.append((t, rr.GENERATION.name, "flood"))
        plan.sort()
    starts = random.Random(seed + 1)
    t0 = time.perf_counter()
    tasks = {asyncio.create_task(session_user(u, t0, starts.uniform(0, 2 * rr.THINK_S)))
             for u in range(rr.SESSION_USERS)}
    for at, kind, key in plan:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.add(asyncio.create_task(one(kind, key, rr.request_body(by_name[kind], text, systems), {}, at)))
    rest = t0 + args.window - time.perf_counter()
    if rest > 0:
        await asyncio.sleep(rest)
    _, pending = await asyncio.wait(tasks, timeout=args.drain)
    for t in pending:  # cut at the drain cap: counted as failed
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return {"records": records, "wall_s": time.perf_counter() - t0}


async def run_variant(ctx, http: aiohttp.ClientSession, direct: aiohttp.ClientSession, engines: list[EngineHandle],
                      variant: str, repeat: int, rates: dict[str, float], args: argparse.Namespace,
                      cfg: dict | None = None) -> dict:
    """One run with a fresh gateway (`cfg`, else the variant's configuration) once both engines are idle."""
    idle_s = await rr.wait_idle(direct, engines, timeout=600.0)
    await asyncio.sleep(args.pause)
    port = kit.free_port()
    cfg = cfg or gateway_config(variant, engines, args.queue)
    gw = ctx.Process(target=serve_gateway, args=(cfg, port), daemon=True)
    gw.start()
    samples: list[dict] = []
    stop = asyncio.Event()
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(http, url, f"gateway ({variant})")
        load = os.getloadavg()[0]
        sampler = asyncio.create_task(sample_load(direct, url, engines, samples, stop))
        flood = rates[rr.GENERATION.name] * args.flood_factor if variant == FLOOD else 0.0
        # The first key's arrivals are the same in every run of a repeat (its seed); its texts are new each run.
        run = await drive(http, url, rates, flood, args, seed=200 + repeat, text_seed=f"o{repeat}-{variant}")
        stop.set()
        await sampler
    finally:
        await asyncio.to_thread(stop_children, [gw])
    return {"variant": variant, "repeat": repeat, "window_s": args.window, "idle_wait_s": idle_s,
            "load1_at_start": load,
            "samples": samples, **run}


def schedule(args: argparse.Namespace) -> list[tuple[str, int]]:
    """Each variant args.repeats times, the order alternating between repeats; then the flood runs."""
    out = []
    for r in range(args.repeats):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        out += [(v, r) for v in order]
    return out + [(FLOOD, r) for r in range(args.flood_repeats)]


class SimHandle:
    """A simulated engine (gateway/sim) in the place of a real one: --sim checks the benchmark itself, cheaply."""

    def __init__(self, engine: str, server) -> None:
        self.engine, self.url, self.model, self._server = engine, server.url, "sim-model", server
        self.argv, self.startup_s = ["gateway.sim", engine], 0.0

    async def close(self) -> None:
        await self._server.close()


async def start_engines(args: argparse.Namespace) -> list:
    if args.sim:
        from gateway.sim.runner import SimOptions, start_sim
        return [SimHandle("llamacpp", await start_sim(SimOptions(engine="llamacpp", slots=rr.LLAMA["parallel"]))),
                SimHandle("vllm", await start_sim(SimOptions(engine="vllm", slots=rr.VLLM["max_num_seqs"])))]
    engines = [await start_llama_server(**rr.LLAMA)]
    try:
        engines.append(await start_vllm_server(**rr.VLLM))
    except BaseException:
        await engines[0].close()
        raise
    return engines


async def prepare(direct: aiohttp.ClientSession, engines: list, args: argparse.Namespace, meta: dict) -> dict:
    """The engines warmed up and measured alone: the calibration (arrival rates at --load), also put in `meta`."""
    meta["engines"] = {h.engine: {"version": "simulated" if args.sim else await rr.engine_version(direct, h),
                                  "argv": h.argv[1:], "startup_s": h.startup_s} for h in engines}
    for h in engines:  # the first requests after a start are slow on both engines
        for i in range(4):
            await stream_request(direct, h.url, rr.chat([{"role": "user", "content": f"Warm up {i}."}], 16,
                                                         h.model), {}, {})
    cal = rr.derive(await rr.calibrate(direct, engines), args.load, args.slo_factor, args.ttft_floor_ms / 1000)
    if not args.sim:  # (the simulator has no tokenizer route)
        cal["prompt_tokens"] = await rr.prompt_tokens(direct, engines[0].url)
    meta["calibration"] = cal
    meta["targets"] = report.targets(args)
    print("rates /s:", {k: round(v, 3) for k, v in cal["rates"].items()}, file=sys.stderr)
    return cal


async def bench(args: argparse.Namespace, meta: dict) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    engines = await start_engines(args)
    runs: list[dict] = []
    try:
        async with wire.new_session() as direct:
            cal = await prepare(direct, engines, args, meta)
            timeout = aiohttp.ClientTimeout(total=None, sock_read=args.window + args.drain)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
                for variant, r in schedule(args):
                    runs.append(await run_variant(ctx, http, direct, engines, variant, r, cal["rates"], args))
                    f = report.run_figures(runs[-1], meta["targets"])
                    print(f"{variant} #{r + 1}: first key {f['first']['n']} requests, TTFT target met "
                          f"{f['first']['attained']:.0%}, failed {f['first']['failed']}, "
                          f"{time.time() - meta['started']:.0f} s", file=sys.stderr)
                    save(args, meta, runs, done=False)  # what ran so far, should the rest not
    finally:
        for h in engines:
            await h.close()
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs of each variant (queue off, queue on)")
    ap.add_argument("--flood-repeats", type=int, default=None,
                    help="runs with the second key flooding (default: --repeats, one beside each queue-on run)")
    ap.add_argument("--window", type=float, default=40.0, help="seconds of arrivals per run")
    ap.add_argument("--drain", type=float, default=150.0, help="seconds after the window before cutting requests")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between runs once both engines are idle")
    ap.add_argument("--load", type=float, default=1.8,
                    help="offered busy fraction at the better engine's single-request speed (routing_real: 0.6)")
    ap.add_argument("--flood-factor", type=float, default=2.0,
                    help="the second key's bulk generations, as a multiple of the first key's generation rate")
    ap.add_argument("--slo-factor", type=float, default=3.0, help="routing_real's SLOs (in the calibration only)")
    ap.add_argument("--ttft-floor-ms", type=float, default=50.0)
    for kind in ("interactive", "agent", "long-prompt", "generation"):  # default: the gateway's class targets
        ap.add_argument(f"--{kind}-ttft", type=float, default=None, help=f"the {kind} requests' TTFT target, s")
    ap.add_argument("--queue", type=orjson.loads, default=None,
                    help='[queue] settings of the queue-on runs besides enabled, as JSON (default: none, the defaults)')
    ap.add_argument("--sim", action="store_true", help="simulated engines instead (a check of the script, not a "
                    "result: write it elsewhere with --output)")
    ap.add_argument("--output", default=str(kit.RESULTS / "overload_real"), help="path prefix of the .md and .json")
    ap.add_argument("--from-json", help="re-render the .md of an earlier run's .json (no run)")
    args = ap.parse_args(argv)
    if args.flood_repeats is None:
        args.flood_repeats = args.repeats
    if args.from_json:
        print(kit.render_again(Path(args.from_json), lambda data: report.markdown(
            data["meta"], report.summarize(data["runs"], data["meta"]))))
        return 0
    meta = {"started": time.time(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": kit.commit(),
            "dirty": bool(kit.changed_paths()), "machine": kit.host(), "load_before": os.getloadavg(),
            "command": kit.command("benchmarks.overload_real", argv), "repeats": args.repeats,
            "flood_repeats": args.flood_repeats, "queue_settings": args.queue, "window_s": args.window, "drain_s": args.drain,
            "offered_load": args.load, "flood_factor": args.flood_factor, "kinds": [asdict(k) for k in rr.KINDS],
            "llama": rr.LLAMA, "vllm": rr.VLLM, "schedule": schedule(args),
            "workload": {"session_users": rr.SESSION_USERS, "session_turns": rr.SESSION_TURNS,
                         "think_s": rr.THINK_S, "agent_systems": rr.AGENT_SYSTEMS,
                         "long_prompt_tokens": rr.LONG_PROMPT_TOKENS}}
    runs = asyncio.run(bench(args, meta))
    print(save(args, meta, runs, done=True))
    return 0


def save(args: argparse.Namespace, meta: dict, runs: list[dict], done: bool) -> str:
    """The results so far (`done`: all of them), written; the report's text."""
    meta["load_after"] = os.getloadavg()
    meta["elapsed_s"] = round(time.time() - meta["started"], 1)
    meta["complete"] = done
    summary = report.summarize(runs, meta)
    md = report.markdown(meta, summary)
    kit.write_result(Path(args.output), {"meta": meta, "summary": summary, "runs": runs}, md)
    return md


if __name__ == "__main__":
    sys.exit(main())
