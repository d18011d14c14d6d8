"""In-process API: start a simulated engine on loopback and get its URL (tests, benchmarks, the demo)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from aiohttp import web

from gateway.sim.app import build_app
from gateway.sim.faults import FaultSpec
from gateway.sim.options import SimOptions
from gateway.sim.state import SIM, SimState

__all__ = ["SimOptions", "SimServer", "start_sim", "FaultSpec"]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class SimServer:
    """A running simulated engine."""

    def __init__(self, opts: SimOptions, runner: web.AppRunner, port: int) -> None:
        self.opts = opts
        self.port = port
        self.engine = opts.engine
        self.model = opts.model
        self.url = f"http://{opts.host}:{port}"
        self._runner = runner
        self._bind_task: asyncio.Task[None] | None = None

    @property
    def state(self) -> SimState:
        """The engine's live state (scheduler, telemetry, faults) for in-process inspection."""
        return self._runner.app[SIM]

    def set_faults(self, **changes: Any) -> FaultSpec:
        return self.state.faults.update(changes)

    def reset_faults(self) -> FaultSpec:
        return self.state.faults.reset()

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Until the engine serves (after its warm-up; for vLLM, once the port accepts).

        Raises the OSError of a late bind that failed (port taken meanwhile).
        """
        async with asyncio.timeout(timeout):
            if self._bind_task is not None:
                await asyncio.shield(self._bind_task)
            await self.state.ready.wait()

    async def close(self) -> None:
        task = self._bind_task
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass  # the cancellation we asked for
            except OSError:
                pass  # a failed late bind: already raised to whoever waited for readiness
        await self._runner.cleanup()

    async def _bind_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        site = web.TCPSite(self._runner, self.opts.host, self.port)
        await site.start()
        self.state.ready.set()


async def start_sim(opts: SimOptions) -> SimServer:
    """Start one simulated engine and return as soon as it is reachable the engine's way.

    vLLM-flavoured engines with a warm-up do not accept connections until it ends (the port is
    chosen now and bound later); SGLang and llama.cpp bind at once and report "starting" /
    "Loading model" through their health routes during the warm-up.
    """
    opts.resolve_profile()  # fail fast on a bad engine/profile combination
    bind_later = opts.engine == "vllm" and opts.warmup_s > 0
    app = build_app(opts, bind_later=bind_later)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        if bind_later:
            server = SimServer(opts, runner, opts.port or _free_port(opts.host))
            server._bind_task = asyncio.get_running_loop().create_task(
                server._bind_after(opts.warmup_s))
            return server
        site = web.TCPSite(runner, opts.host, opts.port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = runner.addresses[0][1]
    return SimServer(opts, runner, port)
