"""The gateway's own TTFT/ITL per request against what real llama.cpp and vLLM report for the same request."""

# Starts the real engines of the e2e suite (tests/e2e/engines.py: llama-server b11434 with
# `--parallel 2 -c 4096`, vLLM 0.32 CPU with max_model_len 4096 / max_num_seqs 2, tiny random-weight
# model), puts an in-process shapegate in front of each, and sends the same streamed chat requests one
# at a time. For every request it records:
#
#   client    TTFT seen by the client (request sent -> first content event)
#   gateway   the gateway's own sample (gateway.state pool -> backend.stats.samples): TTFT from the
#             upstream send to the first token event, ITL = (last - first token event) / (tokens - 1)
#   engine    llama.cpp: `timings.prompt_ms` and predicted_ms / (predicted_n - 1) from the stream's
#             last chunk; vLLM: the per-request delta of the `vllm:time_to_first_token_seconds` and
#             `vllm:inter_token_latency_seconds` histogram sums / counts, scraped before and after
#
# Each prompt starts with a unique head, so no request reuses another's cached prefix.
#
# Usage: python3 -m benchmarks.e2e_timing [--engines llamacpp vllm] [--repeats 3] [--per-repeat 5]
# Writes benchmarks/results/e2e_timing.{json,md}; --markdown-only rewrites the .md from the .json.

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks import kit
from gateway.routing.relay import is_token_event
from tests.e2e import wire  # the e2e suite's real engines and the in-process gateway its tests run
from tests.e2e.engines import EngineHandle, start_llama_server, start_vllm_server
from tests.e2e.targets import PUBLIC_MODEL, backend, config, last_sample
from tests.gateway_harness import USER_KEY, RunningGateway, start_gateway

# filler words after the unique head: ~30, ~480 and ~1,500 prompt tokens in the tiny vocabulary
PROMPTS = {"short": 0, "medium": 95, "long": 290}
FILLER = "route"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"


async def _vllm_hist(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    fams = await wire.metric_families(http, url)
    return {f"{name}_{part}": wire.sample_value(fams, name, f"{name}_{part}")
            for name in (TTFT, ITL) for part in ("sum", "count")}


async def _vllm_engine_figures(http: aiohttp.ClientSession, url: str, before: dict[str, float],
                               tokens: int) -> tuple[float, float]:
    """(TTFT, mean ITL) of the one request since `before`; vLLM may log a finished request a moment late."""
    deadline = time.monotonic() + 2.0
    while True:
        after = await _vllm_hist(http, url)
        d = {k: after[k] - before[k] for k in after}
        if (d[f"{TTFT}_count"] >= 1 and d[f"{ITL}_count"] >= tokens - 1) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    return d[f"{TTFT}_sum"] / d[f"{TTFT}_count"], d[f"{ITL}_sum"] / d[f"{ITL}_count"]


async def one_request(http: aiohttp.ClientSession, gw: RunningGateway, handle: EngineHandle, text: str,
                      out_tokens: int) -> dict[str, Any]:
    b = gw.state.pool.get(handle.engine)
    before = await _vllm_hist(http, handle.url) if handle.engine == "vllm" else None
    seen = len(b.stats.samples)
    body = {"model": PUBLIC_MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": out_tokens,
            "ignore_eos": True, "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}}
    first = usage = timings = None
    sent = time.perf_counter()
    async with http.post(gw.url + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {USER_KEY}"}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if first is None and is_token_event(line):
                first = time.perf_counter()
            if b'"usage"' in line or b'"timings"' in line:
                event = orjson.loads(line[6:])
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings
    sample = await last_sample(b.stats, seen)
    tokens = usage["completion_tokens"]
    if handle.engine == "llamacpp":
        engine_ttft = timings["prompt_ms"] / 1000
        engine_itl = timings["predicted_ms"] / 1000 / (timings["predicted_n"] - 1)
    else:
        engine_ttft, engine_itl = await _vllm_engine_figures(http, handle.url, before, tokens)
    return {"prompt_tokens": usage["prompt_tokens"], "tokens": tokens, "client_ttft": first - sent,
            "gateway_ttft": sample.ttft, "gateway_itl": sample.itl, "engine_ttft": engine_ttft,
            "engine_itl": engine_itl}


def is_burst(r: dict[str, Any]) -> bool:
    """The whole answer reached the gateway at once: the engine produced tokens it had not yet sent."""
    return r["gateway_itl"] is not None and r["gateway_itl"] < 0.25 * r["engine_itl"]


def summarize(reps: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per repeat the medians over its streamed (not burst) requests; then the median of the repeats
    and their min..max. Bursts are counted, not averaged in: there the gateway saw no token until
    the engine had finished, so its figures measure the engine's delivery, not its generation."""
    keys = ("client_ttft", "gateway_ttft", "engine_ttft", "gateway_itl", "engine_itl")
    per_rep = []
    for rows in reps:
        streamed = [r for r in rows if not is_burst(r)]
        if not streamed:
            continue
        m = {k: statistics.median(r[k] for r in streamed) * 1000 for k in keys}
        m["ttft_diff"] = statistics.median(r["gateway_ttft"] - r["engine_ttft"] for r in streamed) * 1000
        m["itl_diff"] = statistics.median(r["gateway_itl"] - r["engine_itl"] for r in streamed) * 1000
        per_rep.append(m)
    rows = [r for rep in reps for r in rep]
    bursts = [r for r in rows if is_burst(r)]
    out: dict[str, Any] = {"prompt_tokens": rows[0]["prompt_tokens"], "tokens": rows[0]["tokens"],
                           "requests": len(rows), "bursts": len(bursts), "repeats_used": len(per_rep),
                           "burst_gateway_ttft_ms": statistics.median(r["gateway_ttft"] for r in bursts) * 1000
                           if bursts else None}
    for k in (*keys, "ttft_diff", "itl_diff"):
        values = [m[k] for m in per_rep]
        out[k] = {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
    return out


async def gateway_overhead_ms(http: aiohttp.ClientSession, gw: RunningGateway) -> float:
    fams = await wire.metric_families(http, gw.url)
    name = "shapegate_gateway_overhead_seconds"
    n = wire.sample_value(fams, name, name + "_count")
    return wire.sample_value(fams, name, name + "_sum") / n * 1000 if n else 0.0


async def bench_engine(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    handle = await (start_llama_server() if engine == "llamacpp" else start_vllm_server(max_num_seqs=2))
    try:
        # llama.cpp's `timings` (its own TTFT and ITL) reach this client only if the gateway keeps them.
        gw = await start_gateway(config([backend(engine, engine, handle.url) | {"engine_private_fields": True}]))
        try:
            async with aiohttp.ClientSession() as http:
                for i in range(3):  # the first requests after a start are slow on both engines
                    await one_request(http, gw, handle, f"Warm up {i}.", args.output_tokens)
                prompts: dict[str, Any] = {}
                for name, words in PROMPTS.items():
                    reps = []
                    for rep in range(args.repeats):
                        reps.append([await one_request(http, gw, handle,
                                                        f"Request {name}-{rep}-{i}. " + " ".join([FILLER] * words),
                                                        args.output_tokens)
                                     for i in range(args.per_repeat)])
                    prompts[name] = summarize(reps) | {"raw": reps}
                    print(_line(engine, name, prompts[name]), flush=True)
                overhead = await gateway_overhead_ms(http, gw)
        finally:
            await gw.stop()
    finally:
        await handle.close()
    return {"startup_s": handle.startup_s, "gateway_overhead_ms": overhead, "prompts": prompts}


def _fmt(v: dict[str, float] | None, digits: int = 2) -> str:
    if v is None:  # every repeat was all bursts
        return "-"
    return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}..{v['max']:.{digits}f})"


def _line(engine: str, name: str, p: dict[str, Any]) -> str:
    return (f"{engine:>8} {name:>6} ({p['prompt_tokens']} in / {p['tokens']} out): TTFT gateway "
            f"{_fmt(p['gateway_ttft'])} engine {_fmt(p['engine_ttft'])} ms; ITL gateway {_fmt(p['gateway_itl'], 3)} "
            f"engine {_fmt(p['engine_itl'], 3)} ms; bursts {p['bursts']}/{p['requests']}")


def write_markdown(data: dict[str, Any], path: Path) -> None:
    rows = ["| engine | prompt (in / out tokens) | client TTFT | gateway TTFT | engine TTFT | gateway - engine "
            "TTFT | gateway ITL | engine ITL | gateway - engine ITL | bursts (gateway TTFT) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for engine, e in data["engines"].items():
        for name, p in e["prompts"].items():
            burst = (f"{p['bursts']} of {p['requests']} ({p['burst_gateway_ttft_ms']:.0f})" if p["bursts"]
                     else f"0 of {p['requests']}")
            used = "" if p["repeats_used"] == data["repeats"] else f", {p['repeats_used']} repeats*"
            rows.append(f"| {engine} | {name} ({p['prompt_tokens']} / {p['tokens']}{used}) | "
                        f"{_fmt(p['client_ttft'])} | {_fmt(p['gateway_ttft'])} | {_fmt(p['engine_ttft'])} | "
                        f"{_fmt(p['ttft_diff'])} | "
                        f"{_fmt(p['gateway_itl'], 3)} | {_fmt(p['engine_itl'], 3)} | {_fmt(p['itl_diff'], 3)} | "
                        f"{burst} |")
    overheads = ", ".join(f"{k} {v['gateway_overhead_ms']:.2f} ms" for k, v in data["engines"].items())
    text = f"""# Gateway-measured vs engine-reported TTFT and ITL (real engines)

Commit {data.get('commit', 'not recorded')}, {data.get('date', 'date not recorded')}, `{data.get('command',
'python -m benchmarks.e2e_timing')}`. {data['machine']}; load average at the start {data['load']}, at the end
{data.get('load_after', 'not recorded')}. Each request: one streamed chat,
{data['output_tokens']} output tokens (`ignore_eos`), sent alone through an in-process shapegate.
{data['repeats']} repeats of {data['per_repeat']} requests per prompt; every figure is the median over
a repeat's requests, then the median of the {data['repeats']} repeats with their min..max in brackets,
in milliseconds. Gateway overhead before the upstream call (`shapegate_gateway_overhead_seconds`,
mean): {overheads}.

- gateway TTFT: upstream request sent -> first token event relayed; engine TTFT: llama.cpp
  `timings.prompt_ms` (prompt processing, which yields the first token), vLLM's
  `time_to_first_token_seconds` (request arrival in its front end -> first token);
- gateway ITL: (last - first token event) / (tokens - 1); engine ITL: llama.cpp
  predicted_ms / (predicted_n - 1), vLLM's mean `inter_token_latency_seconds`.

{chr(10).join(rows)}

{reading(data)}

Generated by `benchmarks/e2e_timing.py`; raw figures in `e2e_timing.json`.
"""
    path.write_text(text)


def reading(data: dict[str, Any]) -> str:
    """What the table says, computed from it."""
    out = ["Reading it:",
           "- The difference columns are medians of per-request differences, so they need not equal the "
           "difference of the medians beside them. * fewer repeats: a repeat whose requests all came as bursts "
           "has no streamed request to compare."]
    for engine, e in data["engines"].items():
        prompts = [p for p in e["prompts"].values() if p["itl_diff"] is not None]
        if not prompts:
            out.append(f"- {engine}: every request came as a burst; nothing to compare.")
            continue
        itl = max(abs(p["itl_diff"]["median"]) for p in prompts)
        gaps = [p["ttft_diff"]["median"] for p in prompts]
        client = [p["client_ttft"]["median"] - p["gateway_ttft"]["median"] for p in prompts]
        bursts = sum(p["bursts"] for p in e["prompts"].values())
        total = sum(p["requests"] for p in e["prompts"].values())
        out.append(f"- {engine}: gateway and engine ITL differ by at most {itl:.3f} ms (median per prompt); the "
                   f"gateway's TTFT is {min(gaps):.1f}-{max(gaps):.1f} ms above the engine's own (the engine's work "
                   f"outside its clock and the loopback hop; the gateway's own time before the upstream call is "
                   f"{e['gateway_overhead_ms']:.2f} ms); the client sees its first token "
                   f"{min(client):.1f}-{max(client):.1f} ms after the gateway does; {bursts} of {total} requests "
                   "arrived as one burst (the engine held the whole answer) and are left out of the medians.")
    return "\n".join(out)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    data: dict[str, Any] = {
        "machine": kit.host(),
        "load": ", ".join(f"{x:.1f}" for x in os.getloadavg()), "output_tokens": args.output_tokens,
        "commit": kit.commit() + (" (uncommitted changes)" if kit.changed_paths() else ""),
        "date": kit.utc_date(), "command": kit.command("benchmarks.e2e_timing"),
        "repeats": args.repeats, "per_repeat": args.per_repeat, "engines": {}}
    for engine in args.engines:
        data["engines"][engine] = await bench_engine(engine, args)
    data["load_after"] = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["llamacpp", "vllm"], choices=["llamacpp", "vllm"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-repeat", type=int, default=5)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=kit.RESULTS / "e2e_timing")
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args()
    if args.markdown_only:
        data = json.loads(args.out.with_suffix(".json").read_text())
    else:
        data = asyncio.run(main_async(args))
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    write_markdown(data, args.out.with_suffix(".md"))
    print(f"wrote {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
