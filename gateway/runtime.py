"""The long-lived objects of one running gateway, and the small services the pipeline calls on them."""

from __future__ import annotations

import logging
import os
import secrets
import select
import sys
import time
from typing import Any, Callable, Mapping

import aiohttp
import orjson

import backends
import policies
from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.contracts import Outcome, Policy, RequestShape
from gateway.headers import safe_value
from gateway.metrics import Metrics
from gateway.pipeline import RequestState
from gateway.pool import BackendState, Pool
from gateway.state import AffinityIndex
from gateway.stats import OutputEstimator

SAFE_UPSTREAM_HEADERS = ("content-type",)
MAX_PENDING_LINES = 50_000  # access-log lines held while stdout does not take them; the oldest go first
log = logging.getLogger("shapegate")


def build_policy(name: str, params: Mapping[str, Any]) -> Policy:
    try:
        cls, params_model = policies.REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(policies.REGISTRY))}") from None
    return cls(params_model.model_validate(dict(params)))


class AccessLog:
    """One JSON line per request, batched, and written to stdout without ever blocking the loop."""

    def __init__(self, enabled: bool, stream=None, on_drop: Callable[[int], None] | None = None) -> None:
        self.enabled = enabled
        self._stream = stream or sys.stdout
        self._lines: list[bytes] = []
        self._rest = b""  # the unwritten tail of a partial write; goes out first
        self._fd: int | None = None
        self._was_blocking = True
        self._on_drop = on_drop

    def write(self, entry: dict) -> None:
        if self.enabled:
            self._lines.append(orjson.dumps(entry))
            if len(self._lines) >= 256:
                self.flush()

    def _fileno(self) -> int | None:
        if self._fd is None:
            try:
                self._fd = self._stream.fileno()
            except (AttributeError, OSError, ValueError):
                self._fd = -1  # an in-memory stream (tests)
            else:
                # A full pipe must not stall the loop: lines wait in memory and go out on a later flush.
                self._was_blocking = os.get_blocking(self._fd)
                os.set_blocking(self._fd, False)
        return self._fd if self._fd >= 0 else None

    def flush(self) -> None:
        if not self._lines and not self._rest:
            return
        fd = self._fileno()
        if fd is None:
            self._stream.write(b"".join(x + b"\n" for x in self._lines).decode())
            self._stream.flush()
            self._lines.clear()
            return
        lines, i = self._lines, 0
        try:
            if self._rest:
                self._rest = self._rest[os.write(fd, self._rest):]
            while i < len(lines) and not self._rest:
                # Writes of up to PIPE_BUF bytes are atomic on a pipe: workers sharing stdout never split a line.
                j, size = i + 1, len(lines[i]) + 1
                while j < len(lines) and size + len(lines[j]) + 1 <= select.PIPE_BUF:
                    size += len(lines[j]) + 1
                    j += 1
                data = b"\n".join(lines[i:j]) + b"\n"
                self._rest = data[os.write(fd, data):]
                i = j
        except BlockingIOError:
            pass  # stdout is full: the rest waits for the next flush
        except OSError as e:
            log.error("access log disabled: stdout refused a write (%s)", e)
            self.enabled, self._rest, i = False, b"", len(lines)
        del lines[:i]
        if len(lines) > MAX_PENDING_LINES:
            dropped = len(lines) - MAX_PENDING_LINES
            del lines[:dropped]
            if self._on_drop is not None:
                self._on_drop(dropped)

    def close(self) -> None:
        """Last flush at shutdown: wait for stdout rather than lose the final lines; leave stdout as it was."""
        if self._lines or self._rest:
            fd = self._fileno()
            if fd is not None:
                os.set_blocking(fd, True)
            self.flush()
        if self._fd is not None and self._fd >= 0:
            os.set_blocking(self._fd, self._was_blocking)


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
        # Prefix/session -> backend. Always built (empty it costs nothing), used only while some policy
        # needs it, so that a reload that switches to such a policy finds it ready.
        self.affinity_index = AffinityIndex(max_entries=cfg.state.affinity_max_entries,
                                            ttl_s=cfg.state.affinity_ttl_s, block_chars=cfg.shape.prefix_block_chars,
                                            shared=cfg.state.backend == "redis")
        self.pool = Pool([])
        self.metrics = Metrics(self.pool.all)
        self.estimator = OutputEstimator()
        self.access_log = AccessLog(cfg.server.access_log, on_drop=self.metrics.log_drop)
        self.request_ids = RequestIds()
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

    @property
    def affinity(self) -> AffinityIndex | None:
        """The affinity index while some policy uses it (hashing and recording prompts costs CPU otherwise)."""
        return self.affinity_index if self.wants_prefix else None

    def policy_for(self, model: str) -> Policy:
        return self.model_policies.get(model, self.default_policy)

    def policy_name(self, model: str) -> str:
        m = self.cfg.routing.models.get(model)
        return (m.policy if m is not None else None) or self.cfg.routing.policy

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
        return h

    # -- record stage ----------------------------------------------------------------------------
    def record(self, b: BackendState, shape: RequestShape, o: Outcome, t_in: float, t_upstream: float) -> None:
        if self.cfg.stats.enabled:
            now = time.monotonic()
            load = b.load
            b.latency.learn(o, now, ready_since=b.health.changed_at, running_end=b.in_flight,
                            slots=load.total_slots if load is not None else None)
            b.stats.add(o, now)
            self.metrics.observe(b.id, shape.model, shape.klass, o.status, o.ttft, o.itl, o.e2e,
                                 o.prompt_tokens, o.completion_tokens, t_upstream - t_in)
        else:
            self.metrics.count(b.id, shape.model, shape.klass, o.status, o.prompt_tokens, o.completion_tokens)
        policy = self.policy_for(shape.model)
        policy.observe(o)
        if self.affinity is not None and o.ok:
            self.affinity.record(shape, b.id)
        if o.ok and shape.output_tokens and o.completion_tokens and shape.route != "embeddings":
            self.estimator.learn(shape.principal, shape.model, o.completion_tokens)

    def log_request(self, st: RequestState, status: int) -> None:
        """The request's one access-log line, whatever its ending: served, failed over, refused, client gone."""
        if not self.access_log.enabled:
            return
        shape, o, principal = st.shape, st.outcome, st.principal
        line = {"ts": round(time.time(), 3), "request_id": st.request_id,
                "principal": principal.id if principal is not None else None,
                "model": None, "class": None, "backend": st.backend or None, "reason": st.reason or None,
                "status": status, "stream": None, "ttft_ms": None, "itl_ms": None, "e2e_ms": None,
                "prompt_tokens": None, "completion_tokens": None}
        if shape is not None:
            line["model"], line["class"], line["stream"] = shape.model, shape.klass, shape.stream
        if o is not None:
            if status == 200 and not o.ok:
                line["status"] = o.status  # the stream had started (200 sent), then failed
            line["ttft_ms"], line["itl_ms"], line["e2e_ms"] = _ms(o.ttft), _ms(o.itl), _ms(o.e2e)
            line["prompt_tokens"], line["completion_tokens"] = o.prompt_tokens, o.completion_tokens
        self.access_log.write(line)


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
        # What the latency model predicts right now for each class's typical prompt (queue wait aside).
        for s in (rep["overall"], *rep["classes"].values()):
            s["predicted"] = _predicted(est, s["prompt_tokens_p50"], b.in_flight)
        rows.append({
            "id": b.id, "engine": b.engine, "health": b.health.state, "breaker": b.breaker.state(now_m),
            "in_flight": b.in_flight,
            "load": {"running": load.running if load else None, "waiting": load.waiting if load else None,
                     "kv_usage": load.kv_usage if load else None, "idle_slots": load.idle_slots if load else None,
                     "fresh": load is not None},
            **rep,
            "model": {"ttft_t0_ms": round(est.ttft_t0 * 1000, 3), "prefill_tps": round(est.prefill_rate, 1),
                      "itl_a_ms": round(est.itl_a * 1000, 3), "itl_b_ms": round(est.itl_b * 1000, 4),
                      "ttft_per_running_ms": round(est.ttft_per_running * 1000, 4),
                      "service_ms": round(est.service_s * 1000, 3), "samples": est.samples},
        })
        for klass, s in rep["classes"].items():
            m = mix.setdefault(klass, {"requests": 0, "share": 0.0, "backends": {}})
            m["requests"] += s["requests"]
            m["backends"][b.id] = s["requests"]
    total = sum(r["overall"]["requests"] for r in rows)
    errors = sum(r["overall"]["requests"] * r["overall"]["error_rate"] for r in rows)
    for m in mix.values():
        m["share"] = m["requests"] / total if total else 0.0
    return {"now": time.time(), "window_s": window, "enabled": gw.cfg.stats.enabled, "backends": rows,
            "classes": mix,
            "totals": {"requests": total, "rps": sum(r["overall"]["rps"] for r in rows),
                       "error_rate": errors / total if total else 0.0,
                       "in_flight": sum(r["in_flight"] for r in rows)}}


def _predicted(est, prompt_tokens: float | None, running: int) -> dict:
    n = prompt_tokens or 0
    return {"prompt_tokens": n, "ttft_ms": _ms(est.ttft(n, running=running)), "itl_ms": _ms(est.itl(running + 1))}
