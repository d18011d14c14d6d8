"""Fixtures of the simulator tests: engines on loopback, an HTTP session and official SDK clients."""

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


@pytest.fixture
async def sdk() -> AsyncIterator[Callable[..., Any]]:
    """Official SDK clients bound to a simulated engine (`sdk("openai", server)`), closed after the test.

    No retries, so that every error shows; no kept-alive connections, like the `http` fixture.
    """
    try:
        import httpx2 as httpx  # what the installed SDKs are built on
    except ImportError:
        import httpx  # type: ignore[no-redef]

    clients: list[Any] = []

    def make(kind: str, server: SimServer) -> Any:
        limits = httpx.Limits(max_keepalive_connections=0)
        if kind == "openai":
            import openai
            client: Any = openai.AsyncOpenAI(
                base_url=server.url + "/v1", api_key="sim-key", max_retries=0,
                http_client=openai.DefaultAsyncHttpxClient(limits=limits))
        else:
            import anthropic
            client = anthropic.AsyncAnthropic(
                base_url=server.url, api_key="sim-key", max_retries=0,
                http_client=anthropic.DefaultAsyncHttpxClient(limits=limits))
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()
