"""Routing benchmark on the real engines of tests/e2e: llama-server (2 slots, interactive) and vLLM CPU, one model."""

# Both engines start once and stay warm. Their single-request speed is measured first, directly (no gateway),
# for each request kind of the workload; the SLOs and the arrival rates are derived from it (derive(); the
# report spells the rules out). Then, per repeat, each placement in turn
# (the four policies, and a hand-pinned placement: sessions on llama.cpp only, the rest on vLLM) gets a
# fresh gateway process in front of the same engines and the same seeded arrivals. The prompt texts are new
# for every run, so no run finds its prompts in a cache an earlier run filled (vLLM's prefix cache outlives a
# gateway). Between runs both engines must report nothing running or waiting.
#
# Usage: python3 -m benchmarks.routing_real [--quick] [--repeats 3] [--window 60] [--drain 30] [--load 0.6]
#                                           [--slo-factor 3] [--ttft-floor-ms 50]
#        python3 -m benchmarks.routing_real --from-json benchmarks/results/routing_real.json   (re-render the .md)
# Writes benchmarks/results/routing_real.{md,json}.

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from benchmarks import kit
from benchmarks import routing_real_report as report
from benchmarks.routing_workload import words
from benchmarks.stack import record_request, serve_gateway, stack_config, stop_children, stream_request, wait_ready
from tests.e2e import wire  # the e2e suite's real engines, built and cached by its fixtures
from tests.e2e.engines import EngineHandle, start_llama_server, start_vllm_server
from tests.e2e.quirks import QUIRKS
from tests.e2e.targets import PUBLIC_MODEL

PLACEMENTS = ("round_robin", "least_loaded", "prefix_affinity", "shape", "pinned")
# One thread: vLLM binds its worker to core 0 and leaves core 1 to everything else. With two threads one llama
# thread always shares vLLM's core, and llama's per-token barrier between its threads then stalls behind vLLM's
# busy worker (seen while setting this up: TTFTs of 10-20 s instead of 0.5-4 s while vLLM streams).
LLAMA = {"parallel": 2, "ctx": 4096, "threads": 1}
# max_num_seqs 8: vLLM is the batch engine of the pair (8 streams of 800 tokens run at ~7x the tokens/s of one).
VLLM = {"max_num_seqs": 8, "max_model_len": 4096}
# W.words makes 4-character words; the tiny vocabulary cuts each into ~3.4 tokens, while the gateway estimates
# 4 characters per token. Its default long_prompt_tokens (768) would then mean ~2,600 real tokens, more than a
# llama.cpp slot (2,048) holds: scaled down so that summaries both engines can hold are classed long_prompt.
LONG_PROMPT_TOKENS = 320
SESSION_USERS, SESSION_TURNS, USER_TURN_WORDS, THINK_S = 2, 6, 15, 1.0
AGENT_SYSTEMS, AGENT_USER_WORDS = 3, 25
WARMUP_REQUESTS, WARMUP_SPACING_S = 8, 0.25
CALIBRATION_REQUESTS = 7


@dataclass(frozen=True)
class Kind:
    name: str
    words: int  # prompt words (the session's system prompt; its history grows by each turn)
    output: int  # max_tokens, always generated (ignore_eos)
    share: float  # share of the non-session busy time (arrival rates)


SESSION = Kind("interactive", 60, 64, 0.0)
GENERATION = Kind("generation", 30, 1000, 0.4)
SUMMARIZATION = Kind("summarization", 420, 32, 0.3)
AGENT = Kind("agent", 250, 128, 0.3)
KINDS = (SESSION, GENERATION, SUMMARIZATION, AGENT)
OUTPUTS = {k.name: k.output for k in KINDS}


def chat(messages: list[dict], out: int, model: str = PUBLIC_MODEL) -> dict:
    return {"model": model, "messages": messages, "max_tokens": out, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}


def request_body(kind: Kind, rng: random.Random, systems: list[str]) -> dict:
    """One request of a non-session kind, its text drawn from `rng`."""
    if kind is GENERATION:
        return chat([{"role": "user", "content": "Write a long story about" + words(rng, kind.words)}], kind.output)
    if kind is SUMMARIZATION:
        return chat([{"role": "system", "content": "Summarize the document."},
                     {"role": "user", "content": words(rng, kind.words)}], kind.output)
    return chat([{"role": "system", "content": systems[rng.randrange(len(systems))]},
                 {"role": "user", "content": words(rng, AGENT_USER_WORDS)}], kind.output)


def session_body(system: str, history: list[dict], rng: random.Random) -> tuple[dict, str]:
    text = words(rng, USER_TURN_WORDS)
    return chat([{"role": "system", "content": system}, *history, {"role": "user", "content": text}],
                SESSION.output), text


# -- engines ----------------------------------------------------------------------------------------------
async def engine_version(http: aiohttp.ClientSession, h: EngineHandle) -> str:
    if h.engine == "llamacpp":
        props = (await wire.get(http, h.url + "/props")).json()
        return f"llama-server {props.get('build_info', '?')}"
    return f"vLLM {(await wire.get(http, h.url + '/version')).json().get('version', '?')} CPU"


async def wait_idle(http: aiohttp.ClientSession, engines: list[EngineHandle], timeout: float = 120.0) -> float:
    """Seconds until both engines answer /metrics at once with nothing running or waiting."""
    started = time.monotonic()
    while True:
        idle = True
        for h in engines:
            t0 = time.monotonic()
            try:
                fams = await wire.metric_families(http, h.url)
            except (aiohttp.ClientError, AssertionError):
                idle = False
                continue
            q = QUIRKS[h.engine]
            idle &= (wire.sample_value(fams, q.running_gauge) == 0 and wire.sample_value(fams, q.waiting_gauge) == 0
                     and time.monotonic() - t0 < 0.1)  # a vLLM busy with a backlog answers late
        if idle:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"engines still busy after {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def calibrate(http: aiohttp.ClientSession, engines: list[EngineHandle]) -> dict:
    """Single-request TTFT, ITL and e2e of every kind on every engine, one request at a time."""
    rng = random.Random(7)
    systems = [words(rng, AGENT.words)]  # one shared system prompt: agents run with a warm prefix
    out: dict = {k.name: {h.engine: [] for h in engines} for k in KINDS}
    for kind in KINDS:
        for _ in range(CALIBRATION_REQUESTS):
            for h in engines:  # alternating: a slow spell of the shared machine hits both engines alike
                if kind is SESSION:  # a mid-session turn: two earlier turns and their replies
                    history = [m for _ in range(2) for m in ({"role": "user", "content": words(rng, USER_TURN_WORDS)},
                                                             {"role": "assistant", "content": words(rng, 20)})]
                    body = session_body(words(rng, kind.words), history, rng)[0]
                else:
                    body = request_body(kind, rng, systems)
                rec: dict = {}
                await stream_request(http, h.url, {**body, "model": h.model}, {}, rec)
                out[kind.name][h.engine].append({k: rec.get(k) for k in ("ttft", "itl", "e2e", "tokens")})
    return out


async def prompt_tokens(http: aiohttp.ClientSession, llama_url: str) -> dict[str, int]:
    """Tokens of each kind's message texts (a session's first turn), by llama-server's own tokenizer."""
    rng = random.Random(8)
    bodies = {k.name: request_body(k, rng, [words(rng, AGENT.words)]) for k in KINDS[1:]}
    bodies[SESSION.name] = session_body(words(rng, SESSION.words), [], rng)[0]
    out = {}
    for name, body in bodies.items():
        text = "".join(m["content"] for m in body["messages"])
        out[name] = len((await wire.post(http, llama_url + "/tokenize", {"content": text})).json()["tokens"])
    return out


# -- one run: a fresh gateway in front of the warm engines ------------------------------------------------
def gateway_config(placement: str, engines: list[EngineHandle]) -> dict:
    classes = {"llamacpp": ["interactive"], "vllm": ["long_output", "long_prompt", "default"]}
    backends = []
    for h in engines:
        b = {"id": {"llamacpp": "llama", "vllm": "vllm"}[h.engine], "engine": h.engine, "url": h.url,
             "models": {PUBLIC_MODEL: h.model}, "interactive": h.engine == "llamacpp"}
        if placement == "pinned":
            b["classes"] = classes[h.engine]
        backends.append(b)
    # Long probe timeouts: on two cores a streaming vLLM can leave /health unanswered for seconds.
    return stack_config(backends, auth={"enabled": False}, health={"timeout_s": 30.0, "load_stale_s": 10.0},
                        upstream={"first_byte_timeout_s": 120.0, "idle_timeout_s": 120.0},
                        shape={"long_prompt_tokens": LONG_PROMPT_TOKENS},
                        routing={"policy": "round_robin" if placement == "pinned" else placement})


def arrivals(rates: dict[str, float], window_s: float, seed: int) -> list[tuple[float, str]]:
    """(time, kind) of every non-session request: Poisson per kind, the same for every placement of a repeat."""
    rng = random.Random(seed)
    out = []
    for kind in KINDS[1:]:
        t = rng.expovariate(rates[kind.name])
        while t < window_s:
            out.append((t, kind.name))
            t += rng.expovariate(rates[kind.name])
    return sorted(out)


async def drive(http: aiohttp.ClientSession, url: str, rates: dict[str, float], window_s: float, drain_s: float,
                seed: int, text_seed: str) -> dict:
    records: list[dict] = []
    by_name = {k.name: k for k in KINDS}
    text = random.Random(text_seed)  # this run's own texts: no cache hits from another run
    systems = [words(text, AGENT.words) for _ in range(AGENT_SYSTEMS)]

    async def one(kind: str, body: dict, headers: dict, at: float, measured: bool = True) -> str:
        rec = {"kind": kind, "at": at, "ok": False, "censored": False, "ttft": None, "itl": None, "e2e": None,
               "tokens": 0, "backend": "", "reason": "", "status": None}
        if measured:
            records.append(rec)
        return await record_request(http, url, body, headers, rec)

    async def session_user(u: int, t0: float, start: float) -> None:
        await asyncio.sleep(start)
        rng = random.Random(f"{text_seed}-user{u}")
        # Think times vary (0.5-1.5 x THINK_S, the same draws for every placement): with a fixed one, two users
        # whose turns once ran side by side in llama's two slots stay in lock-step for the rest of the run.
        pace = random.Random(f"{seed}-user{u}")
        n = 0
        while time.perf_counter() - t0 < window_s:
            n += 1
            sid, system, history = f"{text_seed}-u{u}-s{n}", words(rng, SESSION.words), []
            for _ in range(SESSION_TURNS):
                if time.perf_counter() - t0 >= window_s:
                    return
                body, asked = session_body(system, history, rng)
                reply = await one(SESSION.name, body, {"x-session-id": sid}, time.perf_counter() - t0)
                history += [{"role": "user", "content": asked}, {"role": "assistant", "content": reply}]
                await asyncio.sleep(THINK_S * pace.uniform(0.5, 1.5))

    warm = random.Random(f"{text_seed}-warm")
    warm_tasks = []
    for _ in range(WARMUP_REQUESTS):  # not measured; the same for every placement
        body = chat([{"role": "user", "content": words(warm, 30)}], 32)
        warm_tasks.append(asyncio.create_task(one("warmup", body, {}, -1.0, measured=False)))
        await asyncio.sleep(WARMUP_SPACING_S)
    await asyncio.gather(*warm_tasks)
    plan = arrivals(rates, window_s, seed)
    starts = random.Random(seed + 1)
    t0 = time.perf_counter()
    tasks = {asyncio.create_task(session_user(u, t0, starts.uniform(0, 2 * THINK_S))) for u in range(SESSION_USERS)}
    for at, kind in plan:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.add(asyncio.create_task(one(kind, request_body(by_name[kind], text, systems), {}, at)))
    rest = t0 + window_s - time.perf_counter()
    if rest > 0:
        await asyncio.sleep(rest)
    _, pending = await asyncio.wait(tasks, timeout=drain_s)
    for t in pending:  # cut at the drain cap: counted as failed
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return {"records": records, "wall_s": time.perf_counter() - t0}


async def run_placement(ctx, http: aiohttp.ClientSession, direct: aiohttp.ClientSession,
                        engines: list[EngineHandle], placement: str, repeat: int, rates: dict[str, float],
                        args: argparse.Namespace) -> dict:
    idle_s = await wait_idle(direct, engines)
    await asyncio.sleep(args.pause)
    port = kit.free_port()
    gw = ctx.Process(target=serve_gateway, args=(gateway_config(placement, engines), port), daemon=True)
    gw.start()
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(http, url, f"gateway ({placement})")
        load = os.getloadavg()[0]
        run = await drive(http, url, rates, args.window, args.drain, seed=100 + repeat,
                          text_seed=f"r{repeat}-{placement}")
    finally:
        await asyncio.to_thread(stop_children, [gw])
    return {"placement": placement, "repeat": repeat, "idle_wait_s": idle_s, "load1_at_start": load, **run}


def derive(raw: dict, load: float, factor: float, floor_s: float) -> dict:
    """SLOs and arrival rates from the single-request figures (the rules are spelled out in the report)."""
    per: dict = {}
    for kind in KINDS:
        per[kind.name] = {}
        for engine, recs in raw[kind.name].items():
            # A burst (the whole answer in one read: ITL under 0.1 ms) says nothing about the engine's ITL.
            itls = [r["itl"] for r in recs if r["itl"] is not None and r["itl"] >= report.BURST_ITL_S]
            per[kind.name][engine] = {"ttft": statistics.median(r["ttft"] for r in recs),
                                      "itl": statistics.median(itls) if itls else None,
                                      "e2e": statistics.median(r["e2e"] for r in recs)}
    slo, best = {}, {}
    for name, engines in per.items():
        b = best[name] = min(engines, key=lambda e: engines[e]["e2e"])
        # An engine that only ever burst has no ITL of its own: the other engine's stands in.
        itl = engines[b]["itl"] or min(f["itl"] for f in engines.values() if f["itl"] is not None)
        slo[name] = {"ttft": max(factor * engines[b]["ttft"], floor_s), "itl": factor * itl}
    service = {name: per[name][best[name]]["e2e"] for name in per}
    session_busy = SESSION_USERS * service[SESSION.name] / (service[SESSION.name] + THINK_S)
    rest = max(load - session_busy, 0.05)
    rates = {k.name: k.share * rest / service[k.name] for k in KINDS[1:]}
    return {"per_engine": per, "best": best, "slo": slo, "service_s": service, "session_busy": session_busy,
            "rates": rates, "load": load, "factor": factor, "ttft_floor_s": floor_s, "raw": raw}


async def bench(args: argparse.Namespace, meta: dict) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    engines = [await start_llama_server(**LLAMA)]
    runs: list[dict] = []
    try:
        engines.append(await start_vllm_server(**VLLM))
        async with wire.new_session() as direct:  # force_close: llama-server may drop a kept-alive connection
            meta["engines"] = {h.engine: {"version": await engine_version(direct, h), "argv": h.argv[1:],
                                          "startup_s": h.startup_s} for h in engines}
            for h in engines:  # the first requests after a start are slow on both engines
                for i in range(4):
                    body = chat([{"role": "user", "content": f"Warm up {i}."}], 16, h.model)
                    await stream_request(direct, h.url, body, {}, {})
            meta["calibration"] = derive(await calibrate(direct, engines), args.load, args.slo_factor,
                                         args.ttft_floor_ms / 1000)
            meta["calibration"]["prompt_tokens"] = await prompt_tokens(direct, engines[0].url)
            rates = meta["calibration"]["rates"]
            print("rates /s:", {k: round(v, 3) for k, v in rates.items()}, file=sys.stderr)
            timeout = aiohttp.ClientTimeout(total=None, sock_read=args.window + args.drain)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
                for r in range(args.repeats):
                    k = r % len(PLACEMENTS)  # rotated: no placement always runs first or last
                    for p in PLACEMENTS[k:] + PLACEMENTS[:k]:
                        runs.append(await run_placement(ctx, http, direct, engines, p, r, rates, args))
                        o = report.run_figures(runs[-1], meta["calibration"]["slo"], OUTPUTS)["overall"]
                        print(f"repeat {r + 1} {p}: {o['n']} requests, SLO {o['slo']:.0%}, failed {o['failed']}, "
                              f"{time.time() - meta['started']:.0f} s", file=sys.stderr)
    finally:
        for h in engines:
            await h.close()
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--drain", type=float, default=30.0, help="seconds after the window before cutting requests")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between runs once both engines are idle")
    ap.add_argument("--load", type=float, default=0.6,
                    help="offered busy fraction at the better engine's single-request speed (sets the rates)")
    ap.add_argument("--slo-factor", type=float, default=3.0, help="SLO = this x the better engine's single request")
    ap.add_argument("--ttft-floor-ms", type=float, default=50.0,
                    help="no TTFT SLO below this: tighter ones measure the shared machine's scheduling noise")
    ap.add_argument("--quick", action="store_true", help="one repeat, 20 s window, 20 s drain")
    ap.add_argument("--output", default=str(kit.RESULTS / "routing_real"), help="path prefix of the .md and .json")
    ap.add_argument("--from-json", help="re-render the .md of an earlier run's .json (no run)")
    args = ap.parse_args(argv)
    if args.from_json:
        print(kit.render_again(Path(args.from_json),
                               lambda data: report.markdown(data["meta"], report.summarize(data["runs"], data["meta"]))))
        return 0
    if args.quick:
        args.repeats, args.window, args.drain = 1, 20.0, 20.0
    meta = {"started": time.time(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "commit": kit.commit(), "dirty": bool(kit.changed_paths()), "machine": kit.host(),
            "load_before": os.getloadavg(), "command": kit.command("benchmarks.routing_real", argv),
            "repeats": args.repeats, "window_s": args.window, "drain_s": args.drain, "pause_s": args.pause,
            "placements": PLACEMENTS, "kinds": [asdict(k) for k in KINDS], "llama": LLAMA, "vllm": VLLM,
            "workload": {"session_users": SESSION_USERS, "session_turns": SESSION_TURNS,
                         "user_turn_words": USER_TURN_WORDS, "think_s": THINK_S, "agent_systems": AGENT_SYSTEMS,
                         "agent_user_words": AGENT_USER_WORDS, "warmup_requests": WARMUP_REQUESTS,
                         "calibration_requests": CALIBRATION_REQUESTS, "long_prompt_tokens": LONG_PROMPT_TOKENS}}
    runs = asyncio.run(bench(args, meta))
    meta["load_after"] = os.getloadavg()
    meta["elapsed_s"] = round(time.time() - meta["started"], 1)
    summary = report.summarize(runs, meta)
    md = report.markdown(meta, summary)
    kit.write_result(Path(args.output), {"meta": meta, "summary": summary, "runs": runs}, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
