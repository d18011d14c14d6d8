"""One client request as the pipeline carries it (RequestState), the server side it answers through (Exchange),
and the app key the gateway is found under: what the pipeline, the runtime and the servers share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol

from aiohttp import web

from gateway.keys.auth import Principal
from gateway.contracts import Outcome, RequestShape

if TYPE_CHECKING:
    from gateway.experiments.experiment import Arm, Experiment
    from gateway.limits.limiter import Reservation
    from gateway.runtime import Gateway
    from gateway.experiments.shadow import Tap

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway")


class Exchange(Protocol):
    """One client request as the server that received it hands it over, and the way back to the client.

    The gateway's HTTP/1.1 front implements it (gateway/http/exchange.py); the pipeline needs nothing more of a
    server, so a test or another server can drive it the same way. Header names are looked up in lower case.
    """

    @property
    def headers(self) -> Mapping[str, str]:
        """The request's headers, names in lower case."""

    async def read(self) -> bytes:
        """The whole body; raises a GatewayError (413, 408) when it is too large or too slow to come."""

    def reply(self, status: int, headers: dict[str, str], body: bytes, lines: str = "") -> Any:
        """A whole response; the returned object (with .status) is the handler's result. `lines`: more headers,
        rendered already as reply-head lines."""

    async def open_stream(self, headers: dict[str, str], lines: str = "") -> Any:
        """Start a 200 event stream: the returned sink has write(data), write_eof(data) and .status, and for a
        callback's writes `writable` and write_now(data, last)."""


class RequestState:
    """Everything one client request gathers on its way through the pipeline: where it came from and who sent
    it, its body and shape, where it went and why, and how its last attempt ended."""

    __slots__ = ("request_id", "ex", "route", "principal", "t_in", "raw", "body", "shape", "backend", "reason",
                 "outcome", "split", "shadow", "tap", "limit", "limit_lines")

    def __init__(self, request_id: str, ex: Exchange, route: str) -> None:
        self.request_id = request_id
        self.ex = ex
        self.route = route  # "chat" | "completions" | "embeddings"
        self.principal: Principal | None = None  # set once the API key is checked
        self.t_in = 0.0  # perf_counter when the pipeline took the request
        self.raw = b""  # the body as the client sent it
        self.body: dict[str, Any] = {}  # ...parsed once
        self.shape: RequestShape | None = None
        self.backend = ""
        self.reason = ""
        self.outcome: Outcome | None = None  # the last attempt's
        self.split: Experiment | None = None  # the split experiment whose arms serve this request
        self.shadow: tuple[Experiment, Arm] | None = None  # the shadow experiment and arm a copy may go to
        self.tap: Tap | None = None  # where the reply goes when a copy went out (gateway/experiments/shadow.py)
        self.limit: Reservation | None = None  # what it took from its key's rate limits (gateway/limits/limiter.py)
        self.limit_lines = ""  # ...and the x-ratelimit header lines its replies carry
