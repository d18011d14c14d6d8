"""The long-lived objects of one running gateway, and the small services the pipeline calls on them."""

from __future__ import annotations

import os
import secrets
import sys
import time
from typing import Any, Mapping

import aiohttp
import orjson
from aiohttp import web

import backends
import policies
from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.contracts import Outcome, Policy, RequestShape
from gateway.metrics import Metrics
from gateway.pipeline import BACKEND, REASON, REQUEST_ID
from gateway.pool import BackendState, Pool
from gateway.shape import session_of
from gateway.state import AffinityIndex
from gateway.stats import OutputEstimator

SAFE_UPSTREAM_HEADERS = ("content-type",)


def build_policy(name: str, params: Mapping[str, Any]) -> Policy:
    try:
        cls, params_model = policies.REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(policies.REGISTRY))}") from None
    return cls(params_model.model_validate(dict(params)))


class AccessLog:
    """One JSON line per request, batched so the loop never waits on stdout per request."""

    def __init__(self, enabled: bool, stream=None) -> None:
        self.enabled = enabled
        self._stream = stream or sys.stdout
        self._lines: list[bytes] = []

    def write(self, entry: dict) -> None:
        if self.enabled:
            self._lines.append(orjson.dumps(entry))
            if len(self._lines) >= 256:
                self.flush()

    def flush(self) -> None:
        if self._lines:
            data = b"\n".join(self._lines) + b"\n"
            self._lines.clear()
            out = getattr(self._stream, "buffer", None)
            if out is not None:
                out.write(data)
            else:
                self._stream.write(data.decode())
            self._stream.flush()


class Gateway:
    """Pool, policies, auth, stats and metrics of one gateway process."""

    def __init__(self, cfg: GatewayConfig, session: aiohttp.ClientSession | None = None) -> None:
        self.cfg = cfg
        self.session = session
        self.auth = Authenticator(cfg.auth)
        self.default_policy = build_policy(cfg.routing.policy, cfg.routing.params)
        self.model_policies = {name: build_policy(m.policy or cfg.routing.policy, m.params)
                               for name, m in cfg.routing.models.items()}
        self.wants_prefix = any(getattr(p, "needs_prefix", False)
                                for p in (self.default_policy, *self.model_policies.values()))
        # Prefix/session -> backend, only when some policy uses it (hashing prompts costs CPU otherwise).
        self.affinity = AffinityIndex(max_entries=cfg.state.affinity_max_entries, ttl_s=cfg.state.affinity_ttl_s,
                                      block_chars=cfg.shape.prefix_block_chars,
                                      shared=cfg.state.backend == "redis") if self.wants_prefix else None
        self.pool = Pool([])
        self.metrics = Metrics(self.pool.all)
        self.estimator = OutputEstimator()
        self.access_log = AccessLog(cfg.server.access_log)
        self.started = int(time.time())
        self._sessions: dict[str, int] = {}
        # Shutdown: `stopping` turns /readyz false; `cutting` marks the end of the grace period, when
        # streams still running (their handler tasks are in `streams`) are ended with an error event.
        self.stopping = False
        self.cutting = False
        self.streams: set = set()

    def attach(self, session: aiohttp.ClientSession) -> None:
        """Create the backend adapters on the shared client session."""
        self.session = session
        for bc in self.cfg.backends:
            self.pool.add(self.make_backend(bc))

    def make_backend(self, bc) -> BackendState:
        api_key = os.environ.get(bc.api_key_env) if bc.api_key_env else None
        adapter = backends.REGISTRY[bc.engine](
            id=bc.id, url=bc.url, session=self.session, api_key=api_key,
            connect_timeout=self.cfg.upstream.connect_timeout_s, idle_timeout=self.cfg.upstream.idle_timeout_s,
            pool_limit=self.cfg.upstream.pool_limit_per_backend, keepalive_s=self.cfg.upstream.keepalive_s)
        return BackendState(bc, adapter, self.cfg)

    def policy_for(self, model: str) -> Policy:
        return self.model_policies.get(model, self.default_policy)

    # -- sessions: how many requests of one session are in flight (interactive = one at a time) --
    def session_load(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> int:
        sid = session_of(body, headers)
        return self._sessions.get(sid, 0) if sid else 0

    def session_enter(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
        sid = session_of(body, headers)
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
    def reply_headers(self, request: web.Request, upstream: Mapping[str, str]) -> dict[str, str]:
        h = {k: upstream[k] for k in SAFE_UPSTREAM_HEADERS if k in upstream}
        h["x-request-id"] = request[REQUEST_ID]
        h["x-shapegate-backend"] = request.get(BACKEND, "")
        h["x-shapegate-reason"] = request.get(REASON, "")
        return h

    # -- record stage ----------------------------------------------------------------------------
    def record(self, request: web.Request, b: BackendState, shape: RequestShape, o: Outcome,
               t_in: float, t_upstream: float) -> None:
        now = time.monotonic()
        load = b.load
        b.latency.learn(o, now, ready_since=b.health.changed_at, running_end=b.in_flight,
                        slots=load.total_slots if load is not None else None)
        b.stats.add(o, now)
        policy = self.policy_for(shape.model)
        policy.observe(o)
        if self.affinity is not None and o.ok:
            self.affinity.record(shape, b.id)
        if o.ok and shape.output_tokens and o.completion_tokens and shape.route != "embeddings":
            self.estimator.learn(shape.principal, shape.model, o.completion_tokens)
        self.metrics.observe(b.id, shape.model, shape.klass, o.status, o.ttft, o.itl, o.e2e,
                             o.prompt_tokens, o.completion_tokens, t_upstream - t_in)
        if self.access_log.enabled:
            self.access_log.write({
                "ts": round(time.time(), 3), "request_id": request.get(REQUEST_ID),
                "principal": shape.principal, "model": shape.model, "class": shape.klass,
                "backend": b.id, "reason": request.get(REASON), "status": o.status, "stream": shape.stream,
                "ttft_ms": _ms(o.ttft), "itl_ms": _ms(o.itl), "e2e_ms": _ms(o.e2e),
                "prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens})


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


class RequestIds:
    """Unique request ids without a syscall each: a random per-process prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(6)
        self._n = 0

    def next(self) -> str:
        self._n += 1
        return f"{self._prefix}{self._n:010x}"


def stats_report(gw: Gateway) -> dict:
    """The JSON feed behind /stats and the dashboard: rolling per-backend and per-class figures."""
    now_m, window = time.monotonic(), gw.cfg.stats.window_s
    rows, mix = [], {}
    for b in gw.pool.all():
        rep = b.stats.report(now_m, window)
        load = b.fresh_load(now_m)
        est = b.latency.estimate()
        rows.append({
            "id": b.id, "engine": b.engine, "health": b.health.state, "breaker": b.breaker.state(now_m),
            "in_flight": b.in_flight,
            "load": {"running": load.running if load else None, "waiting": load.waiting if load else None,
                     "kv_usage": load.kv_usage if load else None, "idle_slots": load.idle_slots if load else None,
                     "fresh": load is not None},
            **rep,
            "model": {"ttft_t0_ms": round(est.ttft_t0 * 1000, 3), "prefill_tps": round(est.prefill_rate, 1),
                      "itl_a_ms": round(est.itl_a * 1000, 3), "itl_b_ms": round(est.itl_b * 1000, 4),
                      "samples": est.samples},
        })
        for klass, s in rep["classes"].items():
            m = mix.setdefault(klass, {"requests": 0, "share": 0.0, "backends": {}})
            m["requests"] += s["requests"]
            m["backends"][b.id] = s["requests"]
    total = sum(r["overall"]["requests"] for r in rows)
    errors = sum(r["overall"]["requests"] * r["overall"]["error_rate"] for r in rows)
    for m in mix.values():
        m["share"] = m["requests"] / total if total else 0.0
    return {"now": time.time(), "window_s": window, "backends": rows, "classes": mix,
            "totals": {"requests": total, "rps": total / window, "error_rate": errors / total if total else 0.0,
                       "in_flight": sum(r["in_flight"] for r in rows)}}
