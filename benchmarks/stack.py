"""A gateway and simulated engines in child processes of a benchmark, and the client that streams through them timing
each request, as GenAI-Perf does (the routing, routing_real and ab benchmarks)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import orjson
import uvloop

from benchmarks.routing_workload import MODEL


# -- the processes -------------------------------------------------------------------------------
def serve_sims(ports: list[int], engines: list[tuple[str, str]]) -> None:
    """Simulated engines, (engine, profile) each, serving MODEL on `ports` until SIGTERM (a child process's target)."""
    uvloop.run(_sims(ports, engines))


async def _sims(ports: list[int], engines: list[tuple[str, str]]) -> None:
    from gateway.sim.runner import SimOptions, start_sim

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    servers = [await start_sim(SimOptions(engine=engine, profile=profile, model=MODEL, port=port,
                                          report_cached_tokens=True))
               for (engine, profile), port in zip(engines, ports)]
    await stop.wait()
    for s in servers:
        await s.close()


def serve_gateway(cfg: dict, port: int) -> None:
    """A gateway of this tree with the config `cfg` on `port` until SIGTERM (a child process's target)."""
    from gateway.cli.main import serve_until_signal
    from gateway.config import parse_config
    from gateway.runtime import build_policy

    uvloop.run(serve_until_signal(parse_config(cfg, build_policy), "127.0.0.1", port))


def stop_children(procs: list) -> None:
    """SIGTERM to each child process still alive; one still alive 10 s later is killed."""
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def stack_config(backends: list[dict], **sections: dict | list) -> dict:
    """The config of a gateway run in process in front of engines that stay up: no access log, a short grace,
    probes every half second; each section given is merged into these (a list, as experiments, set)."""
    cfg: dict = {"server": {"access_log": False, "shutdown_grace_s": 1.0},
                 "health": {"interval_s": 0.5, "load_interval_s": 0.5}, "backends": backends}
    for name, value in sections.items():
        cfg[name] = {**cfg.get(name, {}), **value} if isinstance(value, dict) else value
    return cfg


async def wait_ready(http: aiohttp.ClientSession, url: str, what: str, timeout: float = 60.0) -> None:
    """Until the gateway at `url` is ready with every backend ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with http.get(url + "/readyz") as r:
                data = await r.json()
                if r.status == 200 and all(s == "ready" for s in data["backends"].values()):
                    return
        except (aiohttp.ClientError, ValueError, KeyError):
            pass  # not up yet
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{what} did not become ready")


# -- the client ----------------------------------------------------------------------------------
async def record_request(http: aiohttp.ClientSession, url: str, body: dict, headers: dict, rec: dict) -> str:
    """stream_request, with the time of a request cut at the drain cap (censored) or failed kept in `rec` too."""
    start = time.perf_counter()
    try:
        return await stream_request(http, url, body, headers, rec)
    except asyncio.CancelledError:
        rec.update(censored=True, e2e=time.perf_counter() - start)
        raise
    except (aiohttp.ClientError, ValueError) as e:
        rec.update(error=repr(e), e2e=time.perf_counter() - start)
        return ""


async def stream_request(http: aiohttp.ClientSession, url: str, body: dict, headers: dict, rec: dict) -> str:
    """Send one streamed chat request; fill `rec` with GenAI-Perf TTFT, ITL and e2e; return the text."""
    text: list[str] = []
    t0 = time.perf_counter()
    first = last = None
    events = 0
    usage_tokens = 0
    async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                         headers={"Content-Type": "application/json", **headers}) as r:
        rec["backend"] = r.headers.get("x-shapegate-backend", "")
        rec["reason"] = r.headers.get("x-shapegate-reason", "")
        rec["status"] = r.status
        if r.status != 200:
            await r.read()
            return ""
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            obj = orjson.loads(line[6:])
            if obj.get("usage"):
                usage_tokens = obj["usage"].get("completion_tokens") or 0
            for ch in obj.get("choices") or ():
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    events += 1
                    text.append(piece)
    end = time.perf_counter()
    n = usage_tokens or events
    rec.update(ok=first is not None, e2e=end - t0, ttft=(first - t0) if first is not None else None,
               itl=((last - first) / (n - 1)) if first is not None and n > 1 else None, tokens=n)
    return "".join(text)
