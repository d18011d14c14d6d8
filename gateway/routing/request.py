"""One client request as the pipeline carries it (RequestState) and the server side it answers through (Exchange).

A leaf: what features decide (rate limits, experiments, shadow copies, the key's holder) is typed here by the few
members the pipeline and the request's end use, so that the state imports none of them; each feature returns its
decision and the pipeline stores it."""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from gateway.apis.api import Api
from gateway.contracts import Outcome, RequestShape


class Exchange(Protocol):
    """One client request as the server that received it hands it over, and the way back to the client.

    The gateway's HTTP/1.1 front implements it (gateway/http/exchange.py); the pipeline needs nothing more of a
    server, so a test or another server can drive it the same way. Header names are looked up in lower case.
    """

    @property
    def headers(self) -> Mapping[str, str]:
        """The request's headers, names in lower case."""

    @property
    def method(self) -> str: ...

    @property
    def target(self) -> str:
        """The request target as sent: path and query string."""

    async def read(self) -> bytes:
        """The whole body; raises a GatewayError (413, 408) when it is too large or too slow to come."""

    def reply(self, status: int, headers: dict[str, str], body: bytes, lines: str = "") -> Reply:
        """A whole response; the returned Reply is the handler's result. `lines`: more headers, rendered already
        as reply-head lines."""

    async def open_stream(self, headers: dict[str, str], lines: str = "") -> EventStream:
        """Start a 200 event stream (its head goes out with the first write)."""


class Reply(Protocol):
    """A reply under way or sent: its status is the request's."""

    @property
    def status(self) -> int: ...


class EventStream(Reply, Protocol):
    """The sink of a 200 event stream (gateway/routing/relay.py writes the engine's events to it)."""

    @property
    def writable(self) -> bool:
        """Whether a write goes out now with nothing to wait for: the client is there and keeps up."""

    def write_now(self, data: bytes, last: bool = False) -> None:
        """A write from a callback, when `writable` (last: the stream's end)."""

    async def write(self, data: bytes) -> None:
        """Write, then wait while the client reads slower than the engine writes."""

    async def write_eof(self, data: bytes = b"") -> None:
        """The last write; a second call does nothing."""


class Caller(Protocol):
    """Who sent a request, as its API key says (gateway/keys): what the pipeline and the features read of it."""

    @property
    def id(self) -> str: ...

    @property
    def admin(self) -> bool: ...

    @property
    def owner(self) -> str:
        """Whose stored state the key reaches (its identity, not only its id)."""


class Held(Protocol):
    """What a request took from its key's rate limits (gateway/limits/limiter.py's Reservation)."""

    def headers(self) -> dict[str, str]:
        """The x-ratelimit headers an error reply after it carries."""

    def settle(self, o: Outcome | None) -> None:
        """At the request's end: its tokens charged from the usage its last attempt reported."""


class ExperimentRef(Protocol):
    """An experiment a request takes part in (gateway/experiments/experiment.py), as its attempts and end read it."""

    @property
    def name(self) -> str: ...

    def arm_of(self, backend_id: str) -> str | None: ...

    def record(self, arm: str, klass: str, o: Outcome) -> None: ...


class ArmRef(Protocol):
    """One arm of an experiment (gateway/experiments/experiment.py's Arm)."""

    @property
    def name(self) -> str: ...


class Tap(Protocol):
    """Where the reply goes when a shadow copy of the request went out (gateway/experiments/shadow.py)."""

    def add(self, data: bytes) -> None:
        """A piece of the reply the client got."""

    def close(self, primary: Outcome | None) -> None:
        """The request ended, with this last attempt (None: no backend was tried): the comparison may start."""


class Turn(Protocol):
    """A Responses request whose state the gateway keeps (gateway/state/turns.py), as its attempts use it."""

    async def finish_reply(self, data: bytes) -> bytes:
        """A whole reply's Response, recorded; the bytes the client gets."""


class KeptBy(Protocol):
    """A Responses request whose state the engines keep (gateway/state/engine_index.py), as its attempts use it."""

    def after_reply(self, data: bytes, backend: str, method: str) -> None:
        """A whole reply from `backend`: which engine now keeps what (or no longer)."""

    def watcher(self, backend: str) -> Any:
        """What follows a stream from `backend` (a Watcher of gateway/routing/typed_relay.py), or None."""


class RequestState:
    """Everything one client request gathers on its way through the pipeline: where it came from and who sent
    it, its body and shape, where it went and why, and how its last attempt ended."""

    __slots__ = ("request_id", "ex", "api", "route", "principal", "t_in", "raw", "body", "shape", "backend", "reason",
                 "outcome", "split", "shadow", "tap", "limit", "limit_lines", "turn", "kept_by", "session")

    def __init__(self, request_id: str, ex: Exchange, api: Api) -> None:
        self.request_id = request_id
        self.ex = ex
        self.api = api  # the route (gateway/apis/): what the request's body, stream and errors are
        self.route = api.name
        self.principal: Caller | None = None  # set once the API key is checked
        self.t_in = 0.0  # perf_counter when the pipeline took the request
        self.raw = b""  # the body as the client sent it
        self.body: dict[str, Any] = {}  # ...parsed once
        self.shape: RequestShape | None = None
        self.backend = ""
        self.reason = ""
        self.outcome: Outcome | None = None  # the last attempt's
        self.split: ExperimentRef | None = None  # the split experiment whose arms serve this request
        self.shadow: tuple[ExperimentRef, ArmRef] | None = None  # the shadow experiment and arm a copy may go to
        self.tap: Tap | None = None  # where the reply goes when a copy went out
        self.limit: Held | None = None  # what it took from its key's rate limits
        self.limit_lines = ""  # ...and the x-ratelimit header lines its replies carry
        self.turn: Any = None  # a Turn: its state kept by the gateway (a Responses request that stores or continues)
        self.kept_by: KeptBy | None = None  # its state kept by the engines ([responses] state = "engine")
        self.session: str | None = None  # a session the state gave it (a chain's or a conversation's first id)
