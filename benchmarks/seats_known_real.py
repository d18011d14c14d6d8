"""A fresh gateway process in front of overloaded real engines (llama-server with 2 slots, vLLM CPU), the queue on:
with vLLM's seat count unknown (as any process that starts alone) and with the count another process learned
(shared through Redis, as a replica that starts beside others, or a restart, finds it)."""

# benchmarks/overload_real.py's engines, calibration, workload and runs; every run is a fresh gateway on
# [state] backend = "redis" under a key prefix of its own, so that the runs share nothing but what is put there: for
# "seats known", the seat counts the latest "seats unknown" run learned (its `seats` hash, copied), and nothing else
# (no latency learning). The two variants run with the same arrivals in each repeat, in alternating order; the first
# run is always a "seats unknown" run (the other needs a count learned before it). The figures are the first key's
# TTFT-target attainment over the whole window, and that of its agent requests and long prompts (the short targets)
# by --bucket seconds of arrival: what an unknown count costs shows where the long outputs let in before the count
# was learned still hold vLLM's seats.
#
# Usage: python3 -m benchmarks.seats_known_real [--repeats 3] [--window 40] [--load 1.8] [--bucket 10]
#        python3 -m benchmarks.seats_known_real --from-json benchmarks/results/seats_known_real.json  (re-render)
# Writes benchmarks/results/seats_known_real.{md,json}.

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import redis.asyncio as redis_asyncio

from benchmarks import kit
from benchmarks import overload_real as ol
from benchmarks import overload_real_report as report
from tests.e2e import wire

UNKNOWN, KNOWN = "seats unknown", "seats known"
REDIS_URL = "redis://127.0.0.1:6379/0"
KINDS = ("interactive", "agent", "summarization", "generation")
SHORT = ("agent", "summarization")  # the kinds with 1 s and 2 s targets that wait behind long outputs on vLLM
OUTPUTS = {"interactive": 64, "agent": 128, "summarization": 32, "generation": 1000, "flood": 1000}


def schedule(repeats: int) -> list[tuple[str, int]]:
    """Unknown first in the first repeat (the known runs need a count learned), then alternating."""
    return [(v, r) for r in range(repeats) for v in ((UNKNOWN, KNOWN) if r % 2 == 0 else (KNOWN, UNKNOWN))]


def by_arrival(run: dict, tg: dict[str, float], bucket: float) -> list[list[int]]:
    """[met, all] of the first key's agent requests and long prompts arrived in each `bucket` seconds."""
    out = [[0, 0] for _ in range(max(int(-(-run["window_s"] // bucket)), 1))]
    for r in run["records"]:
        if r["key"] == "first" and r["kind"] in SHORT and 0 <= r["at"] < run["window_s"]:
            cell = out[min(int(r["at"] // bucket), len(out) - 1)]
            cell[0] += report.attained(r, tg, OUTPUTS)
            cell[1] += 1
    return out


def _attained(f: dict) -> dict:
    return {"first": f["first"]["attained"], "failed": f["first"]["failed"], "tokens": f["first"]["tokens"],
            **{k: f["classes"][k]["attained"] for k in KINDS}}


def summarize(runs: list[dict], meta: dict) -> dict:
    tg = meta["targets"]
    rows = [{"variant": r["variant"], "repeat": r["repeat"], "seats_at_start": r["seats_at_start"],
             "seats_at_end": r["seats_at_end"], "all": _attained(report.run_figures(r, tg)),
             "by_arrival": by_arrival(r, tg, meta["bucket_s"])} for r in runs]
    median = {}
    for v in (UNKNOWN, KNOWN):
        mine = [row for row in rows if row["variant"] == v]
        if mine:
            median[v] = {k: _spread([row["all"][k] for row in mine]) for k in ("first", *KINDS)}
            median[v]["tokens"] = _spread([row["all"]["tokens"] for row in mine])
    return {"runs": rows, "median": median}


def _spread(values: list) -> dict | None:
    v = [x for x in values if x is not None]
    return {"median": statistics.median(v), "min": min(v), "max": max(v)} if v else None


def markdown(meta: dict, s: dict) -> str:
    p = report._p
    out = [f"# A fresh gateway with vLLM's seat count unknown or shared ({meta['date']})", "",
           f"Commit {meta['commit']}{' (uncommitted changes)' if meta['dirty'] else ''}, {meta['machine']}, load "
           f"{meta['load_before'][0]:.2f} before, {meta['elapsed_s']:.0f} s. `{meta['command']}`", "",
           f"Offered load {meta['offered_load']} (benchmarks/overload_real.py's mix), {meta['window_s']:.0f} s "
           f"windows, queue on with its defaults, {meta['repeats']} repeats, the variants alternating. TTFT targets "
           f"(s): " + ", ".join(f"{k} {v}" for k, v in meta["targets"].items() if k in KINDS) + ". Seats: vLLM's "
           "entry in the run's `seats` hash when its gateway started and when the run ended.", "",
           "| run | seats at start -> end | first key | interactive | agent | long prompts | bulk | failed | tokens |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in s["runs"]:
        a = r["all"]
        out.append(f"| {r['variant']} #{r['repeat'] + 1} | {r['seats_at_start'] or '-'} -> {r['seats_at_end'] or '-'} "
                   f"| {p(a['first'])} | {p(a['interactive'])} | {p(a['agent'])} | {p(a['summarization'])} | "
                   f"{p(a['generation'])} | {a['failed']} | {a['tokens']} |")
    out += ["", "Medians (min-max) of the runs of each variant:", "",
            "| variant | first key | interactive | agent | long prompts | bulk | tokens |", "|---" * 7 + "|"]
    for v, figs in s["median"].items():
        cells = [f"{p(f['median'])} ({p(f['min'])}-{p(f['max'])})" if f else "-"
                 for f in (figs[k] for k in ("first", *KINDS))]
        tok = figs["tokens"]
        out.append(f"| {v} | " + " | ".join(cells) + f" | {tok['median']:.0f} ({tok['min']}-{tok['max']}) |")
    b = meta["bucket_s"]
    width = len(s["runs"][0]["by_arrival"]) if s["runs"] else 0
    out += ["", f"Agent requests and long prompts that met their target, by {b:.0f} s of arrival:", "",
            "| run | " + " | ".join(f"{i * b:.0f}-{(i + 1) * b:.0f} s" for i in range(width)) + " |",
            "|---|" + "---|" * width]
    for r in s["runs"]:
        cells = " | ".join(f"{m}/{n}" for m, n in r["by_arrival"])
        out.append(f"| {r['variant']} #{r['repeat'] + 1} | {cells} |")
    return "\n".join(out) + "\n"


async def seats_entry(r: redis_asyncio.Redis, prefix: str) -> str | None:
    raw = await r.hget(prefix + "seats", "vllm")
    if raw is None:
        return None
    e = orjson.loads(raw)
    return f"full {e['full']}, peak {e['peak']}"


async def bench(args: argparse.Namespace, meta: dict) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    engines = await ol.start_engines(args)
    runs: list[dict] = []
    store = redis_asyncio.Redis.from_url(REDIS_URL)
    prefixes: list[str] = []
    learned: dict = {}  # the latest unknown run's seats hash
    try:
        async with wire.new_session() as direct:
            cal = await ol.prepare(direct, engines, args, meta)
            timeout = aiohttp.ClientTimeout(total=None, sock_read=args.window + args.drain)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
                for variant, rep in schedule(args.repeats):
                    prefix = f"shapegate-bench:{secrets.token_hex(4)}:"
                    prefixes.append(prefix)
                    if variant == KNOWN and learned:
                        await store.hset(prefix + "seats", mapping=learned)
                    cfg = ol.gateway_config(ol.QUEUE_ON, engines, args.queue)
                    cfg["state"] = {"backend": "redis", "redis_url": REDIS_URL, "key_prefix": prefix}
                    at_start = await seats_entry(store, prefix)
                    run = await ol.run_variant(ctx, http, direct, engines, variant, rep, cal["rates"], args, cfg)
                    run.update(seats_at_start=at_start, seats_at_end=await seats_entry(store, prefix))
                    if variant == UNKNOWN:
                        learned = await store.hgetall(prefix + "seats")
                    runs.append(run)
                    f = report.run_figures(run, meta["targets"])
                    print(f"{variant} #{rep + 1}: first key TTFT target met {f['first']['attained']:.0%}, seats "
                          f"{at_start} -> {run['seats_at_end']}, {time.time() - meta['started']:.0f} s",
                          file=sys.stderr)
                    save(args, meta, runs, done=False)
    finally:
        for prefix in prefixes:
            keys = [k async for k in store.scan_iter(match=prefix + "*")]
            if keys:
                await store.delete(*keys)
        await store.aclose()
        for h in engines:
            await h.close()
    return runs


def save(args: argparse.Namespace, meta: dict, runs: list[dict], done: bool) -> str:
    meta["load_after"] = os.getloadavg()
    meta["elapsed_s"] = round(time.time() - meta["started"], 1)
    meta["complete"] = done
    summary = summarize(runs, meta)
    md = markdown(meta, summary)
    kit.write_result(Path(args.output), {"meta": meta, "summary": summary, "runs": runs}, md)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    ap.add_argument("--window", type=float, default=40.0, help="seconds of arrivals per run")
    ap.add_argument("--drain", type=float, default=150.0, help="seconds after the window before cutting requests")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between runs once both engines are idle")
    ap.add_argument("--load", type=float, default=1.8, help="as benchmarks/overload_real.py's")
    ap.add_argument("--bucket", type=float, default=10.0, help="seconds of arrival per column of the last table")
    ap.add_argument("--slo-factor", type=float, default=3.0)
    ap.add_argument("--ttft-floor-ms", type=float, default=50.0)
    ap.add_argument("--queue", type=orjson.loads, default=None, help="[queue] settings besides enabled, as JSON")
    ap.add_argument("--sim", action="store_true", help="simulated engines (a check of the script, not a result)")
    ap.add_argument("--output", default=str(kit.RESULTS / "seats_known_real"), help="path prefix of the .md and .json")
    ap.add_argument("--from-json", help="re-render the .md of an earlier run's .json (no run)")
    args = ap.parse_args(argv)
    if args.from_json:  # the report and the summary in the .json, again from the runs' records
        saved = Path(args.from_json).with_suffix("")
        data = orjson.loads(saved.with_suffix(".json").read_bytes())
        data["meta"].setdefault("bucket_s", args.bucket)
        data["summary"] = summarize(data["runs"], data["meta"])
        md = markdown(data["meta"], data["summary"])
        kit.write_result(saved, data, md)
        print(md)
        return 0
    # overload_real's runs read these; none of them floods, and the targets are the gateway's class targets
    args.flood_factor = 0.0
    args.interactive_ttft = args.agent_ttft = args.long_prompt_ttft = args.generation_ttft = None
    meta = {"started": time.time(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": kit.commit(),
            "dirty": bool(kit.changed_paths()), "machine": kit.host(), "load_before": os.getloadavg(),
            "command": kit.command("benchmarks.seats_known_real", argv), "repeats": args.repeats,
            "window_s": args.window, "drain_s": args.drain, "offered_load": args.load, "bucket_s": args.bucket,
            "queue_settings": args.queue, "schedule": schedule(args.repeats)}
    runs = asyncio.run(bench(args, meta))
    print(save(args, meta, runs, done=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
