"""Shared mechanics of every engine adapter: body translation, the one network seam, probes and load scrapes."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, ClassVar, Mapping

import aiohttp
import orjson

from gateway.contracts import LoadSample, ProbeResult, UpstreamCall

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host",
                         "server", "date", "content-encoding"})


class AiohttpReply:
    """An upstream response being received; closing it mid-body drops the connection so the engine aborts."""

    __slots__ = ("_resp", "status", "headers")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers = resp.headers

    def iter_chunks(self) -> AsyncIterator[bytes]:
        return self._resp.content.iter_any()

    async def read(self) -> bytes:
        return await self._resp.read()

    def close(self) -> None:
        self._resp.close()


def parse_gauges(text: str, wanted: Mapping[str, tuple[str, ...]]) -> dict[str, float]:
    """Sum each wanted metric over its label sets from Prometheus text; the first name present wins."""
    by_name: dict[str, float] = {}
    names = {n for alternatives in wanted.values() for n in alternatives}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = line.find("{")
        if end < 0:
            end = line.find(" ")
        name = line[:end]
        if name in names:
            try:
                value = float(line.rsplit(" ", 1)[-1] if "}" not in line else line[line.rindex("}") + 1:].split()[0])
            except (ValueError, IndexError):
                continue
            by_name[name] = by_name.get(name, 0.0) + value
    out = {}
    for field, alternatives in wanted.items():
        for n in alternatives:
            if n in by_name:
                out[field] = by_name[n]
                break
    return out


class OpenAIHTTPBackend:
    """An OpenAI-compatible HTTP engine. Subclasses change only the data below."""

    engine: ClassVar[str] = "openai"
    health_path: ClassVar[str] = "/v1/models"
    metrics_path: ClassVar[str | None] = None
    # Common load field -> the engine's metric names, newest first.
    metric_names: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    # Engines that ignore max_completion_tokens get it as max_tokens.
    needs_max_tokens: ClassVar[bool] = False
    # Engines that end a stream without [DONE] after an in-band error.
    done_after_error: ClassVar[bool] = True

    def __init__(self, *, id: str, url: str, session: aiohttp.ClientSession, api_key: str | None = None,
                 connect_timeout: float = 2.0, idle_timeout: float = 60.0) -> None:
        self.id = id
        self.url = url
        self._session = session
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=idle_timeout)

    # -- request translation -------------------------------------------------------------------
    def prepare(self, route: str, body: dict[str, Any], raw: bytes, native_model: str, force_usage: bool) -> bytes:
        """The upstream body: the client's bytes unchanged unless a field must change."""
        changes: dict[str, Any] = {}
        if native_model != body.get("model"):
            changes["model"] = native_model
        if force_usage and body.get("stream") is True and route != "embeddings":
            opts = body.get("stream_options")
            if not (isinstance(opts, dict) and opts.get("include_usage") is True):
                changes["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
        if self.needs_max_tokens and "max_completion_tokens" in body and "max_tokens" not in body:
            changes["max_tokens"] = body["max_completion_tokens"]
        if not changes:
            return raw
        return orjson.dumps({**body, **changes})

    def headers(self, client_headers: Mapping[str, str]) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        h.update(client_headers)
        h.update(self._auth)
        return h

    # -- the network seam ----------------------------------------------------------------------
    async def forward(self, call: UpstreamCall, timeout: float) -> AiohttpReply:
        """Send one call; returns once the status line and headers arrived (within `timeout`)."""
        async with asyncio.timeout(timeout):
            resp = await self._session.post(self.url + call.path, data=call.body,
                                            headers=self.headers(call.headers), timeout=self._timeout)
        return AiohttpReply(resp)

    async def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        t = aiohttp.ClientTimeout(total=timeout)
        async with self._session.get(self.url + path, headers=self._auth, timeout=t) as resp:
            return resp.status, await resp.read()

    # -- health and load -----------------------------------------------------------------------
    async def probe(self, timeout: float) -> ProbeResult:
        try:
            status, body = await self._get(self.health_path, timeout)
        except aiohttp.ClientConnectorError as e:
            return ProbeResult(False, 0, f"connect failed: {e.os_error or e}", refused=True)
        except (aiohttp.ClientError, TimeoutError) as e:
            return ProbeResult(False, 0, f"{type(e).__name__}")
        return ProbeResult(status == 200, status, self.health_detail(status, body))

    def health_detail(self, status: int, body: bytes) -> str:
        if status == 200:
            return "ok"
        try:
            data = orjson.loads(body)
            err = data.get("error", data) if isinstance(data, dict) else {}
            return str(err.get("message", "")) or f"HTTP {status}"
        except orjson.JSONDecodeError:
            return f"HTTP {status}"

    async def sample_load(self, timeout: float) -> LoadSample | None:
        if not self.metrics_path:
            return None
        status, body = await self._get(self.metrics_path, timeout)
        if status != 200:
            return None
        g = parse_gauges(body.decode("utf-8", "replace"), self.metric_names)
        return LoadSample(running=g.get("running"), waiting=g.get("waiting"), kv_usage=g.get("kv_usage"),
                          at=time.monotonic())

    async def warm_up(self, model: str, timeout: float) -> bool:
        """One tiny generation so the engine's first slow request is not a client's."""
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 1, "temperature": 0})
        try:
            reply = await self.forward(UpstreamCall("/v1/chat/completions", body, {}, False), timeout)
            try:
                await reply.read()
            finally:
                reply.close()
            return reply.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


def response_headers(upstream: Mapping[str, str]) -> dict[str, str]:
    """Upstream headers the client may see (no hop-by-hop, nothing naming the engine host)."""
    return {k: v for k, v in upstream.items() if k.lower() not in _HOP_BY_HOP}
