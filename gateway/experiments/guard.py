"""The error guard of a split experiment: an arm whose engine errors climb above another arm's is stopped."""

from __future__ import annotations

import math
import time
from typing import Final, Mapping

# Rates are taken over an arm's recent requests: from the start of its previous window of this many (or of
# error_guard_min_requests, if more) to now, so between one and two windows. An arm that served well for hours
# and then starts failing is judged on what it does now, not diluted by its past.
WINDOW: Final = 500
# The excess must also be beyond chance (a two-proportion z-test at 3 standard errors, about 1 in 700 for one
# look): a few unlucky errors among 50 requests must not stop an arm whose engine is as good as the other's.
Z: Final = 3.0


class Stop:
    """Why and when the guard stopped an arm, with the figures it judged on."""

    __slots__ = ("arm", "at", "errors", "requests", "other", "other_errors", "other_requests", "margin")

    def __init__(self, arm: str, at: float, errors: int, requests: int, other: str, other_errors: int,
                 other_requests: int, margin: float) -> None:
        self.arm, self.at, self.errors, self.requests = arm, at, errors, requests
        self.other, self.other_errors, self.other_requests, self.margin = other, other_errors, other_requests, margin

    def reason(self) -> str:
        return (f"{_pct(self.errors / self.requests)} engine errors over its last {self.requests} requests against "
                f"{_pct(self.other_errors / self.other_requests)} on arm {self.other} (last {self.other_requests}): "
                f"more than the {_pct(self.margin)} margin")

    def as_dict(self) -> dict:
        return {"at": round(self.at, 3), "reason": self.reason(), "error_rate": round(self.errors / self.requests, 4),
                "requests": self.requests, "against": self.other,
                "against_error_rate": round(self.other_errors / self.other_requests, 4), "margin": self.margin}


def _pct(v: float) -> str:
    return f"{v * 100:.3g} %"


def shared_stop(d: object) -> dict | None:
    """A stop as another process shared it (Stop.as_dict), rebuilt from its checked fields; None when it is not
    one (that process's data is taken as no stop rather than shown as it came)."""
    if not isinstance(d, dict):
        return None
    numbers: list[float] = []
    for k in ("at", "error_rate", "against_error_rate", "margin"):
        v = d.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        numbers.append(float(v))
    requests, against, reason = d.get("requests"), d.get("against"), d.get("reason")
    if not (all(0 <= v <= 1 for v in numbers[1:]) and isinstance(requests, int) and not isinstance(requests, bool)
            and requests > 0 and isinstance(against, str) and 0 < len(against) <= 64
            and isinstance(reason, str) and len(reason) <= 400):
        return None
    return {"at": d["at"], "reason": reason, "error_rate": d["error_rate"], "requests": requests,
            "against": against, "against_error_rate": d["against_error_rate"], "margin": d["margin"]}


class ErrorGuard:
    """Judges the arms of one split experiment on their recent engine error rates.

    It reads the counts the arms keep anyway (requests and engine errors of the `all` class) and is asked only
    when an arm has just had an engine error, the one moment its rate can climb: a request that went well
    costs it nothing. Each arm has two marks, the counts at the start of its previous and of its current window.
    """

    def __init__(self, margin: float, min_requests: int) -> None:
        self.margin = margin
        self.min_requests = min_requests
        self.window = max(WINDOW, min_requests)
        self.stopped: dict[str, Stop] = {}
        self._marks: dict[str, tuple[int, int, int, int]] = {}  # arm -> previous and current window's start

    def _recent(self, arm: str, requests: int, errors: int) -> tuple[int, int]:
        """The arm's (requests, engine errors) since its previous window began; rolls its windows on."""
        r0, e0, r1, e1 = self._marks.get(arm, (0, 0, 0, 0))
        if requests - r1 >= self.window:
            r0, e0, r1, e1 = r1, e1, requests, errors
            self._marks[arm] = (r0, e0, r1, e1)
        return requests - r0, errors - e0

    def check(self, arm: str, counts: Mapping[str, tuple[int, int]], serving: frozenset[str] | set[str]) \
            -> Stop | None:
        """After an engine error on `arm`: a Stop when its recent error rate exceeds the best other serving arm's
        (`counts`: each arm's requests and engine errors so far) by the margin and beyond chance, else None."""
        if arm in self.stopped or arm not in counts:
            return None
        n, e = self._recent(arm, *counts[arm])
        if n < self.min_requests:
            return None
        best: tuple[float, str, int, int] | None = None
        for other, (requests, errors) in counts.items():
            if other == arm or other not in serving:
                continue
            n2, e2 = self._recent(other, requests, errors)
            if n2 >= self.min_requests and (best is None or e2 / n2 < best[0]):
                best = (e2 / n2, other, n2, e2)
        if best is None:
            return None  # no other arm to compare with, or to send the traffic to
        rate2, other, n2, e2 = best
        gap = e / n - rate2
        pooled = (e + e2) / (n + n2)
        spread = math.sqrt(pooled * (1 - pooled) * (1 / n + 1 / n2))
        if gap <= self.margin or gap < Z * spread:
            return None
        stop = self.stopped[arm] = Stop(arm, time.time(), e, n, other, e2, n2, self.margin)
        return stop

    def lift(self, counts: Mapping[str, tuple[int, int]]) -> None:
        """Every stop lifted and every arm's windows started afresh from `counts` (an admin's change: the
        errors that stopped an arm must not stop it again at its first error)."""
        self.stopped.clear()
        self._marks = {arm: (r, e, r, e) for arm, (r, e) in counts.items()}
