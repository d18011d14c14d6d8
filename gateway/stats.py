"""Rolling per-backend latency stats and the online latency model (TTFT and ITL fits), on an injected clock."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable

from gateway.config import LatencyHints
from gateway.contracts import CLASSES, LatencyEstimate, Outcome

# Neutral starting point for an engine nobody described: optimistic, so a cold gateway tries it.
PRIOR_TTFT_S = 0.02
PRIOR_PREFILL_TPS = 5000.0
PRIOR_ITL_S = 0.01
PRIOR_ITL_PER_STREAM_S = 0.0005
PRIOR_WEIGHT = 2.0  # pseudo-samples the prior is worth


class DecayingFit:
    """Weighted least squares y = a + b*x with exponential forgetting; O(1) state and update."""

    __slots__ = ("half_life", "sw", "sx", "sy", "sxx", "sxy", "last", "n")

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.last = 0.0
        self.n = 0

    def _decay(self, now: float) -> None:
        if self.sw and now > self.last:
            f = 0.5 ** ((now - self.last) / self.half_life)
            self.sw *= f
            self.sx *= f
            self.sy *= f
            self.sxx *= f
            self.sxy *= f
        self.last = max(self.last, now)

    def add(self, x: float, y: float, now: float, weight: float = 1.0) -> None:
        self._decay(now)
        self.sw += weight
        self.sx += weight * x
        self.sy += weight * y
        self.sxx += weight * x * x
        self.sxy += weight * x * y
        self.n += 1

    def solve(self, a0: float, b0: float, prior_w: float) -> tuple[float, float]:
        """Intercept and slope, shrunk towards (a0, b0) as if the prior were prior_w samples at x=0 and x=x̄."""
        w = self.sw + prior_w
        if self.sw <= 0:
            return a0, b0
        mx = self.sx / self.sw
        # Prior as two pseudo-points on the prior line: one at x=0, one at the data's mean x.
        px = (0.0, mx if mx > 0 else 1.0)
        sw, sx, sy, sxx, sxy = self.sw, self.sx, self.sy, self.sxx, self.sxy
        for x in px:
            pw = prior_w / 2
            y = a0 + b0 * x
            sw += pw
            sx += pw * x
            sy += pw * y
            sxx += pw * x * x
            sxy += pw * x * y
        den = sw * sxx - sx * sx
        if den <= 1e-12 * w:
            return sy / sw, b0
        b = (sw * sxy - sx * sy) / den
        a = (sy - b * sx) / sw
        return a, b


class LatencyModel:
    """TTFT ~ t0 + prompt_tokens / rate (fitted on unqueued samples); ITL ~ a + b * (running - 1)."""

    def __init__(self, hints: LatencyHints, half_life_s: float = 120.0) -> None:
        self.t0 = (hints.ttft_ms / 1000) if hints.ttft_ms else PRIOR_TTFT_S
        self.rate = hints.prefill_tps or PRIOR_PREFILL_TPS
        self.itl_a = (hints.itl_ms / 1000) if hints.itl_ms else PRIOR_ITL_S
        self.itl_b = (hints.itl_per_stream_ms / 1000) if hints.itl_per_stream_ms is not None else PRIOR_ITL_PER_STREAM_S
        self._prior = (self.t0, 1.0 / self.rate, self.itl_a, self.itl_b)
        self._ttft = DecayingFit(half_life_s)
        self._itl = DecayingFit(half_life_s)
        self.samples = 0
        self._cached: LatencyEstimate | None = None

    def learn(self, o: Outcome, now: float) -> None:
        if not o.ok:
            return
        self.samples += 1
        if o.ttft is not None and o.running_at_start == 0:
            uncached = max(o.prompt_tokens - o.cached_tokens, 0)
            self._ttft.add(float(uncached), o.ttft, now)
        if o.itl is not None and o.completion_tokens > 1:
            self._itl.add(float(max(o.running_at_start + 1, 1)), o.itl, now)
        self._cached = None

    def estimate(self) -> LatencyEstimate:
        if self._cached is None:
            t0p, slope_p, ap, bp = self._prior
            t0, slope = self._ttft.solve(t0p, slope_p, PRIOR_WEIGHT)
            a1, b = self._itl.solve(ap - bp, bp, PRIOR_WEIGHT)  # fit in x=running, report at running=1
            t0 = max(t0, 0.0005)
            slope = max(slope, 1e-6)
            itl_a = max(a1 + b, 0.0002)
            self._cached = LatencyEstimate(t0, 1.0 / slope, itl_a, max(b, 0.0), self.samples)
        return self._cached


@dataclass(slots=True)
class Sample:
    at: float
    klass: str
    ok: bool
    ttft: float | None
    itl: float | None
    e2e: float
    out_tokens: int


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def summarize(samples: Iterable[Sample], window_s: float) -> dict:
    rows = list(samples)
    ok = [s for s in rows if s.ok]

    def pct(values: list[float]) -> dict:
        v = sorted(values)
        return {"p50": _ms(percentile(v, 0.5)), "p90": _ms(percentile(v, 0.9)), "p99": _ms(percentile(v, 0.99))}

    return {
        "requests": len(rows),
        "rps": len(rows) / window_s,
        "error_rate": (len(rows) - len(ok)) / len(rows) if rows else 0.0,
        "output_tps": sum(s.out_tokens for s in ok) / window_s,
        "ttft_ms": pct([s.ttft for s in ok if s.ttft is not None]),
        "itl_ms": pct([s.itl for s in ok if s.itl is not None]),
        "e2e_ms": pct([s.e2e for s in ok]),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


class BackendStats:
    """The last samples of one backend, summarised on demand (never on the request path)."""

    def __init__(self, max_samples: int) -> None:
        self.samples: deque[Sample] = deque(maxlen=max_samples)

    def add(self, o: Outcome, now: float) -> None:
        self.samples.append(Sample(now, o.shape.klass, o.ok, o.ttft, o.itl, o.e2e, o.completion_tokens))

    def window(self, now: float, window_s: float) -> list[Sample]:
        cutoff = now - window_s
        return [s for s in self.samples if s.at >= cutoff]

    def report(self, now: float, window_s: float) -> dict:
        rows = self.window(now, window_s)
        classes = {k: summarize([s for s in rows if s.klass == k], window_s) for k in CLASSES}
        return {"overall": summarize(rows, window_s),
                "classes": {k: v for k, v in classes.items() if v["requests"]}}


class OutputEstimator:
    """Expected completion length per (principal, model) when a request sets no max_tokens; bounded LRU."""

    def __init__(self, capacity: int = 10_000, alpha: float = 0.2) -> None:
        self._ewma: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._capacity = capacity
        self._alpha = alpha

    def expected(self, principal: str, model: str) -> float | None:
        return self._ewma.get((principal, model))

    def learn(self, principal: str, model: str, completion_tokens: int) -> None:
        key = (principal, model)
        old = self._ewma.pop(key, None)
        self._ewma[key] = completion_tokens if old is None else old + self._alpha * (completion_tokens - old)
        if len(self._ewma) > self._capacity:
            self._ewma.popitem(last=False)


Clock = Callable[[], float]
