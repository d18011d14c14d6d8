"""Rolling per-backend stats (counts per result, latency sketches), tallies and the online latency model."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Final, Sequence

from gateway.config import LatencyHints
from gateway.contracts import CLASSES, CLIENT_ERROR, CLIENT_LEFT, ENGINE_ERROR, OK, LatencyEstimate, Outcome
from gateway.stats import sketch

Clock = Callable[[], float]

# Starting point for an engine nobody described: faster than any engine we front, so a cold gateway
# sends every backend a few requests and measurement replaces the guess within a handful of samples.
PRIOR_TTFT_S: Final = 0.01
PRIOR_PREFILL_TPS: Final = 10000.0
PRIOR_TTFT_PER_RUNNING_S: Final = 0.001
PRIOR_ITL_S: Final = 0.005
PRIOR_ITL_PER_STREAM_S: Final = 0.0005
PRIOR_SERVICE_S: Final = 1.0
PRIOR_WEIGHT: Final = 0.25  # pseudo-samples the prior is worth
# Feature magnitudes at which the prior's slopes count as PRIOR_WEIGHT samples (keeps the ridge scale-free).
TYPICAL_PROMPT_TOKENS: Final = 1000.0
TYPICAL_RUNNING: Final = 8.0
# An estimate is recomputed when it is this old (so that decay shows without traffic), and after new
# samples once it is at least MIN_AGE_S old ([stats] refit_interval_s; a solve costs ~20 us: at most a few
# dozen per second).
REFRESH_S: Final = 1.0
MIN_AGE_S: Final = 0.05
# While the model has fewer samples of its own than this, the engine's own latency figures replace the prior.
COLD_SAMPLES: Final = 4
# The moment sums are decayed at most this often on the request path (between times, new samples are
# weighted up instead, which is exact).
DECAY_EVERY_S: Final = 1.0


class DecayingRidge:
    """Least squares y = w0 + w1*x1 + ... + wk*xk with exponential forgetting and a ridge prior.

    State is the (k+1)^2 weighted moment sums, of which `a` keeps the upper triangle up to date (the sums are
    symmetric: an update writes about half as many); an update is O(k^2), a solve O(k^3) with k <= 2.
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
            if any(self.a):  # (not a[0] alone: ITL equations leave it at zero)
                f = 0.5 ** ((now - self.last) / self.half_life)
                self.a = [v * f for v in self.a]
                self.b = [v * f for v in self.b]
            self.last = now

    def add(self, xs: tuple[float, ...], y: float, now: float, weight: float = 1.0) -> None:
        self.add_row((1.0, *xs), y, now, weight)

    def add_row(self, row: tuple[float, ...], y: float, now: float, weight: float = 1.0) -> None:
        """One equation y = w . row (row[0] multiplies w0: 1 for an intercept, 0 for an equation without it)."""
        dt = now - self.last
        if dt > DECAY_EVERY_S:
            self._decay(now)
        elif dt > 0.0:
            # Same result as decaying every sum to `now` first, at the cost of one power instead of
            # rebuilding the sums: the new sample weighs more by the decay the others have not had yet.
            weight *= 2.0 ** (dt / self.half_life)
        a, b, n = self.a, self.b, self.n
        # A TTFT or an ITL equation touches only its own parameters: skip the zero terms (half of them).
        nz = [i for i in range(n) if row[i]]
        # (x = x + ..., not x += ...: compiled, a sum of floats, not a generic in-place add)
        for k, i in enumerate(nz):
            wi = weight * row[i]
            b[i] = b[i] + wi * y
            base = i * n
            for j in nz[k:]:
                a[base + j] = a[base + j] + wi * row[j]

    def _symmetric(self) -> list[float]:
        """The whole matrix of sums, its lower triangle read from the upper."""
        n, a = self.n, self.a
        return [a[i * n + j] if j >= i else a[j * n + i] for i in range(n) for j in range(n)]

    def moments(self, now: float) -> list[float]:
        """The weighted sums as of `now` (a, then b): the whole state of the fit, which adds across fits."""
        self._decay(now)
        return [*self._symmetric(), *self.b]

    def absorb(self, moments: Sequence[float], now: float) -> None:
        """Add another fit's sums, taken as of `now`: as if its samples had been added here."""
        self._decay(now)
        k = self.n * self.n
        self.a = [x + y for x, y in zip(self.a, moments[:k])]
        self.b = [x + y for x, y in zip(self.b, moments[k:])]

    def weight(self, now: float) -> float:
        """Effective number of samples left after forgetting."""
        self._decay(now)
        return self.a[0]

    def solve(self, prior: tuple[float, ...], scales: tuple[float, ...], prior_w: float, now: float) -> list[float]:
        """Coefficients, shrunk towards `prior` as if it were prior_w samples at the typical feature `scales`."""
        self._decay(now)
        n = self.n
        a = self._symmetric()
        m = [a[i * n:(i + 1) * n] + [self.b[i]] for i in range(n)]
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
    """Per-backend latency, fitted online from every request the gateway serves there.

    One fit of TTFT ~ t0 + uncached prompt tokens / rate + c * running and ITL ~ a + b * streams (streams
    averaged over the request's life). A stream gives both figures; a non-streamed reply gives only its e2e,
    which is one equation in the same parameters: e2e = TTFT + (output tokens - 1) * ITL. Samples that
    queued for a slot say nothing about t0 and are left out of it. Service time = mean e2e (queue waits).

    Equations are weighted by what they can tell: a TTFT or an ITL by the typical size of that figure (so that
    streams alone give the same fit as two separate least squares), an e2e by its own predicted size, so that
    a long non-streamed generation teaches ITL about as much as one stream does and says little about t0,
    and a long prompt with a short answer the reverse.
    """

    def __init__(self, hints: LatencyHints, half_life_s: float = 120.0, warmup_samples: int = 1,
                 clock: Clock = time.monotonic) -> None:
        t0 = (hints.ttft_ms / 1000) if hints.ttft_ms else PRIOR_TTFT_S
        rate = hints.prefill_tps or PRIOR_PREFILL_TPS
        itl_a = (hints.itl_ms / 1000) if hints.itl_ms else PRIOR_ITL_S
        itl_b = (hints.itl_per_stream_ms / 1000) if hints.itl_per_stream_ms is not None else PRIOR_ITL_PER_STREAM_S
        # Coefficients as fitted: (t0, 1/rate, per running, ITL intercept, ITL per stream).
        self._prior = (t0, 1.0 / rate, PRIOR_TTFT_PER_RUNNING_S, itl_a - itl_b, itl_b)
        # The typical size of a TTFT and of an ITL under the prior: each kind of equation is divided by it.
        self._ttft_scale = t0 + TYPICAL_PROMPT_TOKENS / rate
        self._itl_scale = itl_a
        t, i = self._ttft_scale, self._itl_scale
        self._scales = (1.0 / t, TYPICAL_PROMPT_TOKENS / t, TYPICAL_RUNNING / t, 1.0 / i, TYPICAL_RUNNING / i)
        self._svc_prior = (t0 + 256 * itl_a,) if hints.itl_ms else (PRIOR_SERVICE_S,)
        self._fit = DecayingRidge(4, half_life_s)
        self._svc = DecayingRidge(0, half_life_s)
        # The part of both that other replicas taught (gateway.ops.replica_sync): what is left is this process's own.
        self._taken = (DecayingRidge(4, half_life_s), DecayingRidge(0, half_life_s))
        self.imported = 0  # requests other replicas learned from, folded in here
        self.warmup_samples = warmup_samples
        self.refit_s = MIN_AGE_S  # the least age of an estimate solved again for new samples
        self._skip = 0
        self._ready_since: float | None = None
        self.samples = 0  # taught the model (warm-up and failures excluded)
        self.skipped = 0
        self.from_e2e = 0  # of them, non-streamed replies (taught through their e2e)
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
        uncached = float(max(o.prompt_tokens - o.cached_tokens, 0))
        end = float(running_end) if running_end is not None else start
        streams = min(1.0 + (start + end) / 2.0, cap)
        fit = self._fit
        if o.ttft is not None or o.itl is not None:
            if o.ttft is not None and start < cap:  # a request that queued for a slot says nothing about t0
                t = self._ttft_scale
                fit.add_row((1.0 / t, uncached / t, start / t, 0.0, 0.0), o.ttft / t, now)
            if o.itl is not None and o.completion_tokens > 1:
                i = self._itl_scale
                fit.add_row((0.0, 0.0, 0.0, 1.0 / i, streams / i), o.itl / i, now)
        elif o.completion_tokens > 0 and start < cap and o.e2e > 0:
            steps = float(o.completion_tokens - 1)
            e = self._predicted_e2e(uncached, start, steps, streams)
            fit.add_row((1.0 / e, uncached / e, start / e, steps / e, steps * streams / e), o.e2e / e, now)
            self.from_e2e += 1
        self._svc.add((), o.e2e, now)
        self.samples += 1
        self._dirty = True
        return True

    def engine_prior(self, ttft: float | None, itl: float | None, prefill_rate: float | None) -> bool:
        """At cold start, take the engine's own figures (gateway.fleet.engine_latency) as the prior; False (and
        nothing changed) once the model has COLD_SAMPLES samples of its own."""
        if self.samples + self.imported >= COLD_SAMPLES:
            return False
        t0, slope, per_running, a0, b = self._prior
        if prefill_rate:
            slope = 1.0 / prefill_rate
        if ttft:
            t0 = ttft  # the engine's mean over its own prompts: a guess at the intercept on the safe side
        if itl:
            a0 = itl - b
        self._prior = (t0, slope, per_running, a0, b)
        self._cached, self._dirty = None, True
        return True

    @property
    def half_life(self) -> float:
        return self._fit.half_life

    def own_moments(self, now: float) -> tuple[list[float], list[float]]:
        """The sums of the fit and of the service time this process learned itself (as of `now`): all it holds
        less what other replicas taught it, so that their learning never goes back to them."""
        fit, svc = self._fit.moments(now), self._svc.moments(now)
        taken_fit, taken_svc = self._taken[0].moments(now), self._taken[1].moments(now)
        return [x - y for x, y in zip(fit, taken_fit)], [x - y for x, y in zip(svc, taken_svc)]

    def absorb(self, fit: Sequence[float], svc: Sequence[float], requests: int, now: float) -> None:
        """Fold in what another replica learned from `requests` requests: sums in own_moments' form, as of `now`."""
        self._fit.absorb(fit, now)
        self._svc.absorb(svc, now)
        self._taken[0].absorb(fit, now)
        self._taken[1].absorb(svc, now)
        self.imported += requests
        self._dirty = True

    def _predicted_e2e(self, uncached: float, running: float, steps: float, streams: float) -> float:
        """What the current fit predicts for a reply: the scale of that reply's equation (never below 1 ms)."""
        est = self.estimate()
        e2e = est.ttft(uncached, running=running) + steps * est.itl(streams)
        return e2e if e2e > 0.001 else 0.001

    def estimate(self) -> LatencyEstimate:
        now = self._clock()
        if self._cached is not None:
            age = now - self._cached_at
            if age < self.refit_s or (age < REFRESH_S and not self._dirty):
                return self._cached
        self._dirty = False
        self._cached = self._solve(self._fit, self._svc, now)
        self._cached_at = now
        return self._cached

    def _solve(self, fit: DecayingRidge, svc: DecayingRidge, now: float) -> LatencyEstimate:
        t0, slope, per_running, a, b = fit.solve(self._prior, self._scales, PRIOR_WEIGHT, now)
        (service,) = svc.solve(self._svc_prior, (1.0,), PRIOR_WEIGHT, now)
        b = max(b, 0.0)
        return LatencyEstimate(
            ttft_t0=max(t0, 0.0005), prefill_rate=1.0 / max(slope, 1e-6), itl_a=max(a + b, 0.0002), itl_b=b,
            samples=int(svc.weight(now) + 0.5), ttft_per_running=max(per_running, 0.0),
            service_s=max(service, 0.001))

    def trial(self, fit: Sequence[float], svc: Sequence[float], now: float) -> LatencyEstimate:
        """The estimate as it would be with these sums (in own_moments' form, as of `now`) folded in; the model
        is left as it is (gateway.ops.replica_sync weighs another replica's learning before taking it)."""
        trial_fit, trial_svc = DecayingRidge(4, self.half_life), DecayingRidge(0, self.half_life)
        trial_fit.absorb([x + y for x, y in zip(self._fit.moments(now), fit)], now)
        trial_svc.absorb([x + y for x, y in zip(self._svc.moments(now), svc)], now)
        return self._solve(trial_fit, trial_svc, now)


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


# Per class and second: one count per attempt result, then output tokens.
ATTEMPT_RESULTS: Final = (OK, CLIENT_LEFT, CLIENT_ERROR, ENGINE_ERROR)
RESULT_INDEX: Final = {r: i for i, r in enumerate(ATTEMPT_RESULTS)}
TOKENS: Final = len(ATTEMPT_RESULTS)


class BackendStats:
    """One backend's recent attempts, summarised on demand (never on the request path).

    Latency distributions come from the last `max_samples` served requests inside the window; counts per
    result and tokens from per-second counts, which stay exact however busy the backend is.
    """

    KEEP_S = 600.0  # seconds of counts kept at least (longer once a summary asks for a longer window)

    def __init__(self, max_samples: int, now: float | None = None) -> None:
        # Plain tuples in Sample's field order: a request pays for a tuple, a summary reads them.
        self.samples: deque[tuple] = deque(maxlen=max_samples)
        # (second, {class: [ok, client_left, client_error, engine_error, output tokens]}), oldest first.
        self.counts: deque[tuple[int, dict[str, list[int]]]] = deque()
        self.since = time.monotonic() if now is None else now
        self._keep_s = self.KEEP_S
        self.added = 0  # samples appended since the start
        self._sliding = sketch.Sliding(lambda s: s[1], _distributions, len(DISTRIBUTIONS))

    def add(self, o: Outcome, now: float) -> None:
        klass = o.shape.klass
        self.samples.append((now, klass, o.ok, o.ttft, o.itl, o.e2e, o.completion_tokens, o.prompt_tokens))
        self.added += 1
        sec, counts = int(now), self.counts
        if not counts or counts[-1][0] != sec:
            counts.append((sec, {}))
            while counts[0][0] < sec - self._keep_s:
                counts.popleft()
        c = counts[-1][1].get(klass)
        if c is None:
            c = counts[-1][1][klass] = [0, 0, 0, 0, 0]
        c[RESULT_INDEX.get(o.result, RESULT_INDEX[ENGINE_ERROR])] += 1
        c[TOKENS] += o.completion_tokens

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
                t = out.get(klass)
                if t is None:
                    out[klass] = c.copy()
                else:
                    for i, v in enumerate(c):
                        t[i] += v
        return out

    def summary(self, now: float, window_s: float) -> dict:
        """Mergeable figures per class over the window: counts per result, output tokens, and latency (and
        prompt size) distributions of the served requests as sketches (see gateway.stats.sketch).

        When the sample cap left fewer served samples than served requests, each sample weighs for the
        requests it stands for, so that sketches of busy and idle processes add up in proportion.
        """
        sliding = self._sliding
        sliding.update(self.samples, self.added, now - window_s, window_s)
        classes = {}
        for klass, c in sorted(self._counted(now, window_s).items(), key=lambda kv: _class_rank(kv[0])):
            sks = sliding.sketches.get(klass) or [{} for _ in DISTRIBUTIONS]
            served = sum(sks[DISTRIBUTIONS.index("e2e")].values())  # every served sample has an e2e
            weight = c[0] / served if served and c[0] > served else 1.0
            classes[klass] = {"n": c[:TOKENS], "tokens": c[TOKENS], "samples": sliding.held.get(klass, 0),
                              **{d: sketch.encode(sk, weight) for d, sk in zip(DISTRIBUTIONS, sks)}}
        return {"span_s": min(window_s, max(now - self.since, 1.0)), "classes": classes}


# What a summary sketches of each served sample (a failed one says nothing about the engine's latency).
DISTRIBUTIONS: Final = ("ttft", "itl", "e2e", "prompt")


def _distributions(s: tuple) -> tuple:
    return (s[3], s[4], s[5], s[7]) if s[2] else (None, None, None, None)


def _class_rank(klass: str) -> tuple[int, str]:
    return (CLASSES.index(klass) if klass in CLASSES else len(CLASSES), klass)


class Tally:
    """Counts per key over rolling whole seconds: events add on the request path, a summary sums a window."""

    KEEP_S = 600.0

    def __init__(self) -> None:
        self.counts: deque[tuple[int, dict]] = deque()
        self._keep_s = self.KEEP_S
        self._folded: dict = {}

    def fold(self, key, total: int, now: float) -> int:
        """Add what a cumulative counter grew by since its last fold (one that restarted counts from zero)."""
        last = self._folded.get(key, 0)
        grew = total - last if total >= last else total
        self._folded[key] = total
        if grew:
            self.add(key, now, grew)
        return grew

    def add(self, key, now: float, n: int = 1) -> None:
        sec, counts = int(now), self.counts
        if not counts or counts[-1][0] != sec:
            counts.append((sec, {}))
            while counts[0][0] < sec - self._keep_s:
                counts.popleft()
        per = counts[-1][1]
        per[key] = per.get(key, 0) + n

    def window(self, now: float, window_s: float) -> dict:
        self._keep_s = max(self._keep_s, window_s)
        first = int(now - window_s) + 1
        out: dict = {}
        for sec, per in reversed(self.counts):
            if sec < first:
                break
            for key, n in per.items():
                out[key] = out.get(key, 0) + n
        return out


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

