"""The support probe's tables for a simulator portfolio and for the real llama-server and vLLM of tests/e2e.

Starts the three simulator flavours (tiny profiles) in this process, then the real engines the e2e suite
uses (built and cached under ~/.cache/shapegate on first use, which takes minutes), probes each set the way
`shapegate probe` does, and writes benchmarks/results/probe.md: the machine, the load before and after,
the engines' versions, and each probe's tables with their reasons.

Usage: python3 -m benchmarks.probe [--timeout S] [--no-real]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any, Awaitable, Callable

import aiohttp
import orjson

from benchmarks import kit
from gateway.cli.probe import probe_all, render
from gateway.config import GatewayConfig, parse_config
from gateway.runtime import build_policy
from gateway.sim.runner import SimOptions, start_sim
from tests.e2e.engines import LLAMA_ALIAS, VLLM_NAME, start_llama_server, start_vllm_server

RESULT = kit.RESULTS / "probe.md"
REQUIRE = ["chat", "stream"]


def config(backends: list[dict[str, Any]]) -> GatewayConfig:
    return parse_config({"auth": {"enabled": False}, "probe": {"require": REQUIRE}, "backends": backends},
                        build_policy)


async def version(url: str, path: str, pick: Callable[[Any], Any]) -> str:
    """What an engine says its version is on its own route, or "unknown"."""
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                found = pick(orjson.loads(await r.read())) if r.status == 200 else None
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError):
        return "unknown"
    return str(found) if found else "unknown"


# Each engine's own way of naming its build: vLLM's /version, SGLang's /v1/loads, llama.cpp's /props.
VERSION_ROUTES = {"vllm": ("/version", lambda d: d["version"]), "sglang": ("/v1/loads", lambda d: d["version"]),
                  "llamacpp": ("/props", lambda d: d["build_info"])}


async def probed(title: str, cfg: GatewayConfig, urls: dict[str, str], timeout: float) -> list[str]:
    """One section: versions, how long the probe took, the matrix."""
    versions = [f"{engine} {await version(url, *VERSION_ROUTES[engine])}" for engine, url in urls.items()]
    started = time.monotonic()
    rows = await probe_all(cfg, timeout)
    took = time.monotonic() - started
    return [f"## {title}", "", f"Engines: {', '.join(versions)}. Probe took {took:.1f} s "
            f"(backends at once, {cfg.probe.concurrency} checks of a backend at a time; {timeout:g} s a check).", "",
            "```", *render(rows, cfg.probe.require), "```", ""]


async def simulators(timeout: float) -> list[str]:
    sims = {e: await start_sim(SimOptions(engine=e)) for e in ("vllm", "sglang", "llamacpp")}
    try:
        cfg = config([{"id": f"sim-{e}", "engine": e, "url": s.url, "models": {"sim-model": s.model}}
                      for e, s in sims.items()])
        return await probed("Simulator portfolio (`python -m gateway.sim`, tiny profiles)", cfg,
                            {e: s.url for e, s in sims.items()}, timeout)
    finally:
        for s in sims.values():
            await s.close()


async def started(start: Callable[[], Awaitable[Any]]) -> tuple[Any, str]:
    try:
        return await start(), ""
    except (RuntimeError, OSError, ImportError) as e:  # not buildable here: no cmake, no registry, no memory
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


async def real_engines(timeout: float) -> list[str]:
    title = "Real engines (tests/e2e: llama-server -c 4096 --parallel 2, vLLM CPU --max-model-len 4096)"
    llama, why_llama = await started(start_llama_server)
    vllm, why_vllm = await started(lambda: start_vllm_server(max_num_seqs=2))
    try:
        backends, urls, missing = [], {}, []
        for handle, engine, native, why in ((llama, "llamacpp", LLAMA_ALIAS, why_llama),
                                            (vllm, "vllm", VLLM_NAME, why_vllm)):
            if handle is None:
                missing.append(f"{engine} did not start: {why}")
                continue
            backends.append({"id": f"real-{engine}", "engine": engine, "url": handle.url,
                             "models": {"shapegate-tiny": native}})
            urls[engine] = handle.url
        if not backends:
            return [f"## {title}", "", *missing, ""]
        return [*await probed(title, config(backends), urls, timeout), *missing]
    finally:
        for handle in (llama, vllm):
            if handle is not None:
                await handle.close()


async def main_async(args: argparse.Namespace) -> str:
    load_before = os.getloadavg()
    sections = await simulators(args.timeout)
    if args.real:
        sections += await real_engines(args.timeout)
    load_after = os.getloadavg()
    load = "load average {:.2f} {:.2f} {:.2f}"
    head = [
        "# Support probe: what each engine serves", "",
        f"Commit {kit.commit()}, {kit.utc_date()}; {kit.host()}; {load.format(*load_before)} before, "
        f"{load.format(*load_after)} after.", "",
        f"Command: `{kit.command('benchmarks.probe')}`. Required checks: {', '.join(REQUIRE)}.", "",
        "Cells: `yes`; `no (S)` (the engine answered with HTTP status S, or answered without the API or feature); "
        "`error` (no answer, a timeout, a 5xx but 501, a reply that is not HTTP or JSON); `partial` (stored "
        "responses: GET served, DELETE not); `gateway` (the gateway serves it itself); the context column is the "
        "window verified (a prompt near its top served, one past it refused as too long). What each column asks: "
        "docs/apis.md. The real engines serve a tiny text model with random "
        "weights: a `no` for tools or json_schema there may be the model's, not the engine's (its reason says "
        "when a reply was cut at max_tokens).", "",
    ]
    return "\n".join(head + sections)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per check (default 60)")
    parser.add_argument("--no-real", dest="real", action="store_false", help="the simulators only")
    args = parser.parse_args()
    text = asyncio.run(main_async(args))
    RESULT.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
