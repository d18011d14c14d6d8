"""Shared mechanics of every engine adapter: body translation, the one network seam, probes and load scrapes."""

from __future__ import annotations

import time
from typing import Any, Awaitable, ClassVar, Mapping

import aiohttp
import orjson

from backends.http1 import HostPool
from backends.http1_response import Response
from backends.slots import Slots
from gateway.apis.api import FORM, Api
from gateway.apis.audio import FORM_KEY, forwarded_content_type
from gateway.apis.registry import ENGINE_APIS
from gateway.contracts import LoadSample, ProbeResult, UpstreamCall, UpstreamError

# Two HTTP clients reach an engine, each where it fits. Generations (clients', the warm-up's, the support probe's)
# go through forward(): HostPool (backends/http1.py), the lean llhttp client the request path is measured with,
# within [upstream]'s connection limits. Health probes, load scrapes and model-card reads go through _get(): the
# process's aiohttp session (gateway/app.py), a few calls a second off the request path, where the lean client
# would save nothing that shows, and on a few connections per backend of their own, so that a probe never waits
# for a slot behind client traffic (a busy but healthy engine would miss its probes and be marked down). Moving
# them to a HostPool of their own would change what each caller catches (aiohttp.ClientError in gateway/fleet/*
# and gateway/cli/check.py) for no gain on the path.

# A health answer, a /metrics page or a warm-up reply larger than this is an engine fault, not data.
PROBE_BODY_LIMIT = 16 * 1024 * 1024


def parse_gauges(text: str, wanted: Mapping[str, tuple[str, ...]]) -> dict[str, float]:
    """Sum each wanted metric over its label sets from Prometheus text; the first name present wins.

    Looks the wanted names up with str.find instead of splitting every line: an engine's /metrics
    is mostly histogram buckets the gateway never reads, and it is scraped several times a second.
    """
    text = "\n" + text
    out: dict[str, float] = {}
    for field, alternatives in wanted.items():
        for name in alternatives:
            total = _sum_samples(text, name)
            if total is not None:
                out[field] = total
                break
    return out


def _sum_samples(text: str, name: str) -> float | None:
    total = None
    for key in ("\n" + name + "{", "\n" + name + " "):
        i = text.find(key)
        while i >= 0:
            end = text.find("\n", i + 1)
            line = text[i + 1:end] if end >= 0 else text[i + 1:]
            rest = line[line.rindex("}") + 1:] if key[-1] == "{" and "}" in line else line[len(name):]
            try:
                value = float(rest.split()[0])  # a timestamp may follow the value
            except (ValueError, IndexError):
                value = None
            if value is not None:
                total = value if total is None else total + value
            i = text.find(key, i + 1)
    return total


# The engine's own latency figures a sample may carry (gateway.contracts.LoadSample), besides its load.
LATENCY_FIELDS = ("ttft_sum", "ttft_count", "itl_sum", "itl_count", "prompt_tps", "predicted_tps")


def load_from_gauges(g: Mapping[str, float], now: float, running: float | None = None,
                     idle_slots: int | None = None, total_slots: int | None = None) -> LoadSample:
    """A load sample from parsed gauges: load figures (`running` when the gauges have none), the engine's
    latency figures when it reports them."""
    latency = {f: g[f] for f in LATENCY_FIELDS if f in g and g[f] >= 0}
    return LoadSample(running=g.get("running", running), waiting=g.get("waiting"), kv_usage=g.get("kv_usage"),
                      idle_slots=idle_slots, total_slots=total_slots, at=now, **latency)


def printable(text: str, limit: int = 200) -> str:
    """Text an engine chose, safe for a log line or a terminal: control characters replaced, length capped."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def count(value: Any) -> int | None:
    """A positive integer an engine reported, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class OpenAIHTTPBackend:
    """An OpenAI-compatible HTTP engine. Subclasses change only the data below."""

    engine: ClassVar[str] = "openai"
    health_path: ClassVar[str] = "/v1/models"
    # A route that only says the process answers, for engines whose health route is expensive.
    liveness_path: ClassVar[str | None] = None
    metrics_path: ClassVar[str | None] = None
    # Common load field -> the engine's metric names, newest first.
    metric_names: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    # Its deep health probe runs a generation: probed less often and given longer ([health] sglang_* settings).
    deep_probe_generates: ClassVar[bool] = False
    # Engines that ignore max_completion_tokens get it as max_tokens.
    needs_max_tokens: ClassVar[bool] = False
    # Top-level fields of its replies (and stream chunks) that are the engine's own, not OpenAI's: the gateway
    # drops them unless [server] (or the backend's) engine_private_fields keeps them.
    private_fields: ClassVar[tuple[str, ...]] = ()
    # The API routes (the names of gateway/apis/registry.py's ENGINE_APIS) the engine serves. A route it answers
    # with a 404 for its path is learned as not served at run time too (gateway/fleet/pool.py), so a newer build that
    # serves more only needs its name here.
    apis: ClassVar[frozenset[str]] = ENGINE_APIS - {"messages", "count_tokens", "rerank", "score"}

    def __init__(self, *, id: str, url: str, session: aiohttp.ClientSession, api_key: str | None = None,
                 connect_timeout: float = 2.0, idle_timeout: float = 60.0, pool_limit: int = 512,
                 keepalive_s: float = 30.0, shared_limit: Slots | None = None) -> None:
        self.id = id
        self.url = url
        self._session = session  # probes and scrapes; requests go through the lean pool below
        self._pool: HostPool | None = None
        self._limit = pool_limit
        self._shared_limit = shared_limit  # [upstream] pool_limit: connections of every backend together
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._keepalive = keepalive_s
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # The key itself, scrubbed from anything of the engine's the gateway relays (an engine may echo it).
        self.secret = api_key.encode() if api_key else None

    # -- request translation -------------------------------------------------------------------
    def prepare(self, api: Api, body: dict[str, Any], raw: bytes, native_model: str, force_usage: bool) -> bytes:
        """The upstream body: the client's bytes unchanged unless a field must change."""
        if api.body == FORM:  # always re-encoded: the engine reads the form the gateway read (gateway/apis/audio.py)
            return body[FORM_KEY].encode(native_model)
        changes: dict[str, Any] = {}
        if native_model != body.get("model") and "model" in body:
            changes["model"] = native_model
        if force_usage and body.get("stream") is True and api.usage_on_request:
            opts = body.get("stream_options")
            if not (isinstance(opts, dict) and opts.get("include_usage") is True):
                changes["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
        if self.needs_max_tokens and api.name == "chat" and "max_completion_tokens" in body \
                and "max_tokens" not in body:
            changes["max_tokens"] = body["max_completion_tokens"]
        if not changes:
            return raw
        return orjson.dumps({**body, **changes})

    def headers(self, client_headers: Mapping[str, str]) -> dict[str, str]:
        # (a form's own Content-Type, with its boundary, comes as "Content-Type" in client_headers and wins, written
        # as the gateway read it: the boundary its form is re-encoded with, no other parameter)
        h = {"Content-Type": "application/json", **client_headers}
        form_type = client_headers.get("Content-Type")
        if form_type is not None:
            h["Content-Type"] = forwarded_content_type(form_type)
        if self._auth:
            h.update(self._auth)
        return h

    # -- the network seam ----------------------------------------------------------------------
    def forward(self, call: UpstreamCall, timeout: float) -> Awaitable[Response]:
        """Send one call; awaited, returns once the status line and headers arrived (within `timeout`). It hands
        back the pool's own awaitable rather than being a coroutine: a request's every step skips one frame."""
        pool = self._pool
        if pool is None:
            pool = self._pool = HostPool(self.url, self._limit, self._connect_timeout, self._keepalive,
                                         self._idle_timeout, shared=self._shared_limit)
        return pool.request(call.method, call.path, self.headers(call.headers), call.body, timeout)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    async def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        """A probe or load scrape: the body is read up to PROBE_BODY_LIMIT (a larger one is an error)."""
        t = aiohttp.ClientTimeout(total=timeout)
        async with self._session.get(self.url + path, headers=self._auth, timeout=t) as resp:
            parts, total = [], 0
            async for chunk in resp.content.iter_any():
                total += len(chunk)
                if total > PROBE_BODY_LIMIT:
                    raise aiohttp.ClientPayloadError(f"{path} answered with more than {PROBE_BODY_LIMIT} bytes")
                parts.append(chunk)
            return resp.status, b"".join(parts)

    # -- health and load -----------------------------------------------------------------------
    async def probe(self, timeout: float, deep: bool = True) -> ProbeResult:
        """The engine's health route, or with deep=False its cheap liveness route when it has one."""
        liveness_path = None if deep else self.liveness_path
        liveness = liveness_path is not None
        path = liveness_path if liveness_path is not None else self.health_path
        try:
            status, body = await self._get(path, timeout)
        except aiohttp.ClientConnectorError as e:
            return ProbeResult(False, 0, f"connect failed: {e.os_error or e}", refused=True, liveness_only=liveness)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            return ProbeResult(False, 0, f"{type(e).__name__}", liveness_only=liveness)
        return ProbeResult(status == 200, status, self.health_detail(status, body), liveness_only=liveness)

    def health_detail(self, status: int, body: bytes) -> str:
        if status == 200:
            return "ok"
        try:
            data = orjson.loads(body)
            err = data.get("error", data) if isinstance(data, dict) else {}
            message = err.get("message", "") if isinstance(err, dict) else err
            return printable(str(message)) or f"HTTP {status}"
        except orjson.JSONDecodeError:
            return f"HTTP {status}"

    async def _get_field(self, path: str, field: str, timeout: float) -> Any:
        """One top-level field of a JSON object a GET route answers with, or None."""
        status, body = await self._get(path, timeout)
        if status != 200:
            return None
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return data.get(field) if isinstance(data, dict) else None

    async def context_window(self, model: str, timeout: float) -> int | None:
        """Tokens one request may hold, as the engine says it (the model card's max_model_len), or None."""
        data = await self._get_field("/v1/models", "data", timeout)
        cards = [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []
        card = next((c for c in cards if c.get("id") == model), cards[0] if len(cards) == 1 else None)
        return count(card.get("max_model_len") if card is not None else None)

    async def sample_load(self, timeout: float) -> LoadSample | None:
        if not self.metrics_path:
            return None
        status, body = await self._get(self.metrics_path, timeout)
        if status != 200:
            return None
        return load_from_gauges(parse_gauges(body.decode("utf-8", "replace"), self.metric_names), time.monotonic())

    async def warm_up(self, model: str, timeout: float) -> bool:
        """One tiny generation so the engine's first slow request is not a client's."""
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 1, "temperature": 0})
        try:
            reply = await self.forward(UpstreamCall("/v1/chat/completions", body, {}, False), timeout)
            try:
                await reply.read(PROBE_BODY_LIMIT)
            finally:
                reply.close()
            return reply.status == 200
        except (aiohttp.ClientError, UpstreamError, TimeoutError, ValueError):
            return False
