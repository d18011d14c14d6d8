"""Fixtures of the simulator tests: engines on loopback and an HTTP session."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from gateway.sim.runner import SimOptions, SimServer, start_sim

StartSim = Callable[..., Awaitable[SimServer]]


@pytest.fixture
async def sim() -> AsyncIterator[StartSim]:
    """Start simulated engines (`await sim("vllm", profile=...)`); all are closed after the test."""
    servers: list[SimServer] = []

    async def start(engine: str, **kwargs: Any) -> SimServer:
        server = await start_sim(SimOptions(engine=engine, **kwargs))
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # A fresh connection per request: llama-server (and so its flavour) closes the connection after
    # a streamed reply, and a pooled connection reused at once would fail on its next write.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session
