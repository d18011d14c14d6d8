"""Mergeable distributions: log-spaced buckets with a bounded relative error, added across processes."""

from __future__ import annotations

import math
from collections import deque
from itertools import islice
from typing import Any, Callable, Iterable, Mapping

# Every value is reported within 0.5 % of what it was: 1 ms reads as 0.995-1.005 ms. Buckets are log-spaced
# (DDSketch's mapping), so one bucket map serves ITLs of 100 us and generations of minutes alike; only
# occupied buckets are kept (a tight latency distribution fills a few dozen).
REL_ERR = 0.005
GAMMA = (1 + REL_ERR) / (1 - REL_ERR)
_LOG_GAMMA = math.log(GAMMA)
MIN_VALUE = 1e-6  # smaller values (and 0) share the lowest bucket
_MIN_INDEX = math.ceil(math.log(MIN_VALUE) / _LOG_GAMMA)
# No latency in seconds nor prompt in tokens comes near this: a bucket read from another process beyond it is
# not one (a bucket's value overflows a float past index ~71000).
MAX_VALUE = 1e12
_MAX_INDEX = math.ceil(math.log(MAX_VALUE) / _LOG_GAMMA)

Sketch = dict[int, float]  # bucket index -> weight


def index(v: float) -> int:
    return _MIN_INDEX if v <= MIN_VALUE else math.ceil(math.log(v) / _LOG_GAMMA)


def value(i: int) -> float:
    """The value a bucket stands for: within REL_ERR of everything in it."""
    return 2.0 * GAMMA ** i / (GAMMA + 1.0)


def build(values: Iterable[float]) -> Sketch:
    """A sketch of `values` at once (Sliding keeps one of a moving window)."""
    sk: Sketch = {}
    for v in values:
        i = index(v)
        sk[i] = sk.get(i, 0.0) + 1.0
    return sk


def add(into: Sketch, other: Sketch) -> Sketch:
    for i, w in other.items():
        into[i] = into.get(i, 0.0) + w
    return into


def quantile(sk: Sketch, q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of the weight at or below it (None when empty)."""
    total = sum(sk.values())
    if total <= 0:
        return None
    target = max(q * total, 1e-9) * (1 - 1e-12)  # float sums of weights must not miss the exact rank
    seen = 0.0
    keys = sorted(sk)
    for i in keys:
        seen += sk[i]
        if seen >= target:
            return value(i)
    return value(keys[-1])


def encode(sk: Mapping[int, float], weight: float = 1.0) -> dict:
    """JSON form: parallel lists of bucket indexes and counts, and `w`, what each count weighs (when not 1)."""
    keys = sorted(sk)
    out = {"i": keys, "n": [sk[i] for i in keys]}
    if weight != 1.0:
        out["w"] = weight
    return out


def decode(data: object) -> Sketch:
    """The sketch in `data`, or an empty one when `data` is not a well-formed encoding; ValueError when it has
    a bucket no value falls in (past MAX_VALUE) or a weight that is no count (another process's summary is read
    as a client's input: the summary is left out, see gateway.stats.merge)."""
    if not isinstance(data, dict):
        return {}
    keys, counts, w = data.get("i"), data.get("n"), data.get("w", 1.0)
    if (not isinstance(keys, list) or not isinstance(counts, list) or len(keys) != len(counts)
            or not isinstance(w, (int, float)) or not w > 0):
        return {}
    out: Sketch = {}
    for i, n in zip(keys, counts):
        if isinstance(i, int) and not isinstance(i, bool) and isinstance(n, (int, float)) and n > 0:
            if not _MIN_INDEX <= i <= _MAX_INDEX:
                raise ValueError(f"a sketch bucket {i} out of range")
            weight = n * w
            if not math.isfinite(weight):
                raise ValueError("a sketch weight that is not finite")
            out[i] = weight
    return out


class Sliding:
    """Per-group sketches of the samples in a bounded deque that fall inside a time window, kept current by
    adding what arrived and removing what left since the last read: a read costs the change, not the deque.

    Samples are tuples whose first field is their time, appended in time order; `group(sample)` names its
    group and `values(sample)` gives one value (or None: not sketched) per distribution.
    """

    def __init__(self, group: Callable[[tuple], Any], values: Callable[[tuple], tuple], n: int) -> None:
        self._group, self._values, self._n = group, values, n
        self._held: deque[tuple] = deque()  # (sequence number, time, group, bucket index or None per value)
        self._next = 0  # sequence number of the first sample not yet read
        self._window: float | None = None
        self.sketches: dict[Any, list[dict[int, int]]] = {}
        self.held: dict[Any, int] = {}  # samples per group inside the window

    def update(self, samples: deque, added: int, cutoff: float, window_s: float) -> None:
        """Catch up with `samples` (`added` appended since the start) and drop those older than `cutoff`."""
        if window_s != self._window:  # another window: what was dropped may belong again
            self._held.clear()
            self.sketches, self.held = {}, {}
            self._next, self._window = 0, window_s
        first = added - len(samples)  # sequence number of samples[0]
        new = added - max(self._next, first)
        if new > 0:
            fresh = list(islice(reversed(samples), new))
            fresh.reverse()
            for seq, s in enumerate(fresh, start=added - new):
                entry = (seq, s[0], self._group(s), tuple(None if v is None else index(v) for v in self._values(s)))
                self._held.append(entry)
                self._count(entry, 1)
        self._next = added
        held = self._held
        while held and (held[0][0] < first or held[0][1] < cutoff):
            self._count(held.popleft(), -1)

    def _count(self, entry: tuple, sign: int) -> None:
        _, _, g, idx = entry
        sks = self.sketches.get(g)
        if sks is None:
            sks = self.sketches[g] = [{} for _ in range(self._n)]
            self.held[g] = 0
        self.held[g] += sign
        for sk, i in zip(sks, idx):
            if i is not None:
                v = sk.get(i, 0) + sign
                if v:
                    sk[i] = v
                else:
                    del sk[i]
        if not self.held[g]:
            del self.sketches[g], self.held[g]
