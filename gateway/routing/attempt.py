"""One upstream attempt measured the one way, wherever it is made (a client's request, a shadow copy of it)."""

from __future__ import annotations

from time import perf_counter
from typing import Any, Final

import orjson

from gateway.contracts import CLIENT_ERROR, CLIENT_LEFT, ENGINE_ERROR, OK, Outcome, RequestShape
from gateway.errors import GatewayError, error_from_event
from gateway.routing.failover import charge_status
from gateway.routing.relay import StreamMeter

# What a token is, and when a stream began and ended, is the relay's StreamMeter (gateway/routing/relay.py: an
# event with output, by is_token_event): a stream measured anywhere goes through an SSERelay. What follows is the
# rest of the rule: how an attempt ended, and the Outcome the stats, the policies and experiments learn from.

# The start of a stream that an engine opened before validating the request (SGLang): an ordinary HTTP error.
ERROR_EVENT_STARTS: Final = (b'data: {"error"', b'data:{"error"')


def first_event_error(first: bytes) -> GatewayError | None:
    """The error a stream's first event carries, or None when that event is not readable JSON."""
    try:
        payload = orjson.loads(first.split(b"\n\n", 1)[0][5:])
    except orjson.JSONDecodeError:
        return None
    return error_from_event(payload) if isinstance(payload, dict) else None


def request_at_fault(status: int) -> bool:
    """An engine's HTTP error that is the request's own (4xx but 429, and 501): the engine answered properly."""
    return charge_status(status) == "client"


def stream_status(meter: StreamMeter) -> int:
    """A relayed stream's status: 200 when it served its request (no error event, no stall, no early end)."""
    return 200 if meter.error is None else meter.error.status


def result_of(served: bool, answered: bool, left: bool) -> str:
    """How an attempt ended: served; answered properly with the request at fault; the client gone first; else the
    engine's failure."""
    return OK if served else CLIENT_ERROR if answered else CLIENT_LEFT if left else ENGINE_ERROR


def measured(backend: str, shape: RequestShape, t0: float, status: int, served: bool, answered: bool, left: bool,
             meter: StreamMeter | None, usage: dict | None, running_at_start: int = 0) -> Outcome:
    """The Outcome of an attempt sent at `t0` (perf_counter) and over now: times from the stream's meter, token
    counts from the engine's usage when it reported them (else the request's estimate, and the tokens seen)."""
    u: dict[str, Any] = usage or {}
    return Outcome(
        backend=backend, shape=shape, ok=served, status=status,
        ttft=(meter.t_first - t0) if meter is not None and meter.t_first is not None else None,
        itl=itl(meter, usage),
        e2e=perf_counter() - t0,
        prompt_tokens=int(u.get("prompt_tokens") or shape.prompt_tokens),
        completion_tokens=int(u.get("completion_tokens") or (meter.token_events if meter is not None else 0)),
        cached_tokens=cached(usage), running_at_start=running_at_start,
        result=result_of(served, answered, left))


def cached(usage: dict | None) -> int:
    details = (usage or {}).get("prompt_tokens_details")
    return int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0


def itl(meter: StreamMeter | None, usage: dict | None) -> float | None:
    """GenAI-Perf ITL: (last token - first token) / (output tokens - 1), tokens from usage when the engine says."""
    if meter is None or meter.t_first is None or meter.t_last is None:
        return None
    n = int((usage or {}).get("completion_tokens") or meter.token_events)
    return (meter.t_last - meter.t_first) / (n - 1) if n > 1 else None
