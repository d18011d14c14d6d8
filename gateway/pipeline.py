"""A request's whole path: parse, classify, pick candidates, rank, dispatch with failover, relay, record."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from urllib.parse import parse_qsl

import orjson

from gateway.apis.api import NONE, route_not_served
from gateway.apis.responses import stores
from gateway.background import start_background
from gateway.contracts import Decision, RequestShape, RouteInput
from gateway.errors import GatewayError, bad_request, model_not_found
from gateway.experiments import experiment as experiments
from gateway.experiments import shadow
from gateway.http.headers import valid_request_id
from gateway.routing.admission import admit
from gateway.routing.context import fitting
from gateway.routing.request import Exchange, RequestState
from gateway.routing.shape import classify, session_of
from gateway.state.engine_index import EngineKept
from gateway.upstream import dispatch

MAX_QUERY_FIELDS = 16  # a list's query (limit, order, after, include...): more is refused

if TYPE_CHECKING:  # the runtime imports this module's callers, never this module: no cycle at run time
    from gateway.apis.api import Api
    from gateway.fleet.pool import BackendState
    from gateway.keys.principal import Principal
    from gateway.runtime import Gateway


async def serve_api(g: Gateway, ex: Exchange, api: Api) -> Any:
    """An API request: request id first, then the pipeline (whose first steps, checking the API key and reading
    the body, raise 401 for a missing or unknown key and 413 for a body over the limit, unread); every error leaves
    in the API's own shape and the request gets exactly one access-log line however it ends (and a refusal is
    counted there, as REJECTED)."""
    st = RequestState(valid_request_id(ex.headers.get("x-request-id")) or g.request_ids.next(), ex, api)
    status = 500
    try:
        resp = await handle(g, st)
        status = resp.status
        return resp
    except GatewayError as err:
        status = api.errors.status_of(err)
        headers = err.reply_headers(st.request_id)
        if st.backend:  # where the request went (none: no backend was tried), and why, as on every reply
            headers["x-shapegate-backend"] = st.backend
        headers["x-shapegate-reason"] = st.reason or (err.code or "error")
        if st.limit is not None:  # a key with limits: its x-ratelimit headers on errors too
            headers.update(st.limit.headers())
        return ex.reply(status, headers, api.errors.body(err, st.request_id))
    except (asyncio.CancelledError, ConnectionResetError):
        # The client went away first (noticed while waiting, or on writing to it), unless it had its whole stream.
        status = st.outcome.status if st.outcome is not None and st.outcome.ok else 499
        raise
    finally:
        g.finish(st, status)


async def handle(g: Gateway, st: RequestState) -> Any:
    """The request path, one call per stage; what a stage decides is kept on the request's state here."""
    ex, api = st.ex, st.api
    headers = ex.headers
    st.principal = caller = g.auth.authenticate(headers)  # first: a request without a valid key is not read
    st.t_in = time.perf_counter()
    st.raw = await ex.read()
    pinned = None  # with the state kept by the engines: the one backend that knows the response named
    if api.state:  # the state the gateway keeps for clients (stored responses, conversations)
        answered, pinned = await enter_state(g, st, caller)
        if answered is not None:
            return answered
    else:
        st.body = api.parse(st.raw, headers)
    body = st.body
    sid = st.session or session_of(api, body, headers)
    principal = caller.id
    hot = g.hot
    st.shape = shape = classify(api=api, body=body, session=sid, principal=principal, cfg=hot.shape,
                                learned_output=g.estimator.expected(principal, body["model"]),
                                session_in_flight=g.session_load(sid), want_prefix=g.wants_prefix)
    now = await take_limits(g, st, shape, caller)
    if not g.pool.serves(shape.model):
        raise model_not_found(shape.model)
    candidates = g.pool.candidates(shape.model, shape.klass, now)
    if not api.everywhere:  # an engine that does not serve the API is no candidate for it
        candidates = [b for b in candidates if b.serves_route(api.name)]
        if not candidates and not g.pool.serving_route(shape.model, api.name):
            raise route_not_served(shape.model, api)
    if pinned is not None:
        candidates = [pinned]
    arm = choice = None
    if g.experiments and shape.model in g.experiments.models and pinned is None:
        choice = experiments.enter(g.experiments, caller, shape, body, headers, candidates)
        candidates, arm, st.split = choice.candidates, choice.arm, choice.split
        if shadow.copyable(api, body):
            st.shadow = choice.shadow
    if not candidates:
        raise g.pool.unavailable(shape.model, now)
    candidates = fitting(g.pool, g.prompt_sizer, shape, candidates, now)
    background = st.turn is not None and st.turn.background
    full: list[BackendState] = []  # candidates without a seat now: ranked last, for failover only
    if hot.queue is None:
        candidates = admit(candidates, shape.model, shape.klass, now, hot.admission)  # refused at once when saturated
    elif not background:  # (a background response is answered at once, and waits in its own task: background.py)
        # At once when a candidate has a seat free and nothing waits for the model; else after a wait in the queue.
        open_ = g.queue.admit_now(headers, caller, shape, candidates, now, hot.queue)
        if open_ is None:
            open_ = await g.queue.wait(headers, caller, shape, candidates, now, hot.queue)
        if len(open_) < len(candidates):
            full = [b for b in candidates if b not in open_]
        candidates = open_
    policy = g.policy_for(shape.model)
    affinity, cached = None, 0
    if g.affinity is not None:
        affinity, cached = g.affinity.lookup(shape)
        g.metrics.affinity(affinity is not None)
    route_in = RouteInput(shape, tuple(b.view(now) for b in candidates), affinity, now, cached)
    decision = policy.rank(route_in) if arm is None else experiments.rank_arm_first(policy, route_in, arm)
    if pinned is not None:
        decision = Decision(decision.ranked, "stored response")
    if full:  # an engine's own queue is still better than a failed request
        decision = Decision((*decision.ranked, *(b.view(now) for b in full)), decision.reason)
    g.metrics.decision(g.policy_name(shape.model), decision.ranked[0].id if decision.ranked else "", decision.reason)
    st.reason = decision.reason
    if background:
        # Answered now (queued), run in the background.
        return await start_background(g, st, shape, decision, candidates)
    if choice is not None and st.shadow is not None and choice.shadow is not None:
        st.tap = shadow.launch(g, *choice.shadow, st, shape, body, st.raw)  # starts once this request has gone out
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


async def enter_state(g: Gateway, st: RequestState, caller: Principal) -> tuple[Any, BackendState | None]:
    """A request of an API whose state is kept for clients: answered here from the gateway's own state, or its body
    read and its turn begun (a chain expanded, a conversation's items put first), or, with the state kept by the
    engines, the one backend that knows the response it names. Returns (a reply, or None to route it; the pinned
    backend or None)."""
    api, ex = st.api, st.ex
    owner = caller.owner
    path, _, query = ex.target.partition("?")
    if g.responses is not None:  # the gateway keeps the state
        if api.body == NONE or api.local:
            return await answer_locally(g, st, path, query, owner), None
        st.body = body = api.parse(st.raw, ex.headers)
        if body.get("previous_response_id") is not None or body.get("conversation") is not None or \
                (api.generating and (stores(body) or body.get("background") is True)):
            turn = await g.responses.begin(body, owner)
            st.body, st.raw, st.session = turn.body, orjson.dumps(turn.body), turn.session
            if api.generating:  # (input_tokens only counts the expanded input: nothing to record)
                st.turn = turn
        return None, None
    index = g.engine_index
    assert index is not None  # (one of the two is kept: gateway/runtime.py)
    if api.local:
        raise GatewayError(404, f"{api.path} is served with the state kept by the gateway ([responses] state = "
                           f"\"gateway\"); this gateway leaves it to the engines.", code="route_not_served")
    if api.by_id:  # a GET, DELETE or cancel: to the backend that made the response, for the key that made it
        rid = path.split("/")[3]
        rec = await index.owned(rid, owner, "response_id")
        st.body = {"model": rec.model, "stream": "stream=true" in query}
        st.kept_by = EngineKept(index, owner, rec.model, False, rid)
        return None, rec.backend_in(g.pool, time.monotonic(), rid)
    st.body = body = api.parse(st.raw, ex.headers)
    pinned = None
    prev = body.get("previous_response_id")
    if prev is not None:  # (null: none, as engines take it)
        rec = await index.owned(prev, owner, "previous_response_id")
        pinned = rec.backend_in(g.pool, time.monotonic(), prev)
    st.kept_by = EngineKept(index, owner, body["model"], api.generating and stores(body), None)
    return None, pinned


async def answer_locally(g: Gateway, st: RequestState, path: str, query: str, owner: str) -> Any:
    """A route the gateway answers from its own state: a stored response (GET, DELETE, cancel, input items) or a
    conversation and its items."""
    assert g.responses is not None and g.conversations is not None
    api, ex = st.api, st.ex
    try:
        params = dict(parse_qsl(query, max_num_fields=MAX_QUERY_FIELDS)) if query else {}
    except ValueError:
        raise bad_request(f"The query string has more than {MAX_QUERY_FIELDS} fields.", code="invalid_query") \
            from None
    st.reason = "gateway state"
    if api.state == "conversations":
        body = api.parse(st.raw, ex.headers) if ex.method == "POST" else {}
        data = await g.conversations.answer(api.name, ex.method, path, body, params, owner)
    else:
        data = await g.responses.answer(api.name, ex.method, path.split("/")[3], params, owner)
    return ex.reply(200, {"x-request-id": st.request_id, "x-shapegate-reason": st.reason}, data)
