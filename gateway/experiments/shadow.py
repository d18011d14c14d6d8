"""Shadow traffic: a copy of a client's request to a candidate arm, off the client's path, within a budget."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Any

import orjson

from gateway.config import GatewayConfig
from gateway.contracts import (CLIENT_ERROR, ENGINE_ERROR, OK, PATHS, Outcome, RequestShape, RouteInput,
                               UpstreamCall)
from gateway.experiments.experiment import PRIMARY, Arm, Experiment
from gateway.routing.relay import usage_of
from gateway.routing.request import RequestState

if TYPE_CHECKING:
    from gateway.fleet.pool import BackendState
    from gateway.runtime import Gateway

log = logging.getLogger("shapegate.shadow")
MAX_TAP_BYTES = 1 << 20  # the primary's reply kept for comparing outputs; a longer one is not compared


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


def deterministic(body: dict[str, Any]) -> bool:
    """Greedy decoding of one choice: the only case where two engines are expected to say the same."""
    t = body.get("temperature")
    n = body.get("n")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and t == 0 and n in (None, 1)


def launch(g: Gateway, x: Experiment, arm: Arm, st: RequestState, shape: RequestShape, body: dict,
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


def _skip(g: Gateway, x: Experiment, arm: Arm, why: str) -> Tap | None:
    """No copy: counted with the reason."""
    x.count_shadow(arm.name, why)
    g.metrics.shadow(x.name, arm.name, why)
    return None


def _saturated(b, now: float) -> bool:
    """The engine already queues requests: a copy would only add to the queue (and to its clients' waits)."""
    load = b.fresh_load(now)
    return load is not None and load.waiting > 0


async def _copy(g: Gateway, x: Experiment, arm: Arm, b: BackendState, st: RequestState, shape: RequestShape,
                body: dict, raw: bytes, tap: Tap) -> None:
    cfg = g.cfg
    fwd = {"x-request-id": f"{st.request_id}.shadow", "x-shapegate-shadow": x.name}
    o = None
    text, tokens = "", None
    try:
        upstream_body = b.adapter.prepare(shape.route, body, raw, b.models[shape.model], shape.stream)
        call = UpstreamCall(PATHS[shape.route], upstream_body, fwd, shape.stream)
        o, text, tokens = await _measure(b, call, shape, cfg)
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
        p_text, p_tokens = _output(b"".join(tap.chunks), shape.stream)
        x.agreement[arm.name].add(p_text, text, p_tokens, tokens)
        g.metrics.agreement(x.name, arm.name, p_text == text)


async def _measure(b: BackendState, call: UpstreamCall, shape: RequestShape,
                   cfg: GatewayConfig) -> tuple[Outcome, str, list[str] | None]:
    """One timed call: the candidate's TTFT, ITL and e2e as the gateway measures a served request's."""
    t0 = time.perf_counter()
    reply = await b.adapter.forward(call, cfg.upstream.first_byte_timeout_s)
    try:
        if reply.status >= 400:
            await reply.read(cfg.upstream.max_error_bytes, truncate=True)
            result = ENGINE_ERROR if reply.status >= 500 or reply.status == 429 else CLIENT_ERROR
            return Outcome(b.id, shape, False, reply.status, e2e=time.perf_counter() - t0, result=result), "", None
        if not shape.stream:
            data = await reply.read(cfg.upstream.max_reply_bytes)
            e2e = time.perf_counter() - t0
            text, _ = _output(data, False)
            usage = usage_of(data) or {}
            return Outcome(b.id, shape, True, 200, e2e=e2e, prompt_tokens=usage.get("prompt_tokens", 0),
                           completion_tokens=usage.get("completion_tokens", 0)), text, None
        chunks, size, t_first, t_last, first_bytes = [], 0, None, None, True
        async for chunk in reply.iter_chunks():
            now = time.perf_counter()
            if first_bytes:
                t_first, first_bytes = now, False
            if b'"content"' in chunk or b'"text"' in chunk:
                t_last = now
            size += len(chunk)
            if size > cfg.upstream.max_reply_bytes:
                raise ValueError("shadow reply over the reply limit")
            chunks.append(chunk)
        e2e = time.perf_counter() - t0
        data = b"".join(chunks)
        text, tokens = _output(data, True)
        usage = usage_of(data) or {}
        n = usage.get("completion_tokens") or len(tokens or ())
        itl = (t_last - t_first) / (n - 1) if t_first is not None and t_last is not None and n > 1 else None
        # Served: output began and no error event came (llama.cpp may end a stream without [DONE]).
        ok = t_first is not None and b'data: {"error"' not in data and b'data:{"error"' not in data
        return Outcome(b.id, shape, ok, 200 if ok else 502, ttft=(t_first - t0) if t_first else None, itl=itl,
                       e2e=e2e, prompt_tokens=usage.get("prompt_tokens", 0), completion_tokens=n,
                       result=OK if ok else ENGINE_ERROR), text, tokens
    finally:
        reply.close()



def _output(data: bytes, stream: bool) -> tuple[str, list[str] | None]:
    """The first choice's text, and for a stream its pieces (one per event: a token each on the engines)."""
    if not stream:
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            return "", None
        return _choice_text(doc, "message"), None
    pieces = []
    for event in data.split(b"\n\n"):
        line = event.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        piece = _choice_text(doc, "delta")
        if piece:
            pieces.append(piece)
    return "".join(pieces), pieces


def _choice_text(doc: Any, key: str) -> str:
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list):
        return ""
    for c in choices:
        if isinstance(c, dict) and c.get("index", 0) == 0:
            m = c.get(key)
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                return m["content"]
            return c["text"] if isinstance(c.get("text"), str) else ""
    return ""
