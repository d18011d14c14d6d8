"""Protocols and immutable records shared by the gateway, policies/ and backends/ (imports nothing of ours)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, ClassVar, Final, Mapping, Protocol

# Request classes: which latency matters most for a request.
LONG_OUTPUT: Final = "long_output"
LONG_PROMPT: Final = "long_prompt"
INTERACTIVE: Final = "interactive"
DEFAULT: Final = "default"
CLASSES: Final = (LONG_OUTPUT, LONG_PROMPT, INTERACTIVE, DEFAULT)

# The engine path of each public route.
# Health states of a backend.
STARTING: Final = "starting"
READY: Final = "ready"
UNHEALTHY: Final = "unhealthy"
DRAINING: Final = "draining"


class Record:
    """Base of the records made for every request: fixed fields, read-only (Final), a readable repr.

    Plain classes, not NamedTuples or dataclasses: compiled (deploy/compile.py) each is a C struct, built in a few
    hundred instructions and read field by field at the cost of a pointer (a NamedTuple's Python __new__ costs
    several thousand a record, a frozen dataclass's __init__ more). Compared by identity, as they are used.
    """

    __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in self.FIELDS)})"


class RequestShape(Record):
    """What the gateway knows about a request before routing it."""

    FIELDS = ("model", "route", "stream", "prompt_tokens", "output_tokens", "klass", "principal", "session_id",
              "prefix_hashes", "max_output", "fit_tokens")
    __slots__ = FIELDS
    model: Final[str]
    route: Final[str]  # "chat" | "completions" | "embeddings"
    stream: Final[bool]
    prompt_tokens: Final[int]  # estimate, no tokenizer
    output_tokens: Final[int]  # max_tokens, or a learned expectation
    klass: Final[str]
    principal: Final[str]
    session_id: Final[str | None]
    prefix_hashes: Final[tuple[int, ...]]  # chained block hashes of the prompt, in order
    max_output: Final[int | None]  # the output cap the client asked for, if any
    # What must fit the context window: the prompt itself, except where the engine runs the input in parts (rerank
    # and score: one query-document pair at a time, the largest counts)
    fit_tokens: Final[int]

    def __init__(self, model: str, route: str, stream: bool, prompt_tokens: int, output_tokens: int, klass: str,
                 principal: str = "anonymous", session_id: str | None = None, prefix_hashes: tuple[int, ...] = (),
                 max_output: int | None = None, fit_tokens: int | None = None) -> None:
        self.model = model
        self.route = route
        self.stream = stream
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.klass = klass
        self.principal = principal
        self.session_id = session_id
        self.prefix_hashes = prefix_hashes
        self.max_output = max_output
        self.fit_tokens = prompt_tokens if fit_tokens is None else fit_tokens


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


class BackendView(Record):
    """A snapshot of one candidate backend, taken for one routing decision."""

    FIELDS = ("id", "engine", "in_flight", "latency", "load", "classes", "interactive", "weight")
    __slots__ = FIELDS
    id: Final[str]
    engine: Final[str]
    in_flight: Final[int]
    latency: Final[LatencyEstimate]
    load: Final[LoadSample | None]  # None when stale or never scraped
    classes: Final[frozenset[str] | None]  # None: takes every class
    interactive: Final[bool]
    weight: Final[float]

    def __init__(self, id: str, engine: str, in_flight: int, latency: LatencyEstimate, load: LoadSample | None = None,
                 classes: frozenset[str] | None = None, interactive: bool = False, weight: float = 1.0) -> None:
        self.id = id
        self.engine = engine
        self.in_flight = in_flight
        self.latency = latency
        self.load = load
        self.classes = classes
        self.interactive = interactive
        self.weight = weight


class RouteInput(Record):
    FIELDS = ("shape", "candidates", "affinity", "now", "affinity_tokens")
    __slots__ = FIELDS
    shape: Final[RequestShape]
    candidates: Final[tuple[BackendView, ...]]
    affinity: Final[str | None]  # backend id that last served this session or prefix
    now: Final[float]
    affinity_tokens: Final[int]  # prompt tokens that backend likely still holds in its prefix cache

    def __init__(self, shape: RequestShape, candidates: tuple[BackendView, ...], affinity: str | None = None,
                 now: float = 0.0, affinity_tokens: int = 0) -> None:
        self.shape = shape
        self.candidates = candidates
        self.affinity = affinity
        self.now = now
        self.affinity_tokens = affinity_tokens

    def with_candidates(self, candidates: tuple[BackendView, ...]) -> RouteInput:
        return RouteInput(self.shape, candidates, self.affinity, self.now, self.affinity_tokens)


class Decision(Record):
    """A policy's answer: candidates best first, and why the first one won."""

    FIELDS = ("ranked", "reason")
    __slots__ = FIELDS
    ranked: Final[tuple[BackendView, ...]]
    reason: Final[str]

    def __init__(self, ranked: tuple[BackendView, ...], reason: str) -> None:
        self.ranked = ranked
        self.reason = reason


# How one attempt on a backend ended, for every figure an operator reads: served; the client went away; the
# request itself was at fault (a 4xx it caused); the engine failed (5xx, reset, timeout, mid-stream failure).
# A request refused before any backend was tried is REJECTED (admission, no backend, rate limits).
OK: Final = "ok"
CLIENT_LEFT: Final = "client_left"
CLIENT_ERROR: Final = "client_error"
ENGINE_ERROR: Final = "engine_error"
REJECTED: Final = "rejected"
RESULTS: Final = (OK, CLIENT_LEFT, CLIENT_ERROR, ENGINE_ERROR, REJECTED)


class Outcome(Record):
    """What happened to one request on one backend, fed back to policies and stats."""

    FIELDS = ("backend", "shape", "ok", "status", "ttft", "itl", "e2e", "prompt_tokens", "completion_tokens",
              "cached_tokens", "running_at_start", "result")
    __slots__ = FIELDS
    backend: Final[str]
    shape: Final[RequestShape]
    ok: Final[bool]
    status: Final[int]
    ttft: Final[float | None]
    itl: Final[float | None]
    e2e: Final[float]
    prompt_tokens: Final[int]
    completion_tokens: Final[int]
    cached_tokens: Final[int]
    running_at_start: Final[int]
    result: Final[str]  # one of RESULTS but REJECTED

    def __init__(self, backend: str, shape: RequestShape, ok: bool, status: int, ttft: float | None = None,
                 itl: float | None = None, e2e: float = 0.0, prompt_tokens: int = 0, completion_tokens: int = 0,
                 cached_tokens: int = 0, running_at_start: int = 0, result: str = OK) -> None:
        self.backend = backend
        self.shape = shape
        self.ok = ok
        self.status = status
        self.ttft = ttft
        self.itl = itl
        self.e2e = e2e
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.cached_tokens = cached_tokens
        self.running_at_start = running_at_start
        self.result = result


class Policy(Protocol):
    """Ranks candidates for one request: pure and synchronous (no I/O)."""

    name: str

    def rank(self, inp: RouteInput) -> Decision: ...


class UpstreamCall(Record):
    """One HTTP call to a backend: the body is already in the engine's dialect."""

    FIELDS = ("path", "body", "headers", "stream", "method")
    __slots__ = FIELDS
    path: Final[str]
    body: Final[bytes]
    headers: Final[Mapping[str, str]]
    stream: Final[bool]
    method: Final[str]

    def __init__(self, path: str, body: bytes, headers: Mapping[str, str], stream: bool,
                 method: str = "POST") -> None:
        self.path = path
        self.body = body
        self.headers = headers
        self.stream = stream
        self.method = method


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
