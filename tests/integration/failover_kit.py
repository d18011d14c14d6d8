"""Shared pieces of the failover tests: backends on simulated engines, a streaming client that checks endings."""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiohttp
import orjson

from gateway.config import CLASS_NAMES
from gateway.sim.runner import SimOptions, start_sim
from tests.gateway_harness import ADMIN_KEY, USER_KEY

MSG = [{"role": "user", "content": "hello there"}]
AUTH = {"Authorization": f"Bearer {USER_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def every_class(seconds: float) -> dict[str, float]:
    return {c: seconds for c in CLASS_NAMES}


def backend(id: str, engine: str, url: str, models: dict[str, str] | None = None, **kw) -> dict:
    return {"id": id, "engine": engine, "url": url, "models": models or {"m": "sim-model"}, **kw}


async def sim(engine: str = "vllm", **opts):
    return await start_sim(SimOptions(engine=engine, **opts))


@dataclass
class Reply:
    status: int
    backend: str
    reason: str
    body: bytes
    retry_after: str | None
    elapsed: float

    @property
    def ending(self) -> str:
        """How a stream ended for the client: finish, error (event + [DONE]) or truncated (must never happen)."""
        return stream_ending(self.body)

    def error(self) -> dict:
        return orjson.loads(self.body)["error"]


def stream_ending(raw: bytes) -> str:
    if not raw.endswith(b"data: [DONE]\n\n"):
        return "truncated"
    if b'data: {"error"' in raw:
        return "error"
    return "finish" if b'"finish_reason":"' in raw or b'"finish_reason": "' in raw else "truncated"


async def ask(s: aiohttp.ClientSession, gw_url: str, model: str = "m", stream: bool = True, max_tokens: int = 8,
              timeout: float = 20.0) -> Reply:
    body = {"model": model, "messages": MSG, "stream": stream, "max_tokens": max_tokens}
    t0 = time.monotonic()
    async with s.post(gw_url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        raw = await r.read()
        return Reply(r.status, r.headers.get("x-shapegate-backend", ""), r.headers.get("x-shapegate-reason", ""),
                     raw, r.headers.get("Retry-After"), time.monotonic() - t0)


async def first_content(resp: aiohttp.ClientResponse) -> bytes:
    """Read a stream until the first token arrived; returns what was read."""
    got = b""
    async for chunk in resp.content.iter_any():
        got += chunk
        if b'"content":"' in got.replace(b'"content":""', b""):
            return got
    return got
