"""How one upstream attempt failed: whether the next candidate may take the request, and what the engine is charged."""

from __future__ import annotations

import email.utils
import math
import time
from typing import TYPE_CHECKING, Final, Mapping

import aiohttp

from gateway.config import HealthConfig
from gateway.contracts import UpstreamConnectError, UpstreamError
from gateway.errors import MAX_RETRY_AFTER_S, GatewayError, retry_after_header, upstream_failed, upstream_timeout
from gateway.fleet.served import fix, refuses_model

if TYPE_CHECKING:
    from gateway.fleet.pool import BackendState

# Nothing listens: the process is down or not up yet. The breaker opens at once.
CONNECT_ERRORS: Final = (aiohttp.ClientConnectorError, UpstreamConnectError)
# Anything else that goes wrong on the wire to an engine: resets, closes, timeouts.
TRANSPORT_ERRORS: Final = (aiohttp.ClientError, UpstreamError, OSError, TimeoutError)


class Retryable(Exception):
    """A failure before anything reached the client: the next candidate may take the request.

    `suspect` marks an engine's plain HTTP 500: it may be the request's fault rather than the
    engine's, so it is charged to the engine only once another engine has served the same request.
    """

    def __init__(self, error: GatewayError, suspect: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.suspect = suspect


def retry_after_s(headers: Mapping[str, str], default: float, now: float | None = None) -> float:
    """An engine's Retry-After (seconds or an HTTP date), capped at 120 s; `default` when absent or unreadable."""
    v = headers.get("Retry-After") or headers.get("retry-after")
    if v is None:
        return default
    try:
        s = float(v)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(v)
        except (TypeError, ValueError):
            return default
        s = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(s):
        return default
    return min(max(s, 0.0), MAX_RETRY_AFTER_S)


def hung_hold(b: BackendState, started: float, open_s: float) -> float | None:
    """A first-byte timeout on an engine where no request sent since this one has produced anything.

    `b.last_output` is the start time of the latest-started request that got a first byte. Older
    streams still flowing do not count: an engine that finishes old work but answers nothing new
    is stuck for every new request, so its breaker opens at once (None: an ordinary failure,
    counted towards the threshold).
    """
    return open_s if b.last_output < started else None


# -- every verdict on an engine's breaker is given here ---------------------------------------------------
def begin(b: BackendState, started: float) -> None:
    """An attempt starts: a half-open breaker lets this one through as its trial."""
    b.breaker.on_attempt(started)


def charge(b: BackendState) -> None:
    """The engine failed this request (broke, stalled, sent something it must not): one failure."""
    b.breaker.on_failure(time.monotonic())


def charge_timeout(b: BackendState, started: float, health: HealthConfig) -> None:
    """No first byte in time: an engine that answered nothing sent since is stuck, and its breaker opens at once."""
    b.breaker.on_failure(time.monotonic(), hold_s=hung_hold(b, started, health.breaker_open_s))


def settle(b: BackendState, started: float, answered: bool) -> None:
    """The attempt is over. Answered properly (even with the request's own fault): a success. Otherwise no
    verdict (the client left, a 500 still under judgement): a half-open trial is freed for another."""
    if answered:
        b.breaker.on_success(started)
    else:
        b.breaker.release()


def charge_send_error(b: BackendState, e: BaseException, started: float, health: HealthConfig) -> Retryable:
    """Charge a failure to send the request or get its response head, and say what the client would see."""
    now = time.monotonic()
    if isinstance(e, CONNECT_ERRORS):
        # Nothing listens (process down or restarting): keep traffic away until probes say otherwise.
        b.breaker.on_failure(now, hold_s=health.breaker_open_s)
        return Retryable(upstream_failed("could not connect to the engine"))
    if isinstance(e, TimeoutError):
        b.breaker.on_failure(now, hold_s=hung_hold(b, started, health.breaker_open_s))
        return Retryable(upstream_timeout("no response in time"))
    b.breaker.on_failure(now)
    return Retryable(upstream_failed("connection lost before the response"))


def charge_engine_error(b: BackendState, err: GatewayError, headers: Mapping[str, str],
                        health: HealthConfig, model: str) -> Retryable | None:
    """An engine's HTTP error for a request for `model`: the Retryable to move on with, or None when it is the
    request's own fault."""
    charge = charge_status(err.status)
    if charge == "client":
        return model_refused(b, err, model)
    if charge == "hold":
        hold = retry_after_s(headers, health.overload_hold_s)
        b.breaker.on_failure(time.monotonic(), hold_s=hold)
        err.headers["Retry-After"] = retry_after_header(hold)
    elif charge == "failure":
        b.breaker.on_failure(time.monotonic())
    return Retryable(err, suspect=charge == "suspect")


def model_refused(b: BackendState, err: GatewayError, model: str) -> Retryable | None:
    """An engine refusing the name the gateway sent for `model` (its model_not_found, in each engine's words) is
    the backend's misconfiguration, never the client's fault: the next candidate takes the request, and the model
    is routed there no more until the engine's model list changes (no breaker verdict: the engine is sound).
    None for any other refusal. The Retryable's error is what the client gets if no backend serves the model."""
    native = b.models.get(model)
    if native is None or not refuses_model(err.status, err.code, err.message, native):
        return None
    b.refused_model(model, f"HTTP {err.status}: {err.message}")
    return Retryable(GatewayError(
        404, f"The model `{model}` is configured on backend {b.id}, but its engine does not serve it (a gateway "
        f"misconfiguration: {fix(b.engine, model, native)}).", param="model", code="model_not_found"))


def charge_status(status: int) -> str:
    """What an engine's HTTP error status means for that engine.

    hold     429/503: the engine says it is overloaded; keep traffic away for its Retry-After
    suspect  500: could be the engine or the request; decided by whether another engine serves it
    failure  other 5xx (502, 504, ...): the engine or something in front of it is failing
    client   4xx and 501: the request itself; never retried, never counted against the engine
    """
    if status in (429, 503):
        return "hold"
    if status == 500:
        return "suspect"
    if status >= 500 and status != 501:
        return "failure"
    return "client"
