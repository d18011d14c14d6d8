"""Dispatch of a routed request: the ranked backends in turn (failover before the first byte), one attempt each,
and the relay of the reply that commits."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Final, Iterator

import orjson

from gateway.apis.api import NONE, route_not_served
from gateway.contracts import BackendView, Decision, ReplyTooLarge, RequestShape, UpstreamCall, UpstreamReply
from gateway.errors import GatewayError, bad_request, normalize_engine_error, shutting_down, upstream_failed, \
    upstream_timeout
from gateway.http.headers import forwarded_headers
from gateway.routing.attempt import ERROR_EVENT_STARTS, first_event_error, measured, stream_status
from gateway.routing.failover import (TRANSPORT_ERRORS, Retryable, begin, charge, charge_engine_error,
                                      charge_send_error, charge_timeout, model_refused, settle)
from gateway.routing.relay import DroppingModelRewrite, EventTooLarge, ModelRewrite, SSERelay, StreamMeter, usage_of
from gateway.routing.request import RequestState
from gateway.routing.scrub import Scrubbing, scrub
from gateway.routing.typed_relay import TypedRelay, Watcher
from gateway.routing.typed_relay import first_event_error as typed_first_error

if TYPE_CHECKING:  # the runtime imports this module's callers, never this module: no cycle at run time
    from gateway.fleet.pool import BackendState
    from gateway.runtime import Gateway

# How engines answer a path they do not serve: FastAPI's and llama.cpp's 404 messages, aiohttp's plain-text body.
UNKNOWN_PATH_MESSAGES: Final = frozenset({"not found", "file not found"})
UNKNOWN_PATH_BODIES: Final = frozenset({b"404: not found", b"not found"})


def credentials_refused(b: BackendState) -> GatewayError:
    """What a client gets when an engine refused the gateway's own credentials: the gateway's fault, never the
    client's, and nothing of the engine's text (it may quote the key)."""
    return GatewayError(502, f"Backend {b.id} refused the gateway's credentials for its engine; the gateway's "
                        f"operator must fix its configuration.", code="upstream_auth_failed")


async def dispatch(g: Gateway, st: RequestState, shape: RequestShape, decision: Decision) -> Any:
    """Try the ranked backends in turn; a failure before the first byte moves on, after it never does."""
    cfg = g.hot
    api = st.api
    body, raw = st.body, st.raw
    # Only a valid trace context and the route's own checked headers go on; the request id was checked on arrival.
    fwd = forwarded_headers(st.ex.headers, api.passed_headers)
    fwd["x-request-id"] = st.request_id
    path = api.upstream_path(st.ex.target)
    method = st.ex.method if api.body == NONE else "POST"
    deadline = time.monotonic() + cfg.retry_deadline_s
    max_attempts = cfg.max_attempts
    # A stream's class deadline for the first byte; the last candidate always gets first_byte_timeout_s.
    class_ttft = cfg.ttft_deadline_s.get(shape.klass) if shape.stream else None
    last_error: GatewayError | None = None
    failed: list[str] | None = None  # made on the first failure: the common path allocates nothing
    suspect = None  # a backend that answered HTTP 500: charged only if another engine then serves the request
    outgrown = 0  # the largest context window that refused this request as too long
    tried = 0
    ranked = decision.ranked
    for i, view in enumerate(ranked):
        if tried >= max_attempts or time.monotonic() >= deadline:
            break
        b = g.pool.get(view.id)
        if b is None or not b.usable(time.monotonic()):
            continue
        native = b.models.get(shape.model)
        if native is None:
            continue  # a reload took the model off this backend since it was ranked
        window = b.window(shape.model)
        if outgrown and window is not None and window <= outgrown:
            continue  # no larger than one that refused it: it would refuse it too
        tried += 1
        first_byte_s = cfg.first_byte_timeout_s
        if class_ttft is not None and tried < max_attempts and _another_usable(g, ranked, i):
            first_byte_s = min(class_ttft, first_byte_s)
        try:
            # A request without a body by its API goes on without one, whatever the client sent with it.
            upstream_body = b"" if api.body == NONE else b.adapter.prepare(api, body, raw, native, shape.stream)
        except orjson.JSONEncodeError:
            raise bad_request("The request body is nested too deeply to be passed on.", code="invalid_json") from None
        call = UpstreamCall(path, upstream_body, fwd, shape.stream, method)
        st.backend = b.id
        if failed and last_error is not None:
            st.reason = f"{decision.reason}; failover from {','.join(failed)} after {last_error.code}"
        try:
            resp = await attempt(g, st, shape, b, call, first_byte_s)
        except Retryable as r:
            last_error = r.error
            failed = [b.id] if failed is None else [*failed, b.id]
            g.metrics.retry(b.id)
            if r.suspect:
                if suspect is not None:
                    raise r.error from None  # two engines fail this request the same way: it is the request
                suspect = b
            continue
        except GatewayError as err:
            # Too long for this engine after all (the prompt estimate has no tokenizer): a larger window may
            # still hold it, and the estimate learns. The engine answered properly; nothing is charged.
            if err.code != "context_length_exceeded" or window is None or not _larger(g, shape, ranked, i, window):
                raise
            g.prompt_sizer.learn_refusal(shape, err, window)
            outgrown, last_error = window, err
            failed = [b.id] if failed is None else [*failed, b.id]
            g.metrics.retry(b.id)
            continue
        if suspect is not None:
            charge(suspect)  # another engine served what this one gave a 500 for
        return resp
    if last_error is not None:
        raise last_error
    raise g.pool.unavailable(shape.model, time.monotonic())


def _usable_after(g: Gateway, ranked: tuple[BackendView, ...], i: int) -> Iterator[BackendState]:
    """The candidates ranked after the i-th that could take the request now."""
    now = time.monotonic()
    for v in ranked[i + 1:]:
        b = g.pool.get(v.id)
        if b is not None and b.usable(now):
            yield b


def _larger(g: Gateway, shape: RequestShape, ranked: tuple[BackendView, ...], i: int, window: int) -> bool:
    """Whether a later candidate has a larger (or unknown) context window than `window`."""
    return any((b.window(shape.model) or window + 1) > window for b in _usable_after(g, ranked, i))


def _another_usable(g: Gateway, ranked: tuple[BackendView, ...], i: int) -> bool:
    return next(_usable_after(g, ranked, i), None) is not None


async def attempt(g: Gateway, st: RequestState, shape: RequestShape, b: BackendState, call: UpstreamCall,
                  first_byte_s: float) -> Any:
    """One try on one backend: send, then relay the reply; the outcome is recorded however it ends."""
    cfg = g.hot
    ex = st.ex
    api = st.api
    b.in_flight += 1
    capped = shape.klass in cfg.capped  # a class with a share of the seats (gateway/queueing/): counted per backend
    if capped:
        b.capped += 1
    running_at_start = b.in_flight - 1
    started = time.monotonic()
    begin(b, started)
    session = g.session_enter(shape.session_id)  # found once, by classify
    t0 = time.perf_counter()
    reply = None
    outcome_ok, engine_ok, left, status, meter = False, False, False, 502, None
    usage: dict | None = None
    # A stream's deadline for its first byte (only streams wait for one past the head; get_running_loop costs
    # a getpid syscall, which a non-streamed request need not pay)
    first_by = asyncio.get_running_loop().time() + first_byte_s if shape.stream else 0.0
    secret = b.adapter.secret  # the gateway's key for this engine: never relayed, whatever the engine echoes
    try:
        try:
            reply = await b.adapter.forward(call, first_byte_s)
        except TRANSPORT_ERRORS as e:
            raise charge_send_error(b, e, started, cfg.health) from e
        status = reply.status
        if status >= 400:
            raw_error = scrub(await _read_quietly(reply, cfg.max_error_bytes), secret)
            err = normalize_engine_error(status, raw_error)
            if status in (401, 403):
                b.refused_credentials(status, time.monotonic())  # the gateway's key, not the client's
                raise Retryable(credentials_refused(b))
            if not api.everywhere and not api.by_id and (status == 501 or status == 404 and (
                    err.message.strip().lower() in UNKNOWN_PATH_MESSAGES
                    or raw_error.strip().lower() in UNKNOWN_PATH_BODIES)):
                # A build or a launch without this API (a 404 for the path; llama.cpp's 501 for embeddings or
                # rerank without their flags): the engine is sound, the route goes elsewhere.
                engine_ok = True
                b.refused_route(api.name, call.path, err.message)
                raise Retryable(route_not_served(shape.model, api))
            retry = charge_engine_error(b, err, reply.headers, cfg.health, shape.model)
            if retry is None:
                engine_ok = True  # the engine answered properly; the request was at fault
                g.metrics.client_error(b.id, status)
                raise err  # never retried, never counted against the engine
            raise retry
        if b.misconfigured is not None:
            b.accepted_credentials()
        drop = b.private_fields  # the engine's own reply fields, unless kept: none on most engines
        rename = DroppingModelRewrite(shape.model, drop) if drop else ModelRewrite(shape.model)
        if drop and st.turn is not None:
            st.turn.private = tuple(f.decode().strip('"') for f in drop)  # not kept with the response either
        if secret is not None:
            rename = Scrubbing(rename, secret)
        if shape.stream:
            meter = StreamMeter()
            resp = await stream_reply(g, st, b, reply, meter, rename, started, first_by)
            status = stream_status(meter)
            outcome_ok = status == 200
            return resp
        try:
            data = await reply.read(cfg.max_reply_bytes)
        except ReplyTooLarge:
            charge(b)
            status = 502
            raise upstream_failed(f"the reply is larger than the gateway's limit "
                                  f"({cfg.max_reply_bytes} bytes)") from None  # not retried: it would be again
        except TRANSPORT_ERRORS as e:
            charge(b)
            raise Retryable(upstream_failed("connection lost while reading the response")) from e
        if not data and status != 204:
            # A success with nothing in it answers nothing (a client's JSON parser fails on it): the engine's fault,
            # and another backend may still answer.
            charge(b)
            raise Retryable(upstream_failed("the engine sent an empty reply"))
        usage = usage_of(data)
        outcome_ok = True
        if st.turn is not None:
            data = await st.turn.finish_reply(data)  # its record written before the client sees the reply
        elif st.kept_by is not None:
            st.kept_by.after_reply(data, b.id, st.ex.method)  # which engine keeps the response (engine mode)
        if st.tap is not None:
            st.tap.add(data)
        if started > b.last_output:
            b.last_output = started
        return ex.reply(status, g.reply_headers(st, reply.headers), rename(data), st.limit_lines)
    except Retryable as r:
        status = r.error.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        if meter is not None and meter.saw_done and meter.error is None:
            # The client had its whole stream and hung up while the engine's end of body was still on its way:
            # served, with the usage the stream reported.
            status, outcome_ok = 200, True
        else:
            status, left = 499, True  # the client went away (or the shutdown cut it)
        raise
    except GatewayError as e:
        if e.status < 500:
            status, engine_ok = e.status, True  # (an in-band error event the request caused)
        raise
    finally:
        b.in_flight -= 1
        if capped:
            b.capped -= 1
        if g.queue.length:
            g.queue.wake()  # a seat freed: the queue's first request that fits takes it
        g.session_exit(session)
        if reply is not None:
            reply.close()
        settle(b, started, outcome_ok or engine_ok)
        if meter is not None:
            usage = meter.usage  # (also of a stream the client left: what the engine reported until then)
        n_prompt = (usage or {}).get("prompt_tokens")
        if isinstance(n_prompt, int):
            g.prompt_sizer.observe(shape.model, shape.prompt_tokens, n_prompt)
        st.outcome = o = measured(b.id, shape, t0, status, outcome_ok, engine_ok, left, meter, usage, running_at_start)
        g.record_soon(b, shape, o, st.t_in, t0, st.split)


async def stream_reply(g: Gateway, st: RequestState, b: BackendState, reply: UpstreamReply, meter: StreamMeter,
                       rename: ModelRewrite, started: float, first_by: float) -> Any:
    """Wait for the first upstream bytes (failover still possible), then commit and relay chunk by chunk."""
    ex = st.ex
    try:
        first = await reply.next_chunk(first_by)  # one deadline from sending the request to the first byte
    except TimeoutError as e:
        charge_timeout(b, started, g.hot.health)
        raise Retryable(upstream_timeout("no first token in time")) from e
    except TRANSPORT_ERRORS as e:
        charge(b)
        raise Retryable(upstream_failed("connection lost before the first token")) from e
    if first is None:
        charge(b)
        raise Retryable(upstream_failed("the engine closed the stream without sending anything"))
    if reply.broken:
        # The engine's reply broke in the same read as its first bytes: the client has seen nothing yet.
        charge(b)
        raise Retryable(upstream_failed("the engine's reply broke before the first token"))
    if started > b.last_output:
        b.last_output = started
    rules = st.api.stream
    if rules is not None:
        err = typed_first_error(scrub(first, b.adapter.secret))
        if err is not None:
            if err.status >= 500:
                charge(b)
                raise Retryable(err)
            raise err
    elif first.startswith(ERROR_EVENT_STARTS):
        # An engine that opened the stream before validating (SGLang): still an ordinary HTTP error here.
        err = first_event_error(scrub(first, b.adapter.secret))
        if err is None:
            charge(b)
            raise Retryable(upstream_failed("the engine began its stream with a malformed error event"))
        if err.status >= 500:
            charge(b)
            raise Retryable(err)
        raise model_refused(b, err, st.shape.model if st.shape is not None else "") or err
    # The head goes out with the first events in one write (the first bytes are already here).
    resp = await ex.open_stream(g.reply_headers(st, reply.headers), st.limit_lines)
    relay: SSERelay
    if rules is not None:
        watcher: Watcher | None = st.turn if st.turn is not None else \
            st.kept_by.watcher(b.id) if st.kept_by is not None else None
        relay = TypedRelay(resp, meter, rules, rename, g.hot.max_event_bytes, watcher)
    else:
        opts = st.body.get("stream_options")
        client_wants_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        relay = SSERelay(resp, meter, strip_usage=not client_wants_usage, rename=rename,
                         max_event=g.hot.max_event_bytes)
    task = asyncio.current_task()  # the connection's serving task
    assert task is not None  # always within one
    g.streams.add(task)
    tap = st.tap
    if tap is not None:
        tap.add(first)
    try:
        try:
            await relay.feed(first)
            if tap is None:  # (a shadowed stream's chunks also go to its tap: they all take the loop below)
                reply.hand_to(relay.take)  # a token then goes from the engine's read callback to the client's write
            while True:
                # Only reading from the engine is guarded: a failed write means the client left, not the engine.
                try:
                    chunk = await reply.next_chunk()
                except TRANSPORT_ERRORS as e:
                    charge(b)
                    g.metrics.stream_error(b.id)
                    # The client has seen output: no failover now, the API's error event instead.
                    await relay.fail(upstream_timeout("the engine stalled mid-stream") if isinstance(e, TimeoutError)
                                     else upstream_failed("the engine stopped mid-stream"))
                    return resp
                if chunk is None:
                    break
                if tap is not None:
                    tap.add(chunk)
                await relay.feed(chunk)
        except EventTooLarge as e:
            charge(b)
            g.metrics.stream_error(b.id)
            await relay.fail(upstream_failed(str(e)))
            return resp
    except asyncio.CancelledError:
        if not g.cutting:
            raise  # the client went away
        # The shutdown grace period ran out: end the stream with an error event rather than cut it.
        task.uncancel()
        await relay.fail(shutting_down())
        return resp
    finally:
        g.streams.discard(task)
    await relay.finish()
    return resp


async def _read_quietly(reply, limit: int) -> bytes:
    """An error body, cut at `limit` (its start says what went wrong)."""
    try:
        return await reply.read(limit, truncate=True)
    except TRANSPORT_ERRORS:
        return b""
