"""A/B verdicts between two arms of engines on live traffic: bootstrap CIs, A/A noise floor, practical margin."""

from __future__ import annotations

import math
import random
import zlib
from typing import Any, Callable, Iterable

import numpy as np

METRICS = ("ttft", "itl", "e2e", "output_tps", "error_rate")
LOWER_IS_BETTER = {"ttft", "itl", "e2e", "error_rate"}
HIGHER_IS_BETTER = {"output_tps"}
NAMES = {"ttft": "TTFT", "itl": "ITL", "e2e": "e2e", "output_tps": "output tok/s", "error_rate": "error rate"}
STATS = ("mean", "p50", "p99")  # what a verdict compares: the means, or a quantile of each arm
QUANTILES = {"p50": 0.5, "p99": 0.99}
# A quantile's verdict waits for this many samples beyond it in each arm (1,000 for a p99): below that the
# tail is a handful of values and its bootstrap says more about them than about the arm.
TAIL_POINTS = 10
MARGIN = 0.05  # the practical margin by default: smaller differences are no difference, however certain

# Resamples and A/A splits are drawn this many values at a time: the buffers stay at 1 MB whatever the arm
# size, small enough to stay in cache and large enough to amortise numpy's per-call overhead.
_CHUNK = 1 << 16


class Reservoir:
    """A uniform sample of at most `cap` values of a stream (Algorithm R): every value seen is kept with
    probability cap/seen, so an arm's early traffic does not outweigh its recent traffic or vice versa."""

    __slots__ = ("cap", "seen", "values", "_random")

    def __init__(self, cap: int = 2000, seed: int = 0) -> None:
        if cap < 1:
            raise ValueError("cap must be at least 1")
        self.cap = cap
        self.seen = 0
        self.values: list[float] = []
        self._random = random.Random(seed).random

    def add(self, x: float) -> None:
        # Runs on every request's record path: plain Python, no numpy, no allocation once full. random() * seen
        # instead of randrange(seen) is several times cheaper; its bias is below 2**-53 per draw.
        self.seen += 1
        if len(self.values) < self.cap:
            self.values.append(x)
        else:
            j = int(self._random() * self.seen)
            if j < self.cap:
                self.values[j] = x


def _clean(samples: Iterable[float]) -> np.ndarray:
    # A NaN or infinite latency (a figure that was never measured) would poison every mean; such samples carry
    # no information, so they are dropped rather than allowed to turn the whole verdict into NaN.
    if not isinstance(samples, np.ndarray):
        samples = list(samples)
    x = np.asarray(samples, dtype=float).ravel()
    return x[np.isfinite(x)]


def _fig(x: Any, digits: int = 4) -> float | None:
    """A JSON-ready figure: `digits` significant digits, None where the figure is undefined (NaN, inf)."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{float(x):.{digits}g}")


def summary(samples: Iterable[float]) -> dict:
    """Count, mean and tail percentiles of one arm's samples; None for every figure when there are none."""
    x = _clean(samples)
    if not len(x):
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"n": int(len(x)), "mean": _fig(x.mean()), "p50": _fig(p50), "p90": _fig(p90), "p99": _fig(p99)}


def _floor(n1: int, n2: int) -> float:
    """What an error rate is raised by before two samples of n1 and n2 requests are compared.

    Error rates are means of 0/1 and often exactly 0, which no ratio survives. Both sides get the same floor,
    half an error per side's worth of requests: ratios stay finite, equal observed rates (0 and 0 included)
    still give exactly 1 whatever the sizes, and a rate of a few errors moves by a fraction of one error.
    Per-arm smoothing such as (errors + 0.5)/(n + 1) would not: two error-free arms of 1000 and 900 requests
    would read as 11 % apart with a zero-width bootstrap CI. The same rule serves the A/B ratio, its bootstrap
    resamples and the A/A halves, so each is smoothed at the scale of the samples it compares.
    """
    return 1.0 / (n1 + n2)


def _centre(sums: Any, n: int, floor: float) -> Any:
    return sums / n + floor


def _bootstrap(x: np.ndarray, resamples: int, rng: np.random.Generator, floor: float) -> np.ndarray:
    """Means of `resamples` resamples of x with replacement."""
    n = len(x)
    rows = max(1, min(resamples, _CHUNK // n))
    # Two buffers serve every chunk: fresh chunk-sized arrays would each be mapped and faulted in anew, which
    # cost more than the draws themselves. buf holds uniforms, then the resampled values; idx the indices.
    buf, idx = np.empty((rows, n)), np.empty((rows, n), dtype=np.intp)
    sums = np.empty(resamples)
    for start in range(0, resamples, rows):
        k = min(rows, resamples - start)
        rng.random(out=buf[:k])
        buf[:k] *= n
        np.copyto(idx[:k], buf[:k], casting="unsafe")  # truncation: uniform indices 0..n-1
        # "clip" rather than "raise": no buffered copy, and a u * n rounded up to n takes the last sample.
        np.take(x, idx[:k], out=buf[:k], mode="clip")
        buf[:k].sum(axis=1, out=sums[start:start + k])
    return _centre(sums, n, floor)


def _aa(x: np.ndarray, repeats: int, rng: np.random.Generator, of_rows: Callable[[np.ndarray], np.ndarray]) \
        -> np.ndarray:
    """|log(s(h1) / s(h2))| over `repeats` random splits of x into two equal halves, s the compared statistic
    (`of_rows` takes it of each row of a block): how far the ratio strays from 1 when both sides are the same
    arm. A split with one half at 0 counts as infinitely noisy."""
    m = len(x) // 2
    if m == 0:
        return np.empty(0)
    rows = max(1, min(repeats, _CHUNK // len(x)))
    buf = np.empty((rows, len(x)))
    out = np.empty(repeats)
    for start in range(0, repeats, rows):
        k = min(rows, repeats - start)
        shuffled = buf[:k]
        shuffled[:] = x
        rng.permuted(shuffled, axis=1, out=shuffled)
        h1, h2 = of_rows(shuffled[:, :m]), of_rows(shuffled[:, m:2 * m])
        with np.errstate(divide="ignore", invalid="ignore"):
            out[start:start + k] = np.where(h1 == h2, 0.0, np.abs(np.log(h1 / h2)))  # 0 == 0 is no noise
    out[~np.isfinite(out)] = np.inf
    return out


def _mean_rows(rate: bool) -> Callable[[np.ndarray], np.ndarray]:
    """The mean of each row of a block of A/A halves (an error rate's with its floor at the halves' scale)."""
    def means(h: np.ndarray) -> np.ndarray:
        m = h.shape[1]
        return _centre(h.sum(axis=1), m, _floor(m, m) if rate else 0.0)
    return means


def _quantile_rows(q: float) -> Callable[[np.ndarray], np.ndarray]:
    """The q-quantile of each row of a block of A/A halves."""
    return lambda h: np.quantile(h, q, axis=1)


def _bootstrap_quantile(x_sorted: np.ndarray, q: float, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """The q-quantile (numpy's default, linear between order statistics) of `resamples` resamples of x with
    replacement, drawn exactly in O(resamples) rather than O(resamples * n).

    A resample is n indices floor(n * U), U uniform; floor is monotone, so its (k+1)-th smallest value is
    x_sorted[floor(n * U_(k+1))], and the (k+1)-th smallest of n uniforms is Beta(k+1, n-k). The next one up
    is the smallest of the n-k-1 uniforms above it: U_(k+2) = U_(k+1) + (1 - U_(k+1)) * Beta(1, n-k-1).
    """
    n = len(x_sorted)
    h = (n - 1) * q
    k = int(math.floor(h))
    frac = h - k
    u = rng.beta(k + 1, n - k, size=resamples)
    low = x_sorted[np.minimum((u * n).astype(np.intp), n - 1)]
    if frac == 0 or k + 1 >= n:
        return low
    u = u + (1 - u) * rng.beta(1, n - k - 1, size=resamples)
    return low + frac * (x_sorted[np.minimum((u * n).astype(np.intp), n - 1)] - low)


def _seed(klass: str, metric: str, a: str, b: str, stat: str) -> int:
    # Python's hash() of a str changes from process to process; the same data must give the same verdict on
    # every worker and after every restart. (The mean's seed is the one it had before quantiles came.)
    return zlib.crc32("\0".join((klass, metric, a, b) if stat == "mean" else (klass, metric, a, b, stat)).encode())


def _needed(n: int, gap: float, inner: float, noise: float, matters: float) -> int | None:
    """More samples per arm until the point estimate, if it held, would reach a verdict.

    Asked only of a gap beyond the practical margin (a smaller one is no_difference already), which stays what
    it is as samples come: a difference then needs the CI's end nearest to 1 beyond the margin and the gap
    beyond the noise floor. That end's distance from the point (`inner`) and the floor shrink as 1/sqrt(n), the
    margin does not. In logs, where swapping the arms only flips signs; with s the shrink factor that asks,
    n / s**2 samples in all.
    """
    if inner <= 0 or gap <= matters:
        return None
    shrink = min((gap - matters) / inner, gap / noise if noise > 0 else math.inf)
    if not 0 < shrink < 1:
        return None
    return max(1, math.ceil(n * (1 / shrink ** 2 - 1)))


def stats_of(metric: str) -> tuple[str, ...]:
    """What verdicts compare for `metric`: a latency's mean, median and tail; output tok/s's mean and median
    (its 99th percentile is its fastest requests, no tail anyone waits on); the mean alone of 0/1 error samples."""
    if metric == "error_rate":
        return ("mean",)
    return ("mean", "p50") if metric in HIGHER_IS_BETTER else STATS


def min_samples_of(stat: str, min_samples: int) -> int:
    """Samples an arm needs before a verdict on `stat`: `min_samples`, and TAIL_POINTS beyond a quantile."""
    q = QUANTILES.get(stat)
    return min_samples if q is None else max(min_samples, math.ceil(TAIL_POINTS / min(q, 1 - q) - 1e-9))


def _estimate(xa: np.ndarray, xb: np.ndarray, q: float | None, rate: bool, resamples: int, aa_repeats: int,
              rng: np.random.Generator) -> tuple[float | None, float | None, float | None, float | None]:
    """(ratio, CI low, CI high, noise floor in logs) of b's statistic over a's (the mean, or the q-quantile of
    samples sorted already); None for what cannot be had (an arm empty or at 0, a resample at 0)."""
    if not len(xa) or not len(xb):
        return None, None, None, None
    floor = _floor(len(xa), len(xb)) if rate else 0.0
    if q is None:
        sa, sb = float(_centre(xa.sum(), len(xa), floor)), float(_centre(xb.sum(), len(xb), floor))
    else:
        sa, sb = float(np.quantile(xa, q)), float(np.quantile(xb, q))
    if not (sa > 0 and sb >= 0):
        return None, None, None, None
    if q is None:
        boot_a, boot_b = _bootstrap(xa, resamples, rng, floor), _bootstrap(xb, resamples, rng, floor)
        of_rows = _mean_rows(rate)
    else:
        boot_a, boot_b = _bootstrap_quantile(xa, q, resamples, rng), _bootstrap_quantile(xb, q, resamples, rng)
        of_rows = _quantile_rows(q)
    with np.errstate(divide="ignore", invalid="ignore"):
        lo, hi = (float(v) for v in np.percentile(boot_b / boot_a, [2.5, 97.5]))
    aa = np.concatenate([_aa(xa, aa_repeats, rng, of_rows), _aa(xb, aa_repeats, rng, of_rows)])
    noise = float(np.quantile(aa, 0.95, method="higher")) if len(aa) else None
    # A resample whose denominator is 0 makes its ratio inf or NaN; such an interval says nothing.
    lo_, hi_, noise_ = (v if v is not None and math.isfinite(v) else None for v in (lo, hi, noise))
    return sb / sa, lo_, hi_, noise_


def _decide(metric: str, ratio: float, lo: float, hi: float, noise: float, margin: float, n: int) \
        -> tuple[str, int | None]:
    """The verdict and, when undecided, the samples still needed per arm (compare() says the rules)."""
    gap = abs(math.log(ratio)) if ratio > 0 else math.inf
    matters = math.log1p(margin)  # log(1 + m)
    band = max(noise, matters)
    # How far the CI's end nearest to 1 lies from it (0 when the CI holds 1).
    near = math.log(lo) if lo > 1 else (-math.log(hi) if hi > 0 else math.inf) if hi < 1 else 0.0
    if near > matters and gap > noise:
        return ("b_better" if (ratio < 1) == (metric in LOWER_IS_BETTER) else "a_better"), None
    if gap <= matters or (lo > 0 and -band <= math.log(lo) and math.log(hi) <= band):
        return "no_difference", None
    # The CI's half on the side of 1, from the point to its end (a bootstrap CI need not be symmetric).
    if ratio > 1:
        inner = math.log(ratio / lo) if lo > 0 else math.inf
    else:
        inner = math.log(hi / ratio) if ratio > 0 else 0.0
    return "insufficient_data", _needed(n, gap, inner, noise, matters)


def compare(klass: str, metric: str, a: str, a_samples: Iterable[float], b: str, b_samples: Iterable[float], *,
            stat: str = "mean", resamples: int = 1000, aa_repeats: int = 100, min_samples: int = 30,
            margin: float = MARGIN, seed: int | None = None) -> dict:
    """Verdict on arm b against arm a for one request class, metric and statistic; JSON-ready, never NaN or inf.

    ratio = s_b / s_a, s the mean or a quantile (`stat`), with a 95 % percentile-bootstrap CI. The noise floor
    is measured by A/A splits: each arm's samples are cut into two random halves `aa_repeats` times, and the
    floor is the 95th percentile of |s(h1)/s(h2)| - 1 (the larger half over the smaller) pooled over both arms.
    That is conservative: a half holds n/2 samples, so the A/A ratio varies about sqrt(2) times as much as the
    A/B ratio of two whole arms of n samples would if the arms were the same. The floor is measured inside one
    arm, so it cannot see what sets two engine processes apart with nothing changed (a few %): `margin`, the
    smallest difference that matters, covers that.

    Verdicts: a difference needs the whole CI outside [1/(1+m), 1+m], m the margin, and the ratio outside
    [1/(1+f), 1+f], f the noise floor: a team is never told "better" of a difference that may be smaller than
    the one it counts as one. "no_difference" is a ratio inside [1/(1+m), 1+m] however tight its CI, or a whole
    CI inside [1/(1+d), 1+d], d = max(f, m). Anything else (or fewer samples in an arm than `min_samples`, and
    than TAIL_POINTS beyond a quantile) is "insufficient_data" with an estimate of the samples still `needed`
    per arm.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {METRICS}")
    if stat not in stats_of(metric):
        raise ValueError(f"unknown statistic {stat!r} for {metric}; expected one of {stats_of(metric)}")
    if a == b:
        raise ValueError("the two arms must have different names")
    if not 0 <= margin < 1:
        raise ValueError("margin must be within [0, 1)")
    xa, xb = _clean(a_samples), _clean(b_samples)
    na, nb = len(xa), len(xb)
    q = QUANTILES.get(stat)
    if q is not None:
        xa, xb = np.sort(xa), np.sort(xb)
    rng = np.random.default_rng(_seed(klass, metric, a, b, stat) if seed is None else seed)
    ratio, lo, hi, noise = _estimate(xa, xb, q, metric == "error_rate", resamples, aa_repeats, rng)
    need = min_samples_of(stat, min_samples)
    if min(na, nb) < need:
        verdict, needed = "insufficient_data", need - min(na, nb)
    elif ratio is None or lo is None or hi is None or noise is None:
        verdict, needed = "insufficient_data", None
    else:
        verdict, needed = _decide(metric, ratio, lo, hi, noise, margin, min(na, nb))

    return {
        "class": klass, "metric": metric, "stat": stat, "arms": [a, b],
        "n": {a: na, b: nb},
        # The observed means, without the error-rate floor: an arm without errors reads 0.
        "mean": {a: _fig(xa.mean()) if na else None, b: _fig(xb.mean()) if nb else None},
        # The compared statistic of each arm, as observed (a quantile's own value, else the mean again).
        "value": {a: _fig(np.quantile(xa, q) if q is not None else xa.mean()) if na else None,
                  b: _fig(np.quantile(xb, q) if q is not None else xb.mean()) if nb else None},
        "ratio": _fig(ratio), "ci_low": _fig(lo), "ci_high": _fig(hi),
        "noise_floor": _fig(math.expm1(noise)) if noise is not None else None,
        "margin": margin,
        "verdict": verdict, "needed": needed,
        "better_is": "lower" if metric in LOWER_IS_BETTER else "higher",
    }


def _pct(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 2 else f"{v:.1f}"


def _name(c: dict) -> str:
    name = NAMES.get(c["metric"], c["metric"])
    stat = c.get("stat", "mean")
    return name if stat == "mean" else f"{name} {stat}"


def describe(c: dict) -> str:
    """One plain sentence for a compare() result."""
    name, klass = _name(c), c["class"]
    a, b = c["arms"]
    if c["verdict"] in ("a_better", "b_better"):
        # Speak of the winner against the loser: winner/loser = ratio when b wins, 1/ratio when a wins.
        flip = c["verdict"] == "a_better"
        winner, loser = (a, b) if flip else (b, a)
        r, lo, hi = c["ratio"], c["ci_low"], c["ci_high"]
        if flip:  # an arm at 0 (no output at all) makes the winner infinitely better; say so rather than raise
            r, lo, hi = (1 / v if v else math.inf for v in (r, hi, lo))
        word = "lower" if r < 1 else "higher"
        near, far = sorted((abs(lo - 1) * 100, abs(hi - 1) * 100))
        return (f"arm {winner}: {name} {_pct(abs(r - 1) * 100)} % {word} "
                f"(95 % CI {_pct(near)}-{_pct(far)} %) than {loser} on {klass}")
    if c["verdict"] == "no_difference":
        r, lo, hi = c["ratio"], c["ci_low"], c["ci_high"]
        if r and lo is not None and hi is not None and (lo > 1 or hi < 1) and c.get("margin"):
            # A real difference, as far as the data goes, but under what the experiment counts as one.
            word = "lower" if r < 1 else "higher"
            return (f"{name} on {klass}: no difference that matters (arm {b} {_pct(abs(r - 1) * 100)} % {word}, "
                    f"within the {_pct(c['margin'] * 100)} % margin)")
        return f"{name} on {klass}: not distinguishable (noise floor {_pct(c['noise_floor'] * 100)} %)"
    n = c.get("needed")
    more = f" (about {n} more request{'s' if n != 1 else ''} per arm)" if n else ""
    return f"{name} on {klass}: not enough data yet{more}"
