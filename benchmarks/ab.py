"""A/B benchmark: the simulated MI350X vLLM and SGLang as two arms of one model, split and shadowed, verdicts.

Split runs: one gateway in front of the two simulated engines (calibrated MI350X profiles, real time), one
split experiment (vllm vs sglang, 50/50 by the request's `user`), a mixed workload of Poisson arrivals
(long generations, long prompts, short chats), streamed, users assigned by a header; then the gateway's own verdicts from
/admin/experiments, per class and metric. The profiles say what the verdict should be: SGLang has the
higher TTFT (40 vs 17 ms at c=1) and the lower ITL. Shadow runs: vLLM serves, every request is copied to
SGLang at temperature 0, and the report gives the candidate's figures and whether its outputs agree.

Usage: python3 -m benchmarks.ab [--repeats 3] [--window 120] [--quick] [--from-json FILE]
Writes benchmarks/results/ab.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path

import aiohttp
import uvloop

from benchmarks import ab_report, kit
from benchmarks import routing_workload as W
from benchmarks.stack import serve_gateway, serve_sims, stack_config, stop_children, stream_request, wait_ready

ADMIN_KEY = "sk-ab-benchmark-admin"
ENGINES = (("vllm", "vllm", "mi350x-vllm"), ("sglang", "sglang", "mi350x-sglang"))
# name, prompt tokens, output tokens, arrivals per second
KINDS = (("generation", 110, 600, 0.5), ("summarization", 1500, 60, 0.7), ("chat", 200, 120, 1.0))
USERS = 400


def config(mode: str, ports: list[int]) -> dict:
    from gateway.keys.principal import hash_key

    backends = [{"id": bid, "engine": engine, "url": f"http://127.0.0.1:{port}", "models": [W.MODEL]}
                for (bid, engine, _), port in zip(ENGINES, ports)]
    if mode == "split":
        # By a header naming the end user: the body's `user` would also mark each request as a session.
        experiment = {"name": "engines", "model": W.MODEL, "mode": "split", "subject": "header:x-end-user",
                      "arms": [{"name": "vllm", "backends": ["vllm"]}, {"name": "sglang", "backends": ["sglang"]}]}
    else:
        experiment = {"name": "candidate", "model": W.MODEL, "mode": "shadow", "fraction": 1.0,
                      "shadow_max_in_flight": 64, "arms": [{"name": "sglang", "backends": ["sglang"]}]}
    return stack_config(backends, auth={"keys": [{"id": "bench", "sha256": hash_key(ADMIN_KEY), "admin": True}]},
                        upstream={"first_byte_timeout_s": 120.0}, experiments=[experiment])


def arrivals(window_s: float, seed: int) -> list[tuple[float, str, dict, dict]]:
    rng = random.Random(seed)
    out = []
    for name, prompt, output, rate in KINDS:
        t = rng.expovariate(rate)
        while t < window_s:
            body = {"model": W.MODEL, "messages": [{"role": "user", "content": W.words(rng, prompt)}],
                    "max_tokens": output, "stream": True, "ignore_eos": True, "temperature": 0,
                    "stream_options": {"include_usage": True}}
            out.append((t, name, body, {"x-end-user": f"user-{rng.randrange(USERS)}"}))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda a: a[0])


async def drive(url: str, sim_urls: list[str], window_s: float, seed: int) -> tuple[list[dict], dict, dict]:
    """The run's requests as the client saw them, the gateway's experiment report, the sims' loop health."""
    records: list[dict] = []
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await wait_ready(http, url, "the gateway")
        t0 = time.monotonic()

        async def one(at: float, kind: str, body: dict, user: dict) -> None:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
            rec = {"kind": kind}
            try:
                await stream_request(http, url, body, {**headers, **user}, rec)
            except (aiohttp.ClientError, TimeoutError) as e:
                rec.update(ok=False, error=type(e).__name__)
            records.append(rec)

        await asyncio.gather(*(one(*a) for a in arrivals(window_s, seed)))
        await asyncio.sleep(1.0 + 3.0)  # shadow copies finish, and each process publishes its samples
        async with http.get(url + "/admin/experiments", headers=headers) as r:
            report = await r.json()
        health = {}
        for (bid, *_), sim in zip(ENGINES, sim_urls):
            async with http.get(sim + "/sim/state") as r:
                s = await r.json()
            health[bid] = {"steps": s["steps"], "late_steps": s["late_steps"]}
    return records, report, health


def one_run(ctx, mode: str, window_s: float, seed: int) -> dict:
    ports = [kit.free_port() for _ in ENGINES]
    gw_port = kit.free_port()
    sims = ctx.Process(target=serve_sims, args=(ports, [(e, p) for _, e, p in ENGINES]), daemon=True)
    gw = ctx.Process(target=serve_gateway, args=(config(mode, ports), gw_port), daemon=True)
    sims.start()
    gw.start()
    try:
        records, report, health = uvloop.run(drive(f"http://127.0.0.1:{gw_port}",
                                                   [f"http://127.0.0.1:{p}" for p in ports], window_s, seed))
    finally:
        stop_children([gw, sims])
    return {"mode": mode, "seed": seed, "records": records, "experiment": report["data"][0], "sim_health": health}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=float, default=120.0, help="seconds of arrivals per run")
    ap.add_argument("--quick", action="store_true", help="one repeat of each mode, 20 s windows")
    ap.add_argument("--output", default=str(kit.RESULTS / "ab"), help="path prefix of the .md and .json")
    ap.add_argument("--from-json", help="re-render the .md of an earlier run's .json (no run)")
    args = ap.parse_args(argv)
    if args.from_json:
        print(kit.render_again(Path(args.from_json), lambda data: ab_report.markdown(data["meta"], data["runs"])))
        return 0
    if args.quick:
        args.repeats, args.window = 1, 20.0
    ctx = multiprocessing.get_context("spawn")
    meta = {"commit": kit.commit(), "dirty": bool(kit.changed_paths()), "date": kit.utc_date(), "machine": kit.host(),
            "load_before": os.getloadavg(), "repeats": args.repeats, "window_s": args.window,
            "kinds": KINDS, "users": USERS, "engines": ENGINES, "command": kit.command("benchmarks.ab", argv)}
    runs = []
    started = time.time()
    for r in range(args.repeats):
        for mode in ("split", "shadow"):
            runs.append(one_run(ctx, mode, args.window, seed=1000 + r))
            print(f"{mode} run {r + 1}/{args.repeats} done after {time.time() - started:.0f} s", file=sys.stderr)
    meta["load_after"] = os.getloadavg()
    meta["elapsed_s"] = round(time.time() - started, 1)
    md = ab_report.markdown(meta, runs)
    kit.write_result(Path(args.output), {"meta": meta, "runs": runs}, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
