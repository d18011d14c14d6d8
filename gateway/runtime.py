"""The long-lived objects of one running gateway, and the small services the pipeline calls on them."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Any, Final, Mapping

import aiohttp
from aiohttp import web

import backends
import policies
from backends.slots import Slots
from gateway.apis.registry import BY_NAME
from gateway.config import BackendConfig, GatewayConfig
from gateway.contracts import CLIENT_ERROR, CLIENT_LEFT, OK, REJECTED, Outcome, Policy, Record, RequestShape
from gateway.experiments.experiment import ARM_HEADER, PRIMARY, Experiments
from gateway.fleet.pool import BackendState, Pool
from gateway.hot_settings import HotSettings
from gateway.http.headers import safe_value, trace_headers
from gateway.keys.auth import Authenticator
from gateway.keys.keystore import KeyStore
from gateway.limits.limiter import Limiter
from gateway.limits.redis_buckets import SharedBuckets
from gateway.observe.access_log import AccessEntry, AccessLog
from gateway.observe.metrics import Metrics
from gateway.observe.tracing import RequestRecord, RequestTracer, make_tracer
from gateway.queueing.waiting import WaitQueue
from gateway.routing.affinity import AffinityIndex
from gateway.routing.context import PromptSizer
from gateway.routing.request import ExperimentRef, RequestState
from gateway.state.conversations import ConversationsService
from gateway.state.engine_index import StoredResponses
from gateway.state.records import RecordCache
from gateway.state.redis_store import RedisStore
from gateway.state.responses import ResponsesService
from gateway.state.store import MemoryStore, Store
from gateway.stats.key_usage import KeyUsage
from gateway.stats.ledger import Ledger, tokens_of
from gateway.stats.ledger_store import Flusher, make_store
from gateway.stats.merge import group_report
from gateway.stats.rolling import OutputEstimator, Tally
from gateway.stats.share import Sharing

SAFE_UPSTREAM_HEADERS: Final = ("content-type",)
log = logging.getLogger("shapegate")


def build_policy(name: str, params: Mapping[str, Any]) -> Policy:
    """The routing policy `name` with its params. Also what gateway.config checks a configuration's policies
    with, so that an unknown name or a bad param is refused with its field's path when the file is loaded."""
    entry = policies.REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {', '.join(sorted(policies.REGISTRY))}")
    cls, params_model = entry
    return cls(params_model.model_validate(dict(params)))


def build_routing(cfg: GatewayConfig) -> tuple[Policy, dict[str, Policy]]:
    """The default policy and the per-model ones a configuration names (checked when it was loaded)."""
    r = cfg.routing
    return (build_policy(r.policy, r.params),
            {name: build_policy(m.policy or r.policy, m.params) for name, m in r.models.items()})


# Routes whose attempts teach a backend's latency model, and those whose outputs teach the output estimator.
LEARNED: Final = frozenset(name for name, api in BY_NAME.items() if api.learns)
GENERATING: Final = frozenset(name for name, api in BY_NAME.items() if api.generating)

class EndedAttempt(Record):
    """One attempt on a backend that ended, waiting for the record stage (Gateway.record_soon)."""

    FIELDS = ("backend", "shape", "outcome", "t_in", "t_upstream", "split")
    __slots__ = FIELDS
    backend: Final[BackendState]
    shape: Final[RequestShape]
    outcome: Final[Outcome]
    t_in: Final[float]  # when the request came in (perf_counter)
    t_upstream: Final[float]  # when this attempt went upstream (perf_counter)
    split: Final[ExperimentRef | None]  # the split experiment the request was assigned to

    def __init__(self, backend: BackendState, shape: RequestShape, outcome: Outcome, t_in: float,
                 t_upstream: float, split: ExperimentRef | None) -> None:
        self.backend = backend
        self.shape = shape
        self.outcome = outcome
        self.t_in = t_in
        self.t_upstream = t_upstream
        self.split = split


class Gateway:
    """Pool, policies, auth, stats and metrics of one gateway process."""

    def __init__(self, cfg: GatewayConfig, session: aiohttp.ClientSession | None = None) -> None:
        self.cfg = cfg
        self.session = session
        # Keys made at run time: kept by the gateway, not the Authenticator, so that a reload keeps them.
        self.keys = KeyStore.for_config(cfg)
        self.auth = Authenticator(cfg.auth, self.keys)
        self.set_routing(*build_routing(cfg))
        # Prefix/session -> backend. Always built (empty it costs nothing), used only while some policy
        # needs it, so that a reload that switches to such a policy finds it ready.
        self.affinity_index = AffinityIndex(max_entries=cfg.state.affinity_max_entries,
                                            ttl_s=cfg.state.affinity_ttl_s, block_chars=cfg.shape.prefix_block_chars,
                                            shared=cfg.state.backend == "redis")
        self.pool = Pool([])
        # [upstream] pool_limit: client requests in flight to all engines together (each holds a connection).
        self.upstream_slots = Slots(cfg.upstream.pool_limit)
        self.metrics = Metrics(self.pool.all, lambda: self.hot.key_ids)
        self.estimator = OutputEstimator()
        self.prompt_sizer = PromptSizer()  # how far prompt estimates are off, per model (context fits)
        self._to_record: list[EndedAttempt] = []  # attempts ended in this loop turn, recorded at its end (record_soon)
        self.access_log = AccessLog(cfg.server.access_log, on_drop=self.metrics.log_drop)
        # Per request: refusals and routing reasons by class; failovers and breaker openings folded in (/stats).
        self.tally = Tally()
        # Per key id: attempts, refusals and tokens over the window (the dashboard's keys view), bounded.
        self.key_usage = KeyUsage(cfg.stats.window_s)
        # Per key, model, API, backend and hour, kept for days (gateway/stats/ledger.py); flushed off the request
        # path by the app's loop to this process's memory or to Redis.
        self.ledger: Ledger | None = Ledger() if cfg.usage.enabled else None
        self.usage: Flusher | None = Flusher(self.ledger, make_store(cfg.state)) if self.ledger is not None else None
        # Traces ([observe] traces): None when off, and then OpenTelemetry is never imported.
        self.tracer: RequestTracer | None = make_tracer(cfg.observe)
        self.experiments = Experiments(cfg.experiments)
        self.shadow_tasks: set = set()  # copies in flight (gateway/experiments/shadow.py): cancelled at shutdown
        # The last /admin/experiments report (gateway/ops/admin_experiments.py): (its key, when, the report).
        self.experiments_cache: tuple[tuple, float, dict] | None = None
        self.sharing = Sharing(cfg.state)  # where this process's stats summary goes, and the others' come from
        self.limiter = self._limiter(cfg)
        # The state clients rely on across requests: stored responses and conversations, kept by the gateway (in
        # this process, or in Redis for every replica); or, with [responses] state = "engine", by the engines, the
        # gateway keeping only which backend holds which id (the engine index).
        st = cfg.state
        self.store: Store | None = None
        self.responses: ResponsesService | None = None
        self.conversations: ConversationsService | None = None
        self.engine_index: StoredResponses | None = None
        if cfg.responses.state == "gateway":
            shared = st.backend == "redis"
            self.store = RedisStore(cfg.responses, st) if shared else MemoryStore(cfg.responses)
            cache = RecordCache(cfg.responses.cache_bytes) if cfg.responses.cache_bytes else None
            self.responses = ResponsesService(self.store, cfg.responses, cache)
            self.conversations = ConversationsService(self.store, cfg.responses)
        else:
            self.engine_index = StoredResponses(st.stored_responses_max, st.stored_response_ttl_s,
                                                st.redis_url if st.backend == "redis" else None, st.key_prefix,
                                                st.redis_timeout_s)
        self.background_tasks: set = set()  # `background: true` responses running here (gateway/background.py)
        # Requests waiting for a seat while every backend for them is saturated ([queue]): this process's own.
        self.queue = WaitQueue(lambda: self.hot.queue, self.metrics.queue_end, self.metrics.queue_changed)
        self.request_ids = RequestIds()
        self.started = int(time.time())
        self._sessions: dict[str, int] = {}
        self._hot = HotSettings(cfg)
        # Shutdown: `stopping` turns /readyz false; `cutting` marks the end of the grace period, when
        # streams still running (their handler tasks are in `streams`) are ended with an error event.
        self.stopping = False
        self.cutting = False
        self.streams: set = set()

    def _limiter(self, cfg: GatewayConfig) -> Limiter:
        """Rate limits: in Redis when the state is (each process on its share of a limit while Redis does not
        answer: a limit over the processes it last saw publish there), else per process (one worker's share)."""
        sharing = self.sharing
        if cfg.state.backend == "redis":
            return Limiter(self.metrics, lambda: max(len(sharing.remote), 1), SharedBuckets(cfg.state, self.metrics))
        return Limiter(self.metrics, lambda: sharing.expected)

    def set_routing(self, default_policy: Policy, model_policies: dict[str, Policy]) -> None:
        """The routing policies in use (at start, and on a reload that changed [routing])."""
        self.default_policy, self.model_policies = default_policy, model_policies
        self.wants_prefix = any(getattr(p, "needs_prefix", False) for p in (default_policy, *model_policies.values()))

    def attach(self, session: aiohttp.ClientSession) -> None:
        """Create the backend adapters on the shared client session."""
        self.session = session
        for bc in self.cfg.backends:
            self.pool.add(self.make_backend(bc))

    def make_backend(self, bc: BackendConfig) -> BackendState:
        assert self.session is not None, "backends are made once the client session exists (attach)"
        api_key = os.environ.get(bc.api_key_env) if bc.api_key_env else None
        adapter = backends.REGISTRY[bc.engine](
            id=bc.id, url=bc.url, session=self.session, api_key=api_key,
            connect_timeout=self.cfg.upstream.connect_timeout_s, idle_timeout=self.cfg.upstream.idle_timeout_s,
            pool_limit=self.cfg.upstream.pool_limit_per_backend, keepalive_s=self.cfg.upstream.keepalive_s,
            shared_limit=self.upstream_slots)
        b = BackendState(bc, adapter, self.cfg)
        b.on_load = self.queue.wake  # a fresh load sample may show a seat free
        return b

    @property
    def affinity(self) -> AffinityIndex | None:
        """The affinity index while some policy uses it (hashing and recording prompts costs CPU otherwise)."""
        return self.affinity_index if self.wants_prefix else None

    def policy_for(self, model: str) -> Policy:
        return self.model_policies.get(model, self.default_policy)

    @property
    def hot(self) -> HotSettings:
        """The settings read on every request, as of the configuration now in force (a reload replaces cfg)."""
        hot = self._hot
        if hot.cfg is not self.cfg:
            hot = self._hot = HotSettings(self.cfg)
        return hot

    def policy_name(self, model: str) -> str:
        return self.hot.policy_name(model)

    # -- sessions: how many requests of one session are in flight (interactive = one at a time) --
    def session_load(self, sid: str | None) -> int:
        return self._sessions.get(sid, 0) if sid else 0

    def session_enter(self, sid: str | None) -> str | None:
        if sid:
            self._sessions[sid] = self._sessions.get(sid, 0) + 1
        return sid

    def session_exit(self, sid: str | None) -> None:
        if sid:
            n = self._sessions.get(sid, 0) - 1
            if n > 0:
                self._sessions[sid] = n
            else:
                self._sessions.pop(sid, None)

    # -- response headers ----------------------------------------------------------------------
    def reply_headers(self, st: RequestState, upstream: Mapping[str, str]) -> dict[str, str]:
        # From an allow-list only, and re-checked (the reply parser already refuses control characters).
        h = {k: upstream[k] for k in SAFE_UPSTREAM_HEADERS if k in upstream and safe_value(upstream[k])}
        h["x-request-id"] = st.request_id
        h["x-shapegate-backend"] = st.backend
        h["x-shapegate-reason"] = st.reason
        if st.split is not None or st.shadow is not None:
            arm = arm_of(st)
            if arm:  # (after a failover outside the experiment's arms, the request served no arm: no header)
                h[ARM_HEADER] = arm
        return h  # a key with limits: its x-ratelimit headers follow as lines (RequestState.limit_lines)

    # -- record stage ----------------------------------------------------------------------------
    def record_soon(self, b: BackendState, shape: RequestShape, o: Outcome, t_in: float, t_upstream: float,
                    split: ExperimentRef | None) -> None:
        """record() this attempt once the loop has run the callbacks now due, together with every attempt that ended
        meanwhile: the same code run over several outcomes in a row stays in the CPU's caches (at c=64, about 9 %
        of a non-streamed request's CPU). A request routed before then sees the stats without those outcomes, as
        if they had ended a moment later."""
        batch = self._to_record
        batch.append(EndedAttempt(b, shape, o, t_in, t_upstream, split))
        if len(batch) == 1:
            asyncio.get_running_loop().call_soon(self._record_batch)

    def _record_batch(self) -> None:
        batch, self._to_record = self._to_record, []
        for a in batch:
            try:
                self.record(a.backend, a.shape, a.outcome, a.t_in, a.t_upstream, a.split)
            except Exception as e:  # one bad record must not lose the rest of the turn's
                log.error("recording an attempt failed: %s", type(e).__name__)

    def record(self, b: BackendState, shape: RequestShape, o: Outcome, t_in: float, t_upstream: float,
               split: ExperimentRef | None = None) -> None:
        if self.hot.stats_enabled:
            now = time.monotonic()
            load = b.load
            if shape.route in LEARNED:  # (a rerank or a stored response's GET says nothing of generation speed)
                b.latency.learn(o, now, ready_since=b.health.changed_at, running_end=b.in_flight,
                                slots=load.total_slots if load is not None else None)
            b.stats.add(o, now)
            self.key_usage.add(shape.principal, o, now)
            self.metrics.observe(b.id, shape.model, shape.klass, o.status, o.ttft, o.itl, o.e2e,
                                 o.prompt_tokens, o.completion_tokens, t_upstream - t_in, o.result, shape.route)
        else:
            self.metrics.count(b.id, shape.model, shape.klass, o.status, o.prompt_tokens, o.completion_tokens,
                               o.result, shape.route)
        if split is not None:  # the request was assigned an arm: the attempt counts for its backend's arm
            arm = split.arm_of(b.id)
            if arm is not None:
                split.record(arm, shape.klass, o)
                self.metrics.experiment(split.name, arm, shape.klass, o)
        if self.affinity is not None and o.ok:
            self.affinity.record(shape, b.id)
        if o.ok and shape.output_tokens and o.completion_tokens and shape.route in GENERATING:
            self.estimator.learn(shape.principal, shape.model, o.completion_tokens)
        if self.tracer is not None:
            self.tracer.attempt(shape, b.id, o, t_upstream)

    def finish(self, st: RequestState, status: int) -> None:
        """A request's end, however it ended (served, failed over, refused, client gone): a refusal is counted
        here (each attempt on a backend was, in record), the routing reason by class, and its access-log line."""
        if st.limit is not None:
            st.limit.settle(st.outcome)  # its tokens from the usage the reply reported
        shape, result = st.shape, request_result(st.outcome, status)
        klass = shape.klass if shape is not None else ""
        if result == REJECTED:
            # A model label only for a model the gateway serves: a client's free text never becomes a series.
            model = shape.model if shape is not None and self.pool.serves(shape.model) else ""
            self.metrics.refuse(status, model, klass, st.route)
            now = time.monotonic()
            self.tally.add(("rejected", klass), now)
            if st.principal is not None and self.hot.stats_enabled:
                self.key_usage.refuse(st.principal.id, now)
        elif st.reason and shape is not None:
            kind = self.metrics.reason_kind(self.policy_name(shape.model), st.reason)
            self.tally.add(("reason", klass, kind), time.monotonic())
        if st.tap is not None:
            st.tap.close(st.outcome)  # the shadow copy's comparison may start
        if self.ledger is not None and st.principal is not None:
            self._count_usage(self.ledger, st, st.principal.id, result)
        if self.tracer is not None:
            self._trace(self.tracer, st, status, result)
        if self.access_log.enabled:
            x = st.split or (st.shadow[0] if st.shadow is not None else None)
            self.access_log.add(AccessEntry(time.time(), st.request_id,
                                            st.principal.id if st.principal is not None else None,
                                            st.shape, st.backend, st.reason, status, result, st.outcome,
                                            x.name if x is not None else None, arm_of(st) if x is not None else None,
                                            st.route))

    def _count_usage(self, ledger: Ledger, st: RequestState, key: str, result: str) -> None:
        """The request in the usage ledger: served at its last attempt's backend, or refused before any."""
        shape = st.shape
        if st.outcome is not None:
            ledger.served(key, st.outcome.shape.model, st.route, st.outcome)
        elif result == REJECTED:
            # A model only when the gateway serves it: a client's free text never becomes a row.
            ledger.refused(key, shape.model if shape is not None and self.pool.serves(shape.model) else "", st.route)

    def _trace(self, tracer: RequestTracer, st: RequestState, status: int, result: str) -> None:
        o = st.outcome
        tracer.request(RequestRecord(
            st.request_id, st.route, st.ex.method, st.shape, st.principal.id if st.principal is not None else None,
            st.reason, status, result, st.t_in, time.perf_counter(), trace_headers(st.ex.headers),
            tokens_of(o, st.route) if o is not None else (0, 0, 0)))


# Where an app keeps its gateway (gateway/app.py puts it there; routes, ops and the CLI find it).
GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway")


def request_result(o: Outcome | None, status: int) -> str:
    """How a request ended, one of gateway.contracts.RESULTS: its last attempt's result when a backend was
    tried, else the client's doing (gone: 499; its own 4xx) or the gateway's refusal (429, 503, any 5xx)."""
    if o is not None:
        return o.result
    if status == 499:
        return CLIENT_LEFT
    if status < 400:
        return OK
    if status < 500 and status != 429:
        return CLIENT_ERROR
    return REJECTED


def arm_of(st: RequestState) -> str:
    """The arm that served a request under experiment: its backend's arm in a split, else the primary."""
    if st.split is not None:
        return st.split.arm_of(st.backend) or ""
    return PRIMARY


class RequestIds:
    """Unique request ids without a syscall each: a random per-process prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(6)
        # The counter's 10 hex digits, zero-padded, are hex()'s digits after "0x1": a third of what a format
        # spec costs. Unique for 2**40 requests a process.
        self._n = 1 << 40

    def next(self) -> str:
        self._n += 1
        return self._prefix + hex(self._n)[3:]


def stats_report(gw: Gateway) -> dict:
    """The JSON feed behind /stats and the dashboard: rolling per-backend and per-class figures of this
    process group (every worker of `serve --workers N`, merged; see gateway.stats.merge)."""
    return group_report(gw)
