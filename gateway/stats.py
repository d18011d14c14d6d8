"""Rolling per-backend latency stats and the online latency model (TTFT and ITL fits), on an injected clock."""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable

from gateway.config import LatencyHints
from gateway.contracts import CLASSES, LatencyEstimate, Outcome

Clock = Callable[[], float]

# Starting point for an engine nobody described: faster than any engine we front, so a cold gateway
# sends every backend a few requests and measurement replaces the guess within a handful of samples.
PRIOR_TTFT_S = 0.01
PRIOR_PREFILL_TPS = 10000.0
PRIOR_TTFT_PER_RUNNING_S = 0.001
PRIOR_ITL_S = 0.005
PRIOR_ITL_PER_STREAM_S = 0.0005
PRIOR_SERVICE_S = 1.0
PRIOR_WEIGHT = 0.25  # pseudo-samples the prior is worth
# Feature magnitudes at which the prior's slopes count as PRIOR_WEIGHT samples (keeps the ridge scale-free).
TYPICAL_PROMPT_TOKENS = 1000.0
TYPICAL_RUNNING = 8.0
# An estimate is recomputed when it is this old (so that decay shows without traffic), and after new
# samples once it is at least MIN_AGE_S old (a solve costs ~20 us: at most a few dozen per second).
REFRESH_S = 1.0
MIN_AGE_S = 0.05
# The moment sums are decayed at most this often on the request path (between times, new samples are
# weighted up instead, which is exact).
DECAY_EVERY_S = 1.0


class DecayingRidge:
    """Least squares y = w0 + w1*x1 + ... + wk*xk with exponential forgetting and a ridge prior.

    State is the (k+1)^2 weighted moment sums; an update is O(k^2), a solve O(k^3) with k <= 2.
    """

    __slots__ = ("n", "half_life", "a", "b", "last")

    def __init__(self, k: int, half_life: float) -> None:
        self.n = k + 1
        self.half_life = half_life
        self.a = [0.0] * (self.n * self.n)  # sum w * xi * xj, with x0 = 1 (a[0] is the total weight)
        self.b = [0.0] * self.n  # sum w * xi * y
        self.last = 0.0

    def _decay(self, now: float) -> None:
        if now > self.last:
            if self.a[0]:
                f = 0.5 ** ((now - self.last) / self.half_life)
                self.a = [v * f for v in self.a]
                self.b = [v * f for v in self.b]
            self.last = now

    def add(self, xs: tuple[float, ...], y: float, now: float, weight: float = 1.0) -> None:
        dt = now - self.last
        if dt > DECAY_EVERY_S:
            self._decay(now)
        elif dt > 0.0:
            # Same result as decaying every sum to `now` first, at the cost of one power instead of
            # rebuilding the sums: the new sample weighs more by the decay the others have not had yet.
            weight *= 2.0 ** (dt / self.half_life)
        row = (1.0, *xs)
        a, b, n = self.a, self.b, self.n
        for i in range(n):
            wi = weight * row[i]
            b[i] += wi * y
            base = i * n
            for j in range(n):
                a[base + j] += wi * row[j]

    def weight(self, now: float) -> float:
        """Effective number of samples left after forgetting."""
        self._decay(now)
        return self.a[0]

    def solve(self, prior: tuple[float, ...], scales: tuple[float, ...], prior_w: float, now: float) -> list[float]:
        """Coefficients, shrunk towards `prior` as if it were prior_w samples at the typical feature `scales`."""
        self._decay(now)
        n = self.n
        m = [self.a[i * n:(i + 1) * n] + [self.b[i]] for i in range(n)]
        for i in range(n):
            lam = prior_w * scales[i] * scales[i]
            m[i][i] += lam
            m[i][n] += lam * prior[i]
        # Gaussian elimination; the ridge term makes the matrix positive definite, so pivots are non-zero.
        for c in range(n):
            p = max(range(c, n), key=lambda r: abs(m[r][c]))
            m[c], m[p] = m[p], m[c]
            for r in range(c + 1, n):
                f = m[r][c] / m[c][c]
                if f:
                    for j in range(c, n + 1):
                        m[r][j] -= f * m[c][j]
        out = [0.0] * n
        for i in range(n - 1, -1, -1):
            s = m[i][n] - sum(m[i][j] * out[j] for j in range(i + 1, n))
            out[i] = s / m[i][i]
        return out


class LatencyModel:
    """Per-backend latency, fitted online from the gateway's own streams.

    TTFT ~ t0 + uncached prompt tokens / rate + c * running (fitted on samples that did not queue for a slot);
    ITL ~ a + b * (streams - 1), streams averaged over the request's life; service time = mean e2e (queue waits).
    """

    def __init__(self, hints: LatencyHints, half_life_s: float = 120.0, warmup_samples: int = 1,
                 clock: Clock = time.monotonic) -> None:
        t0 = (hints.ttft_ms / 1000) if hints.ttft_ms else PRIOR_TTFT_S
        rate = hints.prefill_tps or PRIOR_PREFILL_TPS
        itl_a = (hints.itl_ms / 1000) if hints.itl_ms else PRIOR_ITL_S
        itl_b = (hints.itl_per_stream_ms / 1000) if hints.itl_per_stream_ms is not None else PRIOR_ITL_PER_STREAM_S
        # Coefficients as fitted: TTFT on (1, tokens, running), ITL on (1, streams), service on (1,).
        self._ttft_prior = (t0, 1.0 / rate, PRIOR_TTFT_PER_RUNNING_S)
        self._itl_prior = (itl_a - itl_b, itl_b)
        self._svc_prior = (t0 + 256 * itl_a,) if hints.itl_ms else (PRIOR_SERVICE_S,)
        self._ttft = DecayingRidge(2, half_life_s)
        self._itl = DecayingRidge(1, half_life_s)
        self._svc = DecayingRidge(0, half_life_s)
        self.warmup_samples = warmup_samples
        self._skip = 0
        self._ready_since: float | None = None
        self.samples = 0  # taught the model (warm-up and failures excluded)
        self.skipped = 0
        self._clock = clock
        self._cached: LatencyEstimate | None = None
        self._cached_at = 0.0
        self._dirty = False

    def learn(self, o: Outcome, now: float, *, ready_since: float = 0.0, running_end: int | None = None,
              slots: int | None = None) -> bool:
        """Teach one finished request; False when it did not teach (failed, or one of the warm-up samples).

        `ready_since` is when the backend last became ready: a new value restarts the warm-up count.
        `running_end` is the backend's in-flight count when the request ended; `slots` its slot count if known.
        """
        if not o.ok:
            return False
        if ready_since != self._ready_since:
            self._ready_since = ready_since
            self._skip = self.warmup_samples
        if self._skip > 0:  # engines are slow on their first requests (compilation, caches)
            self._skip -= 1
            self.skipped += 1
            return False
        cap = float(slots) if slots else float("inf")
        start = float(o.running_at_start)
        if o.ttft is not None and start < cap:  # a request that queued for a slot says nothing about t0
            uncached = float(max(o.prompt_tokens - o.cached_tokens, 0))
            self._ttft.add((uncached, start), o.ttft, now)
        if o.itl is not None and o.completion_tokens > 1:
            end = float(running_end) if running_end is not None else start
            streams = min(1.0 + (start + end) / 2.0, cap)
            self._itl.add((streams,), o.itl, now)
        self._svc.add((), o.e2e, now)
        self.samples += 1
        self._dirty = True
        return True

    def estimate(self) -> LatencyEstimate:
        now = self._clock()
        if self._cached is not None:
            age = now - self._cached_at
            if age < MIN_AGE_S or (age < REFRESH_S and not self._dirty):
                return self._cached
        self._dirty = False
        t0, slope, per_running = self._ttft.solve(self._ttft_prior, (1.0, TYPICAL_PROMPT_TOKENS, TYPICAL_RUNNING),
                                                  PRIOR_WEIGHT, now)
        a, b = self._itl.solve(self._itl_prior, (1.0, TYPICAL_RUNNING), PRIOR_WEIGHT, now)
        (service,) = self._svc.solve(self._svc_prior, (1.0,), PRIOR_WEIGHT, now)
        b = max(b, 0.0)
        weight = max(self._ttft.weight(now), self._itl.weight(now), self._svc.weight(now))
        self._cached = LatencyEstimate(
            ttft_t0=max(t0, 0.0005), prefill_rate=1.0 / max(slope, 1e-6), itl_a=max(a + b, 0.0002), itl_b=b,
            samples=int(weight + 0.5), ttft_per_running=max(per_running, 0.0), service_s=max(service, 0.001))
        self._cached_at = now
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
    in_tokens: int = 0


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def summarize(samples: Iterable[Sample], span_s: float, counts: list[int] | None = None) -> dict:
    """Percentiles from `samples`; requests, errors and tokens from the exact `counts` when given.

    `span_s` is the time the figures cover: the window, or less while the window has not yet filled.
    """
    rows = list(samples)
    ok = [s for s in rows if s.ok]
    if counts is None:
        counts = [len(rows), len(rows) - len(ok), sum(s.out_tokens for s in rows)]
    n, errors, tokens = counts

    def pct(values: list[float]) -> dict:
        v = sorted(values)
        return {"p50": _ms(percentile(v, 0.5)), "p90": _ms(percentile(v, 0.9)), "p99": _ms(percentile(v, 0.99))}

    return {
        "requests": n,
        "rps": n / span_s,
        "error_rate": errors / n if n else 0.0,
        "output_tps": tokens / span_s,
        "ttft_ms": pct([s.ttft for s in ok if s.ttft is not None]),
        "itl_ms": pct([s.itl for s in ok if s.itl is not None]),
        "e2e_ms": pct([s.e2e for s in ok]),
        "prompt_tokens_p50": percentile(sorted(s.in_tokens for s in ok), 0.5),
        "samples": len(rows),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


class BackendStats:
    """One backend's recent requests, summarised on demand (never on the request path).

    Percentiles come from the last `max_samples` requests inside the window; request, error and token
    rates from per-second counts, which stay exact however busy the backend is.
    """

    KEEP_S = 600.0  # seconds of counts kept at least (longer once a report asks for a longer window)

    def __init__(self, max_samples: int, now: float | None = None) -> None:
        # Plain tuples in Sample's field order: a request pays for a tuple, a report builds the Samples.
        self.samples: deque[tuple] = deque(maxlen=max_samples)
        # (second, {class: [requests, errors, output tokens]}), oldest first; a second without traffic has none.
        self.counts: deque[tuple[int, dict[str, list[int]]]] = deque()
        self.since = time.monotonic() if now is None else now
        self._keep_s = self.KEEP_S

    def add(self, o: Outcome, now: float) -> None:
        klass = o.shape.klass
        self.samples.append((now, klass, o.ok, o.ttft, o.itl, o.e2e, o.completion_tokens, o.prompt_tokens))
        sec, counts = int(now), self.counts
        if not counts or counts[-1][0] != sec:
            counts.append((sec, {}))
            while counts[0][0] < sec - self._keep_s:
                counts.popleft()
        c = counts[-1][1].get(klass)
        if c is None:
            c = counts[-1][1][klass] = [0, 0, 0]
        c[0] += 1
        c[1] += not o.ok
        c[2] += o.completion_tokens

    def window(self, now: float, window_s: float) -> list[Sample]:
        cutoff = now - window_s
        return [Sample(*s) for s in self.samples if s[0] >= cutoff]

    def _counted(self, now: float, window_s: float) -> dict[str, list[int]]:
        self._keep_s = max(self._keep_s, window_s)
        first = int(now - window_s) + 1  # whole seconds: the window's edge moves one second at a time
        out: dict[str, list[int]] = {}
        for sec, per in reversed(self.counts):
            if sec < first:
                break
            for klass, c in per.items():
                t = out.setdefault(klass, [0, 0, 0])
                t[0] += c[0]
                t[1] += c[1]
                t[2] += c[2]
        return out

    def report(self, now: float, window_s: float) -> dict:
        rows = self.window(now, window_s)
        span = min(window_s, max(now - self.since, 1.0))
        counted = self._counted(now, window_s)
        total = [sum(c[i] for c in counted.values()) for i in range(3)]
        classes = {k: summarize([s for s in rows if s.klass == k], span, counted[k]) for k in CLASSES if k in counted}
        return {"overall": summarize(rows, span, total), "classes": classes}


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

