"""Admission control: when every candidate backend is saturated, refuse at once with Retry-After."""

from __future__ import annotations

from gateway.config import AdmissionConfig
from gateway.errors import overloaded


def enabled(cfg: AdmissionConfig) -> bool:
    return cfg.max_waiting is not None or cfg.max_in_flight is not None or bool(cfg.slot_classes)


def saturated(b, klass: str, now: float, cfg: AdmissionConfig) -> bool:
    """Whether one backend should take no more requests of this class right now.

    The gateway's own in-flight count is always current. Engine figures come from the last load
    scrape and are used only while fresh: a stale sample says nothing, so a backend is then judged
    by the in-flight bound alone (fail open rather than refuse on old news).
    """
    if cfg.max_in_flight is not None and b.in_flight >= cfg.max_in_flight:
        return True
    load = b.fresh_load(now)
    if load is None:
        return False
    if cfg.max_waiting is not None and load.waiting is not None and load.waiting > cfg.max_waiting:
        return True
    if load.idle_slots is not None and klass in cfg.slot_classes:
        # Correct the sample by what the gateway itself started or finished since it was taken.
        idle = load.idle_slots + b.load_in_flight - b.in_flight
        if load.total_slots is not None:
            idle = min(idle, load.total_slots - b.in_flight)
        return idle <= 0
    return False


def admit(candidates: list, model: str, klass: str, now: float, cfg: AdmissionConfig) -> list:
    """The candidates that can take the request now; raises 503 (or 429) with Retry-After when none can."""
    if not enabled(cfg):
        return candidates
    open_ = [b for b in candidates if not saturated(b, klass, now, cfg)]
    if not open_:
        raise overloaded(model, cfg.status, cfg.retry_after_s)
    return open_
