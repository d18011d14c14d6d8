"""Backend health: the active probe state machine, the passive circuit breaker, and the probe and load loops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Callable, Final

import aiohttp

from backends.openai_http import printable
from gateway.config import HealthConfig
from gateway.contracts import DRAINING, READY, STARTING, UNHEALTHY, ProbeResult
from gateway.fleet.probe import start_verifying, stop_verifying

log = logging.getLogger("shapegate.health")

CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half_open"
# How often the supervisors look for backends added or removed by a reload.
SUPERVISE_S: Final = 0.25
# What a not-ready log line quotes of a health answer that carries no error message.
EXCERPT_BYTES: Final = 1024
EXCERPT_CHARS: Final = 160


class Breaker:
    """Opens after consecutive failures or on an engine's Retry-After; half-open lets one trial through."""

    __slots__ = ("threshold", "open_s", "failures", "opened_until", "trial_in_flight", "last_failure", "_state",
                 "openings", "on_open", "held_until", "own_until", "backend_id")

    def __init__(self, threshold: int, open_s: float, backend_id: str = "") -> None:
        self.backend_id = backend_id  # in its log lines
        self.threshold = threshold
        self.open_s = open_s
        self.failures = 0
        self.openings = 0  # times it went from letting requests through to open (a failed trial included)
        self.opened_until = 0.0
        self.trial_in_flight = False
        self.last_failure = float("-inf")
        self._state = CLOSED
        # Called with `opened_until` each time a failure seen here opens it (other replicas are told: see
        # gateway.ops.replica_sync); it runs on the request path, so it only takes note.
        self.on_open: Callable[[float], None] | None = None
        # Another replica's opening in force here (0: none), and how long this breaker's own openings held it
        # open when it came: what it falls back to when that replica's entry goes (see end_hold).
        self.held_until = 0.0
        self.own_until = 0.0

    def state(self, now: float) -> str:
        if self._state == OPEN and now >= self.opened_until:
            self._state = HALF_OPEN
            self.trial_in_flight = False
        return self._state

    def allows(self, now: float) -> bool:
        s = self.state(now)
        return s == CLOSED or (s == HALF_OPEN and not self.trial_in_flight)

    def on_attempt(self, now: float) -> None:
        if self.state(now) == HALF_OPEN:
            self.trial_in_flight = True

    def on_success(self, started: float | None = None) -> None:
        """A request that `started` at that time succeeded (None: a probe vouches for the engine now).

        A success speaks only for the engine as it was when the request started: a long stream that
        began before the latest failure neither resets the count nor closes an open breaker, or the
        streams still finishing on a freshly hung engine would keep sending it traffic.
        """
        if started is not None and started < self.last_failure:
            return
        if self._state != CLOSED:
            log.info("backend %s recovered: %s, its circuit breaker closed", self.backend_id,
                     "a request succeeded" if started is not None else "its health probe passed")
        self.failures = 0
        self._state = CLOSED
        self.trial_in_flight = False

    def on_failure(self, now: float, hold_s: float | None = None) -> None:
        """A failure; `hold_s` (an engine's Retry-After, or a refused connection) opens at once for that long."""
        self.failures += 1
        self.last_failure = now
        if hold_s is not None or self._state == HALF_OPEN or self.failures >= self.threshold:
            opening = self._state != OPEN or now >= self.opened_until  # a failure while open is no new opening
            if opening:
                self.openings += 1
            self._state = OPEN
            # A longer hold already in force (an engine's Retry-After) is never shortened by a later failure.
            self.opened_until = max(self.opened_until, now + (hold_s if hold_s is not None else self.open_s))
            self.trial_in_flight = False
            if opening:  # once per opening (at most once per open_s): what an operator acts on, never per request
                why = ("it asked to wait (Retry-After) or refused the connection" if hold_s is not None
                       else f"{self.failures} failed request(s) in a row")
                log.warning("backend %s is failing: %s; its circuit breaker is open for %.1f s", self.backend_id,
                            why, self.opened_until - now)
            if opening and self.on_open is not None:
                self.on_open(self.opened_until)

    def hold(self, until: float, now: float) -> bool:
        """Another replica's breaker opened on this engine: stay open until `until` as if it had opened here,
        then let one trial through as usual. Not counted among this breaker's openings and never passed on
        (no echo between replicas); False when it was already open for at least that long."""
        if self.state(now) == OPEN and self.opened_until >= until:
            return False
        if not self._held(now):  # (a hold that replaces another keeps what was there before the first)
            self.own_until = self.opened_until if self._state == OPEN else 0.0
        self._state = OPEN
        self.opened_until = max(self.opened_until, until)
        self.held_until = self.opened_until
        self.trial_in_flight = False
        # Requests already running here that then succeed must not close it: they started before the news.
        self.last_failure = max(self.last_failure, now)
        return True

    def _held(self, now: float) -> bool:
        return self.held_until > 0.0 and self.state(now) == OPEN and self.opened_until == self.held_until

    def end_hold(self, now: float) -> bool:
        """The other replica's entry that held it open is gone: its hold ends now, as if it had run out (back to
        this breaker's own opening if one is still in force, else a half-open trial). False when nothing was
        held, or an opening of its own since holds it longer. A failure seen here during the hold that did not
        hold it longer is left to that trial to find again."""
        if not self._held(now):
            self.held_until = 0.0
            return False
        self.held_until = 0.0
        self.opened_until = max(self.own_until, now)
        return True

    def release(self) -> None:
        """The attempt ended with no verdict on the engine (client left, cancelled): free the trial slot."""
        self.trial_in_flight = False

    def reopens_in(self, now: float) -> float:
        """Seconds until this breaker admits a request again (0 when it does now)."""
        return max(self.opened_until - now, 0.0) if self.state(now) == OPEN else 0.0


class HealthState:
    """Probe-driven state of one backend: starting -> ready <-> unhealthy; draining when removed.

    Every method takes `now` so that tests drive it with a fake clock.
    """

    __slots__ = ("state", "ok_streak", "fail_streak", "detail", "changed_at", "reported")

    def __init__(self, now: float | None = None) -> None:
        self.state = STARTING
        self.ok_streak = 0
        self.fail_streak = 0
        self.detail = "not probed yet"
        self.changed_at = time.monotonic() if now is None else now
        self.reported = ""  # the kind of cause last logged for a start that overran its grace ("": none)

    def _set(self, state: str, now: float) -> str | None:
        if state == self.state:
            return None
        self.state = state
        self.changed_at = now
        return state

    def promotes(self, r: ProbeResult, cfg: HealthConfig) -> bool:
        """Whether this good probe would make the backend ready (the caller warms it up first)."""
        return (r.ok and not r.liveness_only and self.state in (STARTING, UNHEALTHY)
                and self.ok_streak + 1 >= cfg.healthy_threshold)

    def on_probe(self, r: ProbeResult, cfg: HealthConfig, now: float) -> str | None:
        """Apply one probe result; returns the new state when it changed."""
        if self.state == DRAINING:
            return None
        self.detail = r.detail
        if r.ok:
            self.fail_streak = 0
            if r.liveness_only:
                return None  # a liveness answer says "alive", never "ready"
            self.ok_streak += 1
            if self.state == READY or self.ok_streak < cfg.healthy_threshold:
                return None
            return self._set(READY, now)
        self.ok_streak = 0
        self.fail_streak += 1
        if self.state == STARTING and (r.refused or r.status == 503):
            return None  # refused or 503 while starting means "still loading" (vLLM, SGLang, llama.cpp)
        if self.state == READY and r.refused:
            return self._set(UNHEALTHY, now)  # nothing listens any more: the process is gone, act at once
        if self.fail_streak >= cfg.unhealthy_threshold:
            return self._set(UNHEALTHY, now)
        return None

    def next_delay(self, cfg: HealthConfig) -> float:
        """Ready backends are probed every interval; failing ones back off exponentially up to a cap."""
        if self.fail_streak == 0:
            return cfg.interval_s
        return min(cfg.interval_s * 2.0 ** (self.fail_streak - 1), max(cfg.backoff_max_s, cfg.interval_s))

    def drain(self, now: float | None = None) -> None:
        self._set(DRAINING, time.monotonic() if now is None else now)


async def probe_loop(pool, health_cfg: Callable[[], HealthConfig], on_change=None) -> None:
    """One watcher task per backend, so a slow probe (SGLang's generation) never delays another backend's."""
    watchers: dict[object, asyncio.Task] = {}
    try:
        while True:
            pool.sweep_drained()
            live = {b for b in pool.all() if b.health.state != DRAINING}
            for b in live:
                w = watchers.get(b)
                if w is not None and w.done():
                    # A watcher never ends on its own; if one died, say why and start it again.
                    log.error("probe watcher of %s stopped: %r", b.id, w.exception())
                    w = None
                if w is None:
                    watchers[b] = asyncio.create_task(watch(pool, b, health_cfg, on_change), name=f"probe-{b.id}")
            for b in [b for b in watchers if b not in live]:
                watchers.pop(b).cancel()
            await asyncio.sleep(SUPERVISE_S)
    finally:
        await _cancel_all(watchers.values())


async def watch(pool, b, health_cfg: Callable[[], HealthConfig], on_change=None) -> None:
    """Probe one backend on its engine's cadence until cancelled."""
    next_deep = 0.0
    try:
        while True:
            cfg = health_cfg()
            now = time.monotonic()
            # SGLang's /health runs a generation: between deep probes a ready SGLang only gets a liveness check.
            deep = b.adapter.liveness_path is None or b.health.state != READY or now >= next_deep
            slow = b.adapter.deep_probe_generates and deep
            r = await b.adapter.probe(cfg.sglang_timeout_s if slow else cfg.timeout_s, deep=deep)
            if deep:
                next_deep = time.monotonic() + (cfg.sglang_interval_s if slow else cfg.interval_s)
            await apply_probe(pool, b, r, cfg, on_change)
            await asyncio.sleep(b.health.next_delay(cfg))
    finally:
        await stop_verifying(b)


async def apply_probe(pool, b, r: ProbeResult, cfg: HealthConfig, on_change=None) -> None:
    if b.health.promotes(r, cfg):
        # Before taking traffic: the models it lists (each configured one it does not is logged with the fix), how
        # long a request it holds (a restart may have changed either), and a warm-up, since an engine's first
        # requests are slow and should not be a client's.
        await b.learn_models(cfg.timeout_s)
        await b.discover_windows(cfg.timeout_s)
        if cfg.warmup:
            await b.warm_up(cfg.warmup_timeout_s)
    elif r.ok and not r.liveness_only and b.health.state == READY and (b.list_due or b.lacks):
        # After a reload, and while the engine refused a model by name: its list again (a change routes it back).
        await b.learn_models(cfg.timeout_s)
    now = time.monotonic()
    new = b.health.on_probe(r, cfg, now)
    if b.health.state == STARTING and now - b.health.changed_at >= cfg.startup_grace_s:
        await report_not_ready(b, r, cfg, now)
    if new is None:
        return
    if new == UNHEALTHY:  # what an operator acts on; its recovery is news, not a warning
        log.warning("backend %s (%s at %s) is now unhealthy: %s", b.id, b.engine, b.cfg.url, r.detail)
    else:
        log.info("backend %s is now %s (%s)", b.id, new, r.detail)
    if new == READY:
        b.breaker.on_success()  # probes say it serves again: give it traffic now, not when the breaker times out
        start_verifying(b)  # [probe] at_start: which of its models it really serves, off every request's path
    if on_change is not None:
        on_change(b, new)


def not_ready_reason(r: ProbeResult, timeout: float) -> tuple[str, str]:
    """Why a probe found a backend not ready: a kind that changes only when the cause does, and the words."""
    if r.refused:
        refused = "[Errno 111]" in r.detail or "refused" in r.detail.lower()
        return "connect", f"{'connection refused' if refused else 'cannot connect'} ({r.detail})"
    if r.status == 0:
        if r.detail == "TimeoutError":
            return "timeout", f"no answer within {timeout:g} s (timeout)"
        return r.detail, r.detail or "no answer"
    return f"HTTP {r.status}", r.detail if r.detail.startswith("HTTP ") else f"HTTP {r.status}: {r.detail}"


async def report_not_ready(b, r: ProbeResult, cfg: HealthConfig, now: float) -> None:
    """A backend still not ready after [health] startup_grace_s: say why, once per cause (not every probe)."""
    kind, why = not_ready_reason(r, cfg.timeout_s)
    if kind == b.health.reported:
        return
    b.health.reported = kind
    if r.status and why == f"HTTP {r.status}":  # no message in the answer: quote the start of what it said
        why = await health_excerpt(b, cfg.timeout_s) or why
    log.warning("backend %s (%s at %s) is not ready %.1f s after it was added: %s", b.id, b.engine, b.cfg.url,
                now - b.health.changed_at, why)


async def health_excerpt(b, timeout: float) -> str:
    """The health route's status and the start of its body, read once more for the log line (empty on failure)."""
    try:
        status, body = await b.adapter._get(b.adapter.health_path, timeout)
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        log.debug("health route of %s unread: %r", b.id, e)
        return ""
    text = printable(" ".join(body[:EXCERPT_BYTES].decode("utf-8", "replace").split()), EXCERPT_CHARS)
    return f"HTTP {status}: {text}" if text else f"HTTP {status} (empty body)"


async def load_loop(pool, health_cfg: Callable[[], HealthConfig]) -> None:
    """Scrape each ready backend's load at a sub-second cadence, each on its own task.

    A scrape that fails or hangs leaves the old sample in place; once it is older than
    `load_stale_s` the pool stops showing it to policies and to admission control (see pool.py).
    """
    scrapes: dict[object, asyncio.Task] = {}
    try:
        while True:
            cfg = health_cfg()
            for b in pool.all():
                t = scrapes.get(b)
                if b.health.state == READY and (t is None or t.done()):
                    scrapes[b] = asyncio.create_task(scrape_one(b, cfg), name=f"load-{b.id}")
            for b in [b for b, t in scrapes.items() if t.done()]:
                del scrapes[b]
            await asyncio.sleep(cfg.load_interval_s)
    finally:
        await _cancel_all(scrapes.values())


async def scrape_one(b, cfg: HealthConfig) -> None:
    try:
        sample = await b.adapter.sample_load(min(cfg.timeout_s, cfg.load_stale_s))
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
        log.debug("load scrape of %s failed: %r", b.id, e)  # the next scrape tries again
        return
    if sample is not None:
        b.take_load(sample)


async def _cancel_all(tasks) -> None:
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
