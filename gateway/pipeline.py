"""A request's whole path: parse, classify, pick candidates, rank, dispatch with failover, relay, record."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from gateway.contracts import Outcome, RequestShape, RouteInput, UpstreamCall
from gateway.errors import (GatewayError, bad_request, error_from_event, model_not_found, no_backend, normalize_engine_error,
                            upstream_failed, upstream_timeout)
from gateway.relay import SSERelay, StreamMeter, model_rewriter, rewrite
from gateway.shape import classify

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}
FORWARDED_HEADERS = ("x-request-id", "traceparent", "tracestate")
GATEWAY: web.AppKey = web.AppKey("gateway")
REQUEST_ID = web.RequestKey("request_id", str)
PRINCIPAL = web.RequestKey("principal", object)
BACKEND = web.RequestKey("backend", str)
REASON = web.RequestKey("reason", str)
SHAPE = web.RequestKey("shape", RequestShape)
REQUIRED = {"chat": "messages", "completions": "prompt", "embeddings": "input"}


def parse_body(raw: bytes, route: str) -> dict[str, Any]:
    """Parse once with orjson and check only what routing needs; everything else passes through."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"The request body is not valid JSON: {e}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("you must provide a model parameter", param="model", code="missing_required_parameter")
    field = REQUIRED[route]
    if field not in body:
        raise bad_request(f"Missing required parameter: '{field}'.", param=field, code="missing_required_parameter")
    if route == "chat" and (not isinstance(body["messages"], list) or not body["messages"]):
        raise bad_request("'messages' must be a non-empty array.", param="messages", code="invalid_type")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream", code="invalid_type")
    if "stream_options" in body and stream is not True and body["stream_options"] is not None:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    return body


async def handle(request: web.Request, route: str) -> web.StreamResponse:
    """The request path, one call per stage."""
    g = request.app[GATEWAY]
    t_in = time.perf_counter()
    principal = request[PRINCIPAL]
    raw = await request.read()
    body = parse_body(raw, route)
    shape = classify(route=route, body=body, headers=request.headers, principal=principal.id, cfg=g.cfg.shape,
                     learned_output=g.estimator.expected(principal.id, body["model"]),
                     session_in_flight=g.session_load(request.headers, body),
                     want_prefix=g.wants_prefix)
    if not g.pool.serves(shape.model):
        raise model_not_found(shape.model)
    now = time.monotonic()
    candidates = g.pool.candidates(shape.model, shape.klass, now)
    if not candidates:
        raise no_backend(shape.model)
    policy = g.policy_for(shape.model)
    affinity = g.affinity.lookup(shape) if g.affinity is not None else None
    decision = policy.rank(RouteInput(shape, tuple(b.view(now) for b in candidates), affinity, now))
    request[SHAPE] = shape
    request[REASON] = decision.reason
    return await dispatch(request, g, shape, body, raw, decision, t_in)


async def dispatch(request, g, shape: RequestShape, body, raw, decision, t_in: float) -> web.StreamResponse:
    """Try the ranked backends in turn; a failure before the first byte moves on, after it never does."""
    cfg = g.cfg
    fwd = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
    fwd["x-request-id"] = request[REQUEST_ID]
    deadline = time.monotonic() + cfg.routing.retry_deadline_s
    last_error: GatewayError | None = None
    tried = 0
    for view in decision.ranked:
        if tried >= cfg.routing.max_attempts or time.monotonic() >= deadline:
            break
        b = g.pool.get(view.id)
        if b is None or not b.usable(time.monotonic()):
            continue
        tried += 1
        native = b.models[shape.model]
        call = UpstreamCall(PATHS[shape.route], b.adapter.prepare(shape.route, body, raw, native, shape.stream),
                            fwd, shape.stream)
        request[BACKEND] = b.id
        if tried > 1:
            request[REASON] = f"{decision.reason}; failover after {last_error.code if last_error else 'error'}"
        try:
            return await attempt(request, g, b, shape, body, call, native, t_in)
        except Retryable as r:
            last_error = r.error
            g.metrics.retry(b.id)
    if last_error is not None:
        raise last_error
    raise no_backend(shape.model)


class Retryable(Exception):
    """A failure before anything reached the client: the next candidate may take the request."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


async def attempt(request, g, b, shape: RequestShape, body, call: UpstreamCall, native: str,
                  t_in: float) -> web.StreamResponse:
    cfg = g.cfg
    loop_now = time.monotonic
    b.in_flight += 1
    running_at_start = b.in_flight - 1
    b.breaker.on_attempt(loop_now())
    session = g.session_enter(request.headers, body)
    t0 = time.perf_counter()
    reply = None
    outcome_ok, status, meter = False, 502, None
    usage: dict | None = None
    try:
        try:
            reply = await b.adapter.forward(call, cfg.upstream.first_byte_timeout_s)
        except aiohttp.ClientConnectorError as e:
            b.breaker.on_failure(loop_now(), hold_s=cfg.health.breaker_open_s)
            raise Retryable(upstream_failed("could not connect to the engine")) from e
        except (aiohttp.ClientError, TimeoutError) as e:
            b.breaker.on_failure(loop_now())
            raise Retryable(upstream_timeout("no response") if isinstance(e, TimeoutError)
                            else upstream_failed("connection lost before the response")) from e
        status = reply.status
        if status >= 400:
            err = normalize_engine_error(status, await _read_quietly(reply))
            if status >= 500 or status == 429:
                b.breaker.on_failure(loop_now(), hold_s=_retry_after(reply.headers, status))
                raise Retryable(err)
            g.metrics.client_error(b.id, status)
            raise err  # the client's own request: never retried, never counts against the engine
        pairs = model_rewriter(native, shape.model)
        if shape.stream:
            meter = StreamMeter()
            resp = await stream_reply(request, g, b, reply, meter, pairs, body)
            usage = meter.usage
            outcome_ok = meter.error is None
            status = 200 if outcome_ok else (meter.error.status if meter.error else 502)
            return resp
        try:
            data = await reply.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            b.breaker.on_failure(loop_now())
            raise Retryable(upstream_failed("connection lost while reading the response")) from e
        usage = _usage_of(data)
        outcome_ok = True
        return web.Response(body=rewrite(data, pairs) if pairs else data, status=status,
                            headers=g.reply_headers(request, reply.headers))
    finally:
        b.in_flight -= 1
        g.session_exit(session)
        if reply is not None:
            reply.close()
        if outcome_ok:
            b.breaker.on_success()
        g.record(request, b, shape, Outcome(
            backend=b.id, shape=shape, ok=outcome_ok, status=status,
            ttft=(meter.t_first - t0) if meter and meter.t_first is not None else None,
            itl=_itl(meter, usage),
            e2e=time.perf_counter() - t0,
            prompt_tokens=int((usage or {}).get("prompt_tokens") or shape.prompt_tokens),
            completion_tokens=int((usage or {}).get("completion_tokens") or (meter.token_events if meter else 0)),
            cached_tokens=_cached(usage), running_at_start=running_at_start), t_in, t0)


async def stream_reply(request, g, b, reply, meter: StreamMeter, pairs, body) -> web.StreamResponse:
    """Wait for the first upstream bytes (failover still possible), then commit and relay chunk by chunk."""
    cfg = g.cfg
    chunks = reply.iter_chunks().__aiter__()
    try:
        async with asyncio.timeout(cfg.upstream.first_byte_timeout_s):
            first = await chunks.__anext__()
    except StopAsyncIteration:
        first = b""
    except (aiohttp.ClientError, TimeoutError) as e:
        b.breaker.on_failure(time.monotonic())
        raise Retryable(upstream_timeout("no first token") if isinstance(e, TimeoutError)
                        else upstream_failed("connection lost before the first token")) from e
    if first.startswith((b'data: {"error"', b'data:{"error"')):
        # An engine that opened the stream before validating (SGLang): still an ordinary HTTP error here.
        err = error_from_event(orjson.loads(first.split(b"\n\n", 1)[0][5:]))
        if err.status >= 500:
            b.breaker.on_failure(time.monotonic())
            raise Retryable(err)
        raise err
    opts = body.get("stream_options")
    client_wants_usage = isinstance(opts, dict) and opts.get("include_usage") is True
    resp = web.StreamResponse(status=200, headers=g.reply_headers(request, reply.headers))
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    relay = SSERelay(resp, meter, strip_usage=not client_wants_usage, pairs=pairs)
    try:
        if first:
            await relay.feed(first)
        async for chunk in chunks:
            await relay.feed(chunk)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
            TimeoutError) as e:
        b.breaker.on_failure(time.monotonic())
        await relay.fail(upstream_failed("the engine stopped mid-stream") if not isinstance(e, TimeoutError)
                         else upstream_timeout("the engine stalled mid-stream"))
        return resp
    await relay.finish()
    return resp


async def _read_quietly(reply) -> bytes:
    try:
        return await reply.read()
    except (aiohttp.ClientError, TimeoutError):
        return b""


def _retry_after(headers, status: int) -> float | None:
    if status not in (429, 503):
        return None
    v = headers.get("Retry-After")
    try:
        return min(float(v), 120.0) if v is not None else None
    except ValueError:
        return None


def _usage_of(data: bytes) -> dict | None:
    if b'"usage"' not in data:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    u = obj.get("usage") if isinstance(obj, dict) else None
    return u if isinstance(u, dict) else None


def _cached(usage: dict | None) -> int:
    details = (usage or {}).get("prompt_tokens_details")
    return int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0


def _itl(meter: StreamMeter | None, usage: dict | None) -> float | None:
    """GenAI-Perf ITL: (last token - first token) / (output tokens - 1), tokens from usage when the engine says."""
    if meter is None or meter.t_first is None or meter.t_last is None:
        return None
    n = int((usage or {}).get("completion_tokens") or meter.token_events)
    return (meter.t_last - meter.t_first) / (n - 1) if n > 1 else None


