"""A request's whole path: parse, classify, pick candidates, rank, dispatch with failover, relay, record."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Final, Iterator

import orjson

from gateway.apis import messages
from gateway.apis import responses as responses_api
from gateway.apis.bodies import NO_BODY, parse_body
from gateway.apis.table import (ANTHROPIC, BY_RESPONSE_ID, PASSED_HEADERS, response_id_in, route_not_served,
                                upstream_path)
from gateway.contracts import (DEFAULT, BackendView, Decision, ReplyTooLarge, RequestShape, RouteInput, UpstreamCall,
                               UpstreamReply)
from gateway.errors import (GatewayError, bad_request, model_not_found, normalize_engine_error, shutting_down,
                            upstream_failed, upstream_timeout)
from gateway.experiments import experiment as experiments
from gateway.experiments import shadow
from gateway.http.headers import forwarded_headers, valid_request_id
from gateway.routing.admission import admit
from gateway.routing.attempt import ERROR_EVENT_STARTS, first_event_error, measured, stream_status
from gateway.routing.context import fitting
from gateway.routing.failover import (TRANSPORT_ERRORS, Retryable, begin, charge, charge_engine_error,
                                      charge_send_error, charge_timeout, model_refused, settle)
from gateway.routing.relay import DroppingModelRewrite, EventTooLarge, ModelRewrite, SSERelay, StreamMeter, usage_of
from gateway.routing.request import Exchange, RequestState
from gateway.routing.shape import CHAT_FAMILY, classify, session_of
from gateway.routing.stored import IdSink
from gateway.routing.typed_relay import RULES, TypedRelay
from gateway.routing.typed_relay import first_event_error as typed_first_error

if TYPE_CHECKING:  # the runtime imports this module's callers, never this module: no cycle at run time
    from gateway.fleet.pool import BackendState
    from gateway.keys.principal import Principal
    from gateway.runtime import Gateway

# How engines answer a path they do not serve (FastAPI's and llama.cpp's 404 messages).
UNKNOWN_PATH_MESSAGES: Final = frozenset({"not found", "file not found"})

async def serve_api(g: Gateway, ex: Exchange, route: str) -> Any:
    """An API request: request id first, then the pipeline (whose first steps, checking the API key and reading
    the body, raise 401 for a missing or unknown key and 413 for a body over the limit, unread); every error leaves
    as OpenAI-shaped JSON and the request gets exactly one access-log line however it ends (and a refusal is
    counted there, as REJECTED)."""
    headers = ex.headers
    st = RequestState(valid_request_id(headers.get("x-request-id")) or g.request_ids.next(), ex, route)
    status = 500
    try:
        resp = await handle(g, st)
        status = resp.status
        return resp
    except GatewayError as err:
        status = err.status
        headers = err.reply_headers(st.request_id)
        # Where the request went (empty: no backend was tried) and why, as on every reply.
        headers["x-shapegate-backend"] = st.backend
        headers["x-shapegate-reason"] = st.reason or (err.code or "error")
        if st.limit is not None:  # a key with limits: its x-ratelimit headers on errors too
            headers.update(st.limit.headers())
        if st.route in ANTHROPIC:  # Anthropic's error shape and status codes on its routes
            status = messages.status_of(err)
            return ex.reply(status, headers, messages.error_body(err, st.request_id))
        return ex.reply(status, headers, err.body())
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away first (noticed while waiting, or on writing to it)
        raise
    finally:
        g.finish(st, status)


async def handle(g: Gateway, st: RequestState) -> Any:
    """The request path, one call per stage; what a stage decides is kept on the request's state here."""
    ex = st.ex
    headers = ex.headers
    route = st.route
    st.principal = caller = g.auth.authenticate(headers)  # first: a request without a valid key is not read
    st.t_in = time.perf_counter()
    st.raw = raw = await ex.read()
    if route in BY_RESPONSE_ID:
        return await handle_stored(g, st, caller)
    st.body = body = parse_body(raw, route, headers)
    stored = None  # the stored response this one continues: its backend is the only one that knows it
    if route == "responses" and body.get("previous_response_id") is not None:  # (null: none, as engines take it)
        stored = await g.stored.owned(body["previous_response_id"], caller.id, "previous_response_id")
    sid = session_of(body, headers, route)
    principal = caller.id
    hot = g.hot
    st.shape = shape = classify(route=route, body=body, session=sid, principal=principal, cfg=hot.shape,
                                learned_output=g.estimator.expected(principal, body["model"]),
                                session_in_flight=g.session_load(sid), want_prefix=g.wants_prefix)
    now = await take_limits(g, st, shape, caller)
    if not g.pool.serves(shape.model):
        raise model_not_found(shape.model)
    candidates = g.pool.candidates(shape.model, shape.klass, now)
    if route not in CHAT_FAMILY:  # an engine that does not serve the API is no candidate for it
        candidates = [b for b in candidates if b.serves_route(route)]
        if not candidates and not g.pool.serving_route(shape.model, route):
            raise route_not_served(shape.model, route)
    if stored is not None:
        candidates = [stored.backend_in(g.pool, now, body["previous_response_id"])]
    arm = choice = None
    if g.experiments and shape.model in g.experiments.models and stored is None:
        choice = experiments.enter(g.experiments, caller, shape, body, headers, candidates)
        candidates, arm, st.split = choice.candidates, choice.arm, choice.split
        if shadow.copyable(route, body):
            st.shadow = choice.shadow
    if not candidates:
        raise g.pool.unavailable(shape.model, now)
    candidates = fitting(g.pool, g.prompt_sizer, shape, candidates, now)
    candidates = admit(candidates, shape.model, shape.klass, now, hot.admission)
    policy = g.policy_for(shape.model)
    affinity, cached = None, 0
    if g.affinity is not None:
        affinity, cached = g.affinity.lookup(shape)
        g.metrics.affinity(affinity is not None)
    route_in = RouteInput(shape, tuple(b.view(now) for b in candidates), affinity, now, cached)
    decision = policy.rank(route_in) if arm is None else experiments.rank_arm_first(policy, route_in, arm)
    if stored is not None:
        decision = Decision(decision.ranked, "stored response")
    g.metrics.decision(g.policy_name(shape.model), decision.ranked[0].id if decision.ranked else "", decision.reason)
    st.reason = decision.reason
    if choice is not None and st.shadow is not None and choice.shadow is not None:
        st.tap = shadow.launch(g, *choice.shadow, st, shape, body, raw)  # starts once this request has gone out
    return await dispatch(g, st, shape, decision)


async def take_limits(g: Gateway, st: RequestState, shape: RequestShape, caller: Principal) -> float:
    """Take the request from its key's buckets or raise a 429: at once from this process's, or through Redis.
    Returns the time routing goes on from."""
    now = time.monotonic()
    plan = g.limiter.plan(caller, shape.model, g.hot.limits)  # None for a key without rate limits
    if plan is not None:
        tokens = plan.tokens(shape, st.body)  # the prompt once, the output for each of `n` choices
        if g.limiter.shared is None:
            held = g.limiter.take(plan, tokens, now)
        else:
            held = await g.limiter.reserve(plan, tokens, g.hot.limits)
            now = time.monotonic()
        st.limit, st.limit_lines = held, held.lines
    return now


async def handle_stored(g: Gateway, st: RequestState, caller: Principal) -> Any:
    """A GET, DELETE or cancel of a stored response: to the backend that made it, for the key that made it."""
    ex = st.ex
    rid = response_id_in(ex.target.partition("?")[0])
    rec = await g.stored.owned(rid, caller.id, "response_id")
    query = ex.target.partition("?")[2]
    assert st.principal is not None
    st.shape = shape = RequestShape(model=rec.model, route=st.route, stream="stream=true" in query, prompt_tokens=1,
                                    output_tokens=0, klass=DEFAULT, principal=st.principal.id, session_id=None,
                                    prefix_hashes=(), max_output=None)
    now = await take_limits(g, st, shape, caller)
    b = rec.backend_in(g.pool, now, rid)
    if not b.serves_route(st.route):
        raise GatewayError(404, f"The response '{rid}' was made on backend {b.id}, whose engine ({b.engine}) keeps "
                           f"no responses to read back or cancel.", param="response_id", code="response_not_stored")
    st.reason = "stored response"
    return await dispatch(g, st, shape, Decision((b.view(now),), st.reason))


async def dispatch(g: Gateway, st: RequestState, shape: RequestShape, decision: Decision) -> Any:
    """Try the ranked backends in turn; a failure before the first byte moves on, after it never does."""
    cfg = g.hot
    body, raw = st.body, st.raw
    headers = st.ex.headers
    # Only a valid trace context and the route's own checked headers go on; the request id was checked on arrival.
    fwd = forwarded_headers(headers, PASSED_HEADERS.get(st.route, ()))
    fwd["x-request-id"] = st.request_id
    path = upstream_path(st.route, st.ex.target)
    method = st.ex.method if st.route == "response" else "POST"
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
        window = b.window(shape.model)
        if outgrown and window is not None and window <= outgrown:
            continue  # no larger than one that refused it: it would refuse it too
        tried += 1
        first_byte_s = cfg.first_byte_timeout_s
        if class_ttft is not None and tried < max_attempts and _another_usable(g, ranked, i):
            first_byte_s = min(class_ttft, first_byte_s)
        native = b.models[shape.model]
        try:
            upstream_body = raw if shape.route in NO_BODY else \
                b.adapter.prepare(shape.route, body, raw, native, shape.stream)
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
    b.in_flight += 1
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
    try:
        try:
            reply = await b.adapter.forward(call, first_byte_s)
        except TRANSPORT_ERRORS as e:
            raise charge_send_error(b, e, started, cfg.health) from e
        status = reply.status
        if status >= 400:
            err = normalize_engine_error(status, await _read_quietly(reply, cfg.max_error_bytes))
            if status == 404 and shape.route not in CHAT_FAMILY and shape.route not in BY_RESPONSE_ID \
                    and err.message.strip().lower() in UNKNOWN_PATH_MESSAGES:
                engine_ok = True  # a build without this API: the engine is sound, the route goes elsewhere
                b.refused_route(shape.route, call.path, err.message)
                raise Retryable(route_not_served(shape.model, shape.route))
            retry = charge_engine_error(b, err, reply.headers, cfg.health, shape.model)
            if retry is None:
                engine_ok = True  # the engine answered properly; the request was at fault
                g.metrics.client_error(b.id, status)
                raise err  # never retried, never counted against the engine
            raise retry
        drop = b.private_fields  # the engine's own reply fields, unless kept: none on most engines
        rename = DroppingModelRewrite(shape.model, drop) if drop else ModelRewrite(shape.model)
        if shape.stream:
            meter = StreamMeter()
            resp = await stream_reply(g, st, b, reply, meter, rename, started, first_by)
            usage = meter.usage
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
        if shape.route == "responses" and status == 200 and responses_api.stores(st.body):
            g.stored.remember_reply(data, b.id, shape.principal, shape.model)
        elif shape.route == "response" and st.ex.method == "DELETE" and status == 200:
            g.stored.forget(response_id_in(st.ex.target.partition("?")[0]))
        if st.tap is not None:
            st.tap.add(data)
        if started > b.last_output:
            b.last_output = started
        return ex.reply(status, g.reply_headers(st, reply.headers), rename(data), st.limit_lines)
    except Retryable as r:
        status = r.error.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status, left = 499, True  # the client went away (or the shutdown cut it)
        raise
    except GatewayError as e:
        if e.status < 500:
            status, engine_ok = e.status, True  # (an in-band error event the request caused)
        raise
    finally:
        b.in_flight -= 1
        g.session_exit(session)
        if reply is not None:
            reply.close()
        settle(b, started, outcome_ok or engine_ok)
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
    typed = RULES.get(st.route)
    if typed is not None:
        err = typed_first_error(first)
        if err is not None:
            if err.status >= 500:
                charge(b)
                raise Retryable(err)
            raise err
    elif first.startswith(ERROR_EVENT_STARTS):
        # An engine that opened the stream before validating (SGLang): still an ordinary HTTP error here.
        err = first_event_error(first)
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
    if typed is not None:
        stores = st.route == "responses" and responses_api.stores(st.body)
        assert st.shape is not None
        relay = TypedRelay(resp, meter, typed, rename, g.hot.max_event_bytes,
                           IdSink(g.stored, b.id, st.shape.principal, st.shape.model) if stores else None)
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
                    # The client has seen output: no failover now, an OpenAI error event and [DONE] instead.
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
