"""Backend health: the active probe state machine and the passive circuit breaker, fed into one verdict."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from gateway.config import HealthConfig
from gateway.contracts import DRAINING, READY, STARTING, UNHEALTHY, ProbeResult

log = logging.getLogger("shapegate.health")

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class Breaker:
    """Opens after consecutive failures or on an engine's Retry-After; half-open lets one trial through."""

    __slots__ = ("threshold", "open_s", "failures", "opened_until", "trial_in_flight", "_state")

    def __init__(self, threshold: int, open_s: float) -> None:
        self.threshold = threshold
        self.open_s = open_s
        self.failures = 0
        self.opened_until = 0.0
        self.trial_in_flight = False
        self._state = CLOSED

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

    def on_success(self) -> None:
        self.failures = 0
        self._state = CLOSED
        self.trial_in_flight = False

    def on_failure(self, now: float, hold_s: float | None = None) -> None:
        """A failure; `hold_s` (an engine's Retry-After, or a refused connection) opens at once for that long."""
        self.failures += 1
        if hold_s is not None or self._state == HALF_OPEN or self.failures >= self.threshold:
            self._state = OPEN
            self.opened_until = now + (hold_s if hold_s is not None else self.open_s)
            self.trial_in_flight = False


class HealthState:
    """Probe-driven state of one backend: starting -> ready <-> unhealthy; draining when removed."""

    __slots__ = ("state", "ok_streak", "fail_streak", "detail", "changed_at")

    def __init__(self) -> None:
        self.state = STARTING
        self.ok_streak = 0
        self.fail_streak = 0
        self.detail = "not probed yet"
        self.changed_at = time.monotonic()

    def _set(self, state: str) -> bool:
        if state == self.state:
            return False
        self.state = state
        self.changed_at = time.monotonic()
        return True

    def on_probe(self, r: ProbeResult, cfg: HealthConfig) -> str | None:
        """Apply one probe result; returns the new state when it changed."""
        if self.state == DRAINING:
            return None
        self.detail = r.detail
        if r.ok:
            self.ok_streak += 1
            self.fail_streak = 0
            if self.state != READY and self.ok_streak >= cfg.healthy_threshold:
                return READY if self._set(READY) else None
            return None
        self.ok_streak = 0
        self.fail_streak += 1
        # Refused while starting means "still loading" (vLLM, SGLang), not dead.
        if self.state == STARTING and (r.refused or r.status == 503):
            return None
        if self.fail_streak >= cfg.unhealthy_threshold or self.state == STARTING:
            return UNHEALTHY if self._set(UNHEALTHY) else None
        return None

    def drain(self) -> None:
        self._set(DRAINING)


async def probe_loop(pool, cfg: HealthConfig) -> None:
    """Probe every backend on its engine's cadence until cancelled."""
    while True:
        backends = [b for b in pool.all() if b.health.state != DRAINING]
        now = time.monotonic()
        due = [b for b in backends if now >= b.next_probe]
        if due:
            await asyncio.gather(*(probe_one(pool, b, cfg) for b in due))
        await asyncio.sleep(min(cfg.interval_s, 0.25))


async def probe_one(pool, b, cfg: HealthConfig) -> None:
    slow = b.adapter.engine == "sglang"  # SGLang's /health runs a generation: probe it less often
    timeout = cfg.sglang_timeout_s if slow else cfg.timeout_s
    r = await b.adapter.probe(timeout)
    b.next_probe = time.monotonic() + (cfg.sglang_interval_s if slow and r.ok else cfg.interval_s)
    new = b.health.on_probe(r, cfg)
    if new is None:
        return
    log.info("backend %s is now %s (%s)", b.id, new, r.detail)
    if new == READY:
        if cfg.warmup:
            await b.warm_up()
        b.breaker.on_success()
    pool.on_health_change(b)


async def load_loop(pool, cfg: HealthConfig) -> None:
    """Scrape each ready backend's load at a sub-second cadence; a failed scrape leaves the old sample to go stale."""
    while True:
        ready = [b for b in pool.all() if b.health.state == READY]
        if ready:
            await asyncio.gather(*(scrape_one(b, cfg) for b in ready))
        await asyncio.sleep(cfg.load_interval_s)


async def scrape_one(b, cfg: HealthConfig) -> None:
    try:
        sample = await b.adapter.sample_load(cfg.timeout_s)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
        log.debug("load scrape of %s failed: %r", b.id, e)  # the next scrape tries again
        return
    if sample is not None:
        b.load = sample
