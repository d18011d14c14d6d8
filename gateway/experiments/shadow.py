"""Shadow traffic: a copy of a client's request to a candidate arm, off the client's path, within a budget."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from gateway.apis.api import Api, StreamRules
from gateway.config import GatewayConfig, UpstreamConfig
from gateway.contracts import (ENGINE_ERROR, Outcome, Policy, RequestShape, RouteInput, UpstreamCall,
                               UpstreamReply)
from gateway.errors import GatewayError, upstream_failed, upstream_timeout
from gateway.http.headers import forwarded_headers
from gateway.experiments.experiment import PRIMARY, Arm, Experiment
from gateway.experiments.outputs import output_of
from gateway.routing.attempt import ERROR_EVENT_STARTS, first_event_error, measured, request_at_fault, stream_status
from gateway.routing.failover import TRANSPORT_ERRORS
from gateway.routing.relay import EventTooLarge, ModelRewrite, SSERelay, StreamMeter, usage_of
from gateway.routing.request import RequestState
from gateway.routing.typed_relay import TypedRelay
from gateway.routing.typed_relay import first_event_error as typed_first_error

if TYPE_CHECKING:
    from gateway.fleet.pool import BackendState, Pool
    from gateway.observe.metrics import Metrics

log = logging.getLogger("shapegate.shadow")
MAX_TAP_BYTES = 1 << 20  # the primary's reply kept for comparing outputs; a longer one is not compared


def copyable(api: Api, body: dict[str, Any]) -> bool:
    """Whether a copy of this request means the same to a candidate engine. Not a request that still names state
    only one engine keeps (a stored response, a conversation: with the state kept by the gateway the request is
    expanded already and names none), nor one run in the background."""
    return api.shadow and body.get("previous_response_id") is None and body.get("conversation") is None \
        and body.get("background") is not True


class Host(Protocol):
    """What a shadow copy needs of the gateway that sends it (gateway/runtime.py's Gateway)."""

    @property
    def cfg(self) -> GatewayConfig: ...

    @property
    def pool(self) -> Pool: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def shadow_tasks(self) -> set[asyncio.Task[None]]:
        """The copies in flight: cancelled at shutdown."""

    def policy_for(self, model: str) -> Policy: ...


class Tap:
    """The primary's reply bytes for a shadowed request at temperature 0, and the moment it ended."""

    __slots__ = ("chunks", "size", "full", "done")

    def __init__(self, keep: bool) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.full = not keep  # nothing is kept of a reply that will not be compared
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def add(self, data: bytes) -> None:
        if not self.full:
            self.size += len(data)
            if self.size > MAX_TAP_BYTES:
                self.full, self.chunks = True, []
            else:
                self.chunks.append(data)

    def close(self, primary: Outcome | None) -> None:
        """The client's request ended, `primary` its last attempt: the copy's comparison may start."""
        if not self.done.done():
            self.done.set_result(primary)


def deterministic(body: dict[str, Any]) -> bool:
    """Greedy decoding of one choice: the only case where two engines are expected to say the same."""
    t = body.get("temperature")
    n = body.get("n")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and t == 0 and n in (None, 1)


def launch(g: Host, x: Experiment, arm: Arm, st: RequestState, shape: RequestShape, body: dict,
           raw: bytes) -> Tap | None:
    """Send a copy of this request to `arm` when the experiment samples it and the arm has room; never waits.

    Returns the tap the primary's reply goes into (for the comparison and the primary's figures), or None
    when no copy went out. A skipped copy is counted with the reason."""
    if not x.enabled or random.random() >= x.fraction:
        return None
    budget = x.cfg.shadow_max_in_flight
    if x.shadow_in_flight[arm.name] >= budget:
        return _skip(g, x, arm, "skipped_busy")
    now = time.monotonic()
    # The pool's own test of which backends may take this request now (ready, breaker, class, probe).
    ready = [b for b in g.pool.candidates(shape.model, shape.klass, now) if b.id in arm.backends]
    if not ready:
        return _skip(g, x, arm, "skipped_unhealthy")
    free = [b for b in ready if not _saturated(b, now)]
    if not free:
        return _skip(g, x, arm, "skipped_busy")
    decision = g.policy_for(shape.model).rank(RouteInput(shape, tuple(b.view(now) for b in free), None, now, 0))
    b = g.pool.get(decision.ranked[0].id) if decision.ranked else None
    if b is None:
        return _skip(g, x, arm, "skipped_unhealthy")
    tap = Tap(keep=deterministic(body))
    x.shadow_in_flight[arm.name] += 1
    b.in_flight += 1  # the engine's load is real, whoever asked
    x.count_shadow(arm.name, "sent")
    g.metrics.shadow(x.name, arm.name, "sent")
    task = asyncio.create_task(_copy(g, x, arm, b, st, shape, body, raw, tap), name=f"shadow-{x.name}")
    g.shadow_tasks.add(task)
    task.add_done_callback(g.shadow_tasks.discard)
    return tap


def _skip(g: Host, x: Experiment, arm: Arm, why: str) -> Tap | None:
    """No copy: counted with the reason."""
    x.count_shadow(arm.name, why)
    g.metrics.shadow(x.name, arm.name, why)
    return None


def _saturated(b, now: float) -> bool:
    """The engine already queues requests: a copy would only add to the queue (and to its clients' waits)."""
    load = b.fresh_load(now)
    return load is not None and load.waiting > 0


async def _copy(g: Host, x: Experiment, arm: Arm, b: BackendState, st: RequestState, shape: RequestShape,
                body: dict, raw: bytes, tap: Tap) -> None:
    cfg = g.cfg
    api = st.api
    fwd = forwarded_headers(st.ex.headers, api.passed_headers)
    fwd["x-request-id"] = f"{st.request_id}.shadow"
    fwd["x-shapegate-shadow"] = x.name
    data = b""  # the copy's reply, compared with the primary's
    try:
        if api.state and body.get("store") is not False:
            # Stored, the copy's response would sit on the candidate under an id no client ever learns.
            body = {**body, "store": False}
            raw = orjson.dumps(body)
        upstream_body = b.adapter.prepare(api, body, raw, b.models[shape.model], shape.stream)
        call = UpstreamCall(api.upstream, upstream_body, fwd, shape.stream)
        o, data = await _measure(b, call, shape, cfg.upstream, api.stream)
    except asyncio.CancelledError:
        tap.full = True  # shutting down: nothing to compare
        raise
    except Exception as e:  # a shadow copy must never take anything else down; say what, not the data
        log.warning("shadow copy to %s failed: %s", b.id, type(e).__name__)
        o = Outcome(backend=b.id, shape=shape, ok=False, status=502, result=ENGINE_ERROR)
    finally:
        b.in_flight -= 1
        x.shadow_in_flight[arm.name] -= 1
    x.count_shadow(arm.name, o.result)
    g.metrics.shadow(x.name, arm.name, o.result)
    x.record(arm.name, shape.klass, o)
    g.metrics.experiment(x.name, arm.name, shape.klass, o)
    try:
        async with asyncio.timeout(cfg.routing.retry_deadline_s + cfg.upstream.first_byte_timeout_s + 600):
            primary = await tap.done  # resolved when the client's request ends, however it ends
    except TimeoutError:
        return
    if primary is None:
        return
    x.record(PRIMARY, shape.klass, primary)
    g.metrics.experiment(x.name, PRIMARY, shape.klass, primary)
    if o.ok and primary.ok and not tap.full and deterministic(body):
        p_text, p_tokens = output_of(b"".join(tap.chunks), shape.stream, api)
        text, tokens = output_of(data, shape.stream, api)
        x.agreement[arm.name].add(p_text, text, p_tokens, tokens)
        g.metrics.agreement(x.name, arm.name, p_text == text)


async def _measure(b: BackendState, call: UpstreamCall, shape: RequestShape, up: UpstreamConfig,
                   typed: StreamRules | None) -> tuple[Outcome, bytes]:
    """One timed call, measured as a client's attempt is (gateway/routing/attempt.py): the candidate's TTFT, ITL
    and e2e, and the reply's bytes for the comparison of outputs."""
    t0 = time.perf_counter()
    first_by = asyncio.get_running_loop().time() + up.first_byte_timeout_s if shape.stream else 0.0
    reply = await b.adapter.forward(call, up.first_byte_timeout_s)
    status, served, answered, data = reply.status, False, False, b""
    meter: StreamMeter | None = None
    usage: dict | None = None
    try:
        if status >= 400:
            await reply.read(up.max_error_bytes, truncate=True)
            answered = request_at_fault(status)
        elif not shape.stream:
            data = await reply.read(up.max_reply_bytes)
            served = bool(data) or status == 204  # a success with nothing in it answers nothing
            if served:
                usage = usage_of(data)
            else:
                status = 502
        else:
            first = await reply.next_chunk(first_by)
            if first is None or reply.broken:
                status = 502
            elif (err := _opening_error(first, typed)) is not None:  # an engine that validates after opening it
                status = err.status
                answered = status < 500
            else:
                meter = StreamMeter()
                data = await _relay(reply, first, meter, shape.model, up.max_reply_bytes, typed)
                usage = meter.usage
                status = stream_status(meter)
                served = status == 200
    finally:
        reply.close()
    return measured(b.id, shape, t0, status, served, answered, False, meter, usage), data


def _opening_error(first: bytes, typed: StreamRules | None) -> GatewayError | None:
    """The error event a stream opens with, read as the client's request reads it (gateway/pipeline.py)."""
    if typed is not None:
        return typed_first_error(first)
    if first.startswith(ERROR_EVENT_STARTS):
        return first_event_error(first) or upstream_failed("the engine began its stream with a malformed error event")
    return None


class _Unsent:
    """Where a copy's relayed stream goes: nowhere (the relay only measures it)."""

    writable = False

    async def write(self, data: bytes) -> None:
        pass

    async def write_eof(self, data: bytes = b"") -> None:
        pass


async def _relay(reply: UpstreamReply, first: bytes, meter: StreamMeter, model: str, limit: int,
                 typed: StreamRules | None) -> bytes:
    """A copy's stream through the relay a client's goes through, for its meter; the bytes as the engine sent them."""
    relay = SSERelay(_Unsent(), meter, strip_usage=False, rename=ModelRewrite(model)) if typed is None else \
        TypedRelay(_Unsent(), meter, typed, ModelRewrite(model))
    chunks: list[bytes] = []
    size = 0
    chunk: bytes | None = first
    try:
        while chunk is not None:
            size += len(chunk)
            if size > limit:
                raise ValueError("shadow reply over the reply limit")
            chunks.append(chunk)
            await relay.feed(chunk)
            try:
                chunk = await reply.next_chunk()
            except TRANSPORT_ERRORS as e:
                await relay.fail(upstream_timeout("the engine stalled mid-stream") if isinstance(e, TimeoutError)
                                 else upstream_failed("the engine stopped mid-stream"))
                return b"".join(chunks)
    except EventTooLarge as e:
        await relay.fail(upstream_failed(str(e)))
        return b"".join(chunks)
    await relay.finish()
    return b"".join(chunks)
