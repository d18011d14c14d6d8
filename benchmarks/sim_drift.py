"""How far one simulator process's delivered ITL drifts from its modelled ITL as concurrency grows.

Starts `python -m gateway.sim` (datacenter profile by default) as a subprocess, drives it with N
concurrent streams of the "generation" shape from an aiohttp client, and compares what the
client measures with what the latency model says for the same workload:

  modelled   the scheduler run on a virtual clock (gateway.sim.virtual), same prompt/output sizes
  engine     the engine's own ITL histogram (modelled step ends as the real-time loop hit them)
  delivered  per request (last content event - first) / (events - 1), measured by the client

Usage: python3 -m benchmarks.sim_drift [--concurrency 1 16 32 64] [--repeats 3] [--output-tokens 300]
Writes benchmarks/results/sim_drift.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import uvloop

from benchmarks import kit
from gateway.sim.profiles import get_profile
from gateway.sim.virtual import Workload, run_closed_loop

FILLER = ("The gateway measures every stream it relays and routes the next request to the "
          "engine that serves its shape best. ")


async def start_engine(engine: str, profile: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.sim", "--engine", engine, "--profile", profile,
        "--port", "0", stdout=asyncio.subprocess.PIPE)
    line = (await asyncio.wait_for(proc.stdout.readline(), 15)).decode().strip()
    return proc, line.rsplit(" ", 1)[-1]


def prompt_for(stream: int, run: str) -> str:
    # ~110 prompt tokens after the chat template, unique per stream so no prefix is cached.
    return f"Run {run}, stream {stream}. " + FILLER * 4


async def one_stream(http: aiohttp.ClientSession, url: str, text: str, out: int) -> dict:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": text}],
            "max_tokens": out, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    times: list[float] = []
    prompt_tokens = 0
    sent = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"delta":{"content":"' in line:
                times.append(time.perf_counter())
            elif b'"usage"' in line:
                prompt_tokens = json.loads(line[6:])["usage"]["prompt_tokens"]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - sent, "itl": (times[-1] - times[0]) / (len(times) - 1),
            "gaps": gaps, "events": len(times), "prompt_tokens": prompt_tokens}


async def engine_state(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/sim/state") as resp:
        return await resp.json()


async def run_level(http: aiohttp.ClientSession, url: str, streams: int, out: int, tag: str) -> dict:
    before = await engine_state(http, url)
    wall = time.perf_counter()
    results = await asyncio.gather(
        *(one_stream(http, url, prompt_for(i, tag), out) for i in range(streams)))
    wall = time.perf_counter() - wall
    after = await engine_state(http, url)
    gaps = sorted(g for r in results for g in r["gaps"])
    d_count = after["itl_count"] - before["itl_count"]
    return {
        "delivered_itl_s": statistics.median(r["itl"] for r in results),
        "delivered_ttft_s": statistics.median(r["ttft"] for r in results),
        "engine_itl_s": (after["itl_sum_s"] - before["itl_sum_s"]) / d_count,
        "gap_p50_s": gaps[len(gaps) // 2], "gap_p99_s": gaps[int(len(gaps) * 0.99)],
        "output_tps": streams * out / wall,
        "late_steps": after["late_steps"] - before["late_steps"],
        "steps": after["steps"] - before["steps"],
        "rebases": after["rebases"] - before["rebases"],
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in results),
    }


def summarize(level: int, runs: list[dict], modelled_itl: float, modelled_ttft: float) -> dict:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    delivered = [r["delivered_itl_s"] for r in runs]
    return {
        "streams": level, "repeats": len(runs),
        "modelled_itl_ms": modelled_itl * 1000, "modelled_ttft_ms": modelled_ttft * 1000,
        "engine_itl_ms": med("engine_itl_s") * 1000,
        "delivered_itl_ms": med("delivered_itl_s") * 1000,
        "delivered_itl_spread": kit.median_spread(delivered)[1],
        "drift_pct": (med("delivered_itl_s") / modelled_itl - 1) * 100,
        "drift_pct_min": (min(delivered) / modelled_itl - 1) * 100,
        "drift_pct_max": (max(delivered) / modelled_itl - 1) * 100,
        "delivered_ttft_ms": med("delivered_ttft_s") * 1000,
        "gap_p50_ms": med("gap_p50_s") * 1000, "gap_p99_ms": med("gap_p99_s") * 1000,
        "output_tps": med("output_tps"),
        "late_step_share": med("late_steps") / max(med("steps"), 1),
        "rebases": max(r["rebases"] for r in runs),
        "runs": runs,
    }


async def bench(args: argparse.Namespace) -> dict:
    profile = get_profile(args.engine, args.profile)
    proc, url = await start_engine(args.engine, args.profile)
    levels = []
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            await one_stream(http, url, "warm up", 8)
            for level in args.concurrency:
                runs = []
                for rep in range(args.repeats):
                    runs.append(await run_level(http, url, level, args.output_tokens,
                                                f"{level}-{rep}"))
                work = Workload(level, 1, int(runs[0]["prompt_tokens"]), args.output_tokens)
                model = run_closed_loop(profile, work)
                levels.append(summarize(level, runs, model.mean_tpot_s, model.mean_ttft_s))
                print(_line(levels[-1]), flush=True)
    finally:
        proc.terminate()
        await proc.wait()
    return {"engine": args.engine, "profile": args.profile, "output_tokens": args.output_tokens,
            "repeats": args.repeats, "machine": kit.host(), "levels": levels}


def _line(row: dict) -> str:
    return (f"{row['streams']:>3} streams: modelled ITL {row['modelled_itl_ms']:.2f} ms, engine "
            f"{row['engine_itl_ms']:.2f} ms, delivered {row['delivered_itl_ms']:.2f} ms "
            f"({row['drift_pct']:+.1f} %, {row['drift_pct_min']:+.1f}..{row['drift_pct_max']:+.1f}), "
            f"gap p99 {row['gap_p99_ms']:.1f} ms, late steps {row['late_step_share']:.0%}")


def write_markdown(data: dict, path: Path) -> None:
    rows = [
        "| streams | modelled ITL ms | engine ITL ms | delivered ITL ms (median of 3) | drift | "
        "drift range | spread | gap p50 / p99 ms | TTFT modelled / delivered ms | output tok/s | "
        "late steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["levels"]:
        rows.append(
            f"| {r['streams']} | {r['modelled_itl_ms']:.2f} | {r['engine_itl_ms']:.2f} | "
            f"{r['delivered_itl_ms']:.2f} | {r['drift_pct']:+.1f} % | "
            f"{r['drift_pct_min']:+.1f} .. {r['drift_pct_max']:+.1f} % | "
            f"{r['delivered_itl_spread'] * 100:.1f} % | {r['gap_p50_ms']:.1f} / {r['gap_p99_ms']:.1f} | "
            f"{r['modelled_ttft_ms']:.0f} / {r['delivered_ttft_ms']:.0f} | {r['output_tps']:.0f} | "
            f"{r['late_step_share']:.0%} |")
    text = f"""# Simulator drift: delivered vs modelled ITL

One `python -m gateway.sim --engine {data['engine']} --profile {data['profile']}` process, N
concurrent streams of {data['output_tokens']} output tokens (`ignore_eos`, ~110-token prompts),
{data['repeats']} repeats per level, aiohttp client on the same machine ({data['machine']}).

- modelled: the scheduler on a virtual clock for the same workload (the latency model itself);
- engine: the engine's own ITL histogram (modelled step ends, as the real-time loop reached them);
- delivered: per request (last content event - first) / (events - 1), measured by the client;
  the table gives the median over requests, then the median of the {data['repeats']} repeats;
- drift = delivered / modelled - 1; range = min..max over repeats; spread = (max - min) / median;
- late steps: share of engine steps whose tokens went out more than 2 ms after their modelled end.

{chr(10).join(rows)}

Generated by `benchmarks/sim_drift.py`; raw figures in `sim_drift.json`.
"""
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--profile", default="mi350x-vllm")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=300)
    parser.add_argument("--out", type=Path, default=kit.RESULTS / "sim_drift")
    args = parser.parse_args()
    data = uvloop.run(bench(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    write_markdown(data, args.out.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
