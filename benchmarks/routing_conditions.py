"""The routing benchmark's check on its simulated engines: a run whose engines fell behind their model is rejected."""

from __future__ import annotations

# A run whose simulated engines delivered more than this share of their steps over 2 ms late ran
# slower engines than the profiles describe: it is rejected and run again.
LATE_LIMIT = 0.05
# An engine that ran fewer steps than this (one that a policy hardly used) decides nothing: a
# handful of late steps would be a large share.
MIN_STEPS = 100


def late_verdict(health: dict) -> tuple[float | None, bool]:
    """(worst late-step share among engines that ran enough steps, whether the run is rejected)."""
    shares = [h["late_share"] for h in health.values() if h is not None and h["steps"] >= MIN_STEPS]
    worst = max(shares, default=None)
    missing = any(h is None for h in health.values())  # an engine that did not answer /sim/state
    return worst, missing or (worst is not None and worst > LATE_LIMIT)
