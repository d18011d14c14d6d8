"""Protocols and immutable records shared by the gateway, policies/ and backends/ (imports nothing of ours)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, NamedTuple, Protocol

# Request classes: which latency matters most for a request.
LONG_OUTPUT = "long_output"
LONG_PROMPT = "long_prompt"
INTERACTIVE = "interactive"
DEFAULT = "default"
CLASSES = (LONG_OUTPUT, LONG_PROMPT, INTERACTIVE, DEFAULT)

# The engine path of each public route.
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}

# Health states of a backend.
STARTING = "starting"
READY = "ready"
UNHEALTHY = "unhealthy"
DRAINING = "draining"


# Records made for every request are NamedTuples: immutable like the frozen dataclasses below, and
# built at well under half their cost (a frozen dataclass sets each field through object.__setattr__).
class RequestShape(NamedTuple):
    """What the gateway knows about a request before routing it."""

    model: str
    route: str  # "chat" | "completions" | "embeddings"
    stream: bool
    prompt_tokens: int  # estimate, no tokenizer
    output_tokens: int  # max_tokens, or a learned expectation
    klass: str
    principal: str = "anonymous"
    session_id: str | None = None
    prefix_hashes: tuple[int, ...] = ()  # chained block hashes of the prompt, in order
    max_output: int | None = None  # the output cap the client asked for, if any


@dataclass(frozen=True, slots=True)
class LatencyEstimate:
    """A backend's fitted latency model, as policies see it (seconds)."""

    ttft_t0: float  # fixed part of TTFT
    prefill_rate: float  # uncached prompt tokens per second
    itl_a: float  # ITL with one running stream
    itl_b: float  # extra ITL per additional running stream
    samples: int  # how many measured requests taught it (after forgetting: stale models count fewer)
    ttft_per_running: float = 0.0  # extra TTFT per request already running on the engine
    service_s: float = 0.0  # mean time a request occupies the engine (turns a queue length into a wait)

    def ttft(self, prompt_tokens: float, wait: float = 0.0, running: float = 0.0) -> float:
        return wait + self.ttft_t0 + prompt_tokens / self.prefill_rate + self.ttft_per_running * running

    def itl(self, running: float) -> float:
        return self.itl_a + self.itl_b * max(running - 1.0, 0.0)


@dataclass(frozen=True, slots=True)
class LoadSample:
    """Engine load read from its own routes, mapped to common fields (None: engine does not say)."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    idle_slots: int | None = None
    total_slots: int | None = None
    at: float = 0.0  # monotonic time the sample was taken
    # The engine's own latency figures: running totals of its TTFT and inter-token histograms (vLLM, SGLang),
    # or its recent prompt and generation throughput (llama.cpp).
    ttft_sum: float | None = None
    ttft_count: float | None = None
    itl_sum: float | None = None
    itl_count: float | None = None
    prompt_tps: float | None = None
    predicted_tps: float | None = None


class BackendView(NamedTuple):
    """A snapshot of one candidate backend, taken for one routing decision."""

    id: str
    engine: str
    in_flight: int
    latency: LatencyEstimate
    load: LoadSample | None = None  # None when stale or never scraped
    classes: frozenset[str] | None = None  # None: takes every class
    interactive: bool = False
    weight: float = 1.0


class RouteInput(NamedTuple):
    shape: RequestShape
    candidates: tuple[BackendView, ...]
    affinity: str | None = None  # backend id that last served this session or prefix
    now: float = 0.0
    affinity_tokens: int = 0  # prompt tokens that backend likely still holds in its prefix cache


class Decision(NamedTuple):
    """A policy's answer: candidates best first, and why the first one won."""

    ranked: tuple[BackendView, ...]
    reason: str


# How one attempt on a backend ended, for every figure an operator reads: served; the client went away; the
# request itself was at fault (a 4xx it caused); the engine failed (5xx, reset, timeout, mid-stream failure).
# A request refused before any backend was tried is REJECTED (admission, no backend, rate limits).
OK, CLIENT_LEFT, CLIENT_ERROR, ENGINE_ERROR, REJECTED = "ok", "client_left", "client_error", "engine_error", "rejected"
RESULTS = (OK, CLIENT_LEFT, CLIENT_ERROR, ENGINE_ERROR, REJECTED)


class Outcome(NamedTuple):
    """What happened to one request on one backend, fed back to policies and stats."""

    backend: str
    shape: RequestShape
    ok: bool
    status: int
    ttft: float | None = None
    itl: float | None = None
    e2e: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    running_at_start: int = 0
    result: str = OK  # one of RESULTS but REJECTED


class Policy(Protocol):
    """Ranks candidates for one request: pure and synchronous (no I/O)."""

    name: str

    def rank(self, inp: RouteInput) -> Decision: ...


class UpstreamCall(NamedTuple):
    """One HTTP call to a backend: the body is already in the engine's dialect."""

    path: str
    body: bytes
    headers: Mapping[str, str]
    stream: bool


class UpstreamReply(Protocol):
    """A backend's answer as it arrives: status and headers first, then the body."""

    status: int
    headers: Mapping[str, str]

    def iter_chunks(self) -> AsyncIterator[bytes]: ...

    async def next_chunk(self, by: float = 0.0) -> bytes | None:
        """The next piece of the body as it arrived, None at its end (iter_chunks without an async generator);
        TimeoutError when none came in the idle timeout, or by `by` (loop time) when that is sooner."""

    def hand_to(self, sink: Callable[[bytes], bool] | None) -> None:
        """Offer later pieces of the body to `sink` as they arrive, before next_chunk sees them (True: taken)."""

    async def read(self, limit: int, *, truncate: bool = False) -> bytes:
        """The whole body up to `limit` bytes: past it ReplyTooLarge, or with truncate=True its first `limit`."""

    @property
    def broken(self) -> bool:
        """The reply has already failed (what was read of it so far may still be waiting to be taken)."""

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One active health probe: ok, or the engine's way of saying not yet / not now."""

    ok: bool
    status: int  # HTTP status, 0 when the connection failed
    detail: str = ""
    refused: bool = False  # connection refused: not up yet (vLLM/SGLang while loading)
    liveness_only: bool = False  # a cheap "process answers" check (SGLang /ping): never proof of readiness


class Backend(Protocol):
    """An engine adapter: engine differences as data, one network seam."""

    id: str
    engine: str

    def prepare(self, route: str, body: dict[str, Any], raw: bytes, native_model: str,
                force_usage: bool) -> bytes: ...

    def forward(self, call: UpstreamCall, timeout: float) -> Awaitable[UpstreamReply]: ...  # (a coroutine will do)

    async def probe(self, timeout: float, deep: bool = True) -> ProbeResult: ...

    async def sample_load(self, timeout: float) -> LoadSample | None: ...


class UpstreamError(Exception):
    """A transport failure talking to a backend (no HTTP status to relay)."""


class UpstreamConnectError(UpstreamError):
    """The backend could not be reached: refused, unreachable, or the connect timed out."""


class UpstreamDisconnected(UpstreamError):
    """The backend closed or reset the connection before the response was complete."""


class UpstreamProtocolError(UpstreamError):
    """The backend's reply broke HTTP/1.1 framing or a limit: the connection is dropped, never reused."""


class ReplyTooLarge(UpstreamError):
    """A reply body (or one event of a stream) larger than the gateway buffers."""
