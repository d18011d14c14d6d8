"""Counters and histograms kept in a process's memory, and their copy into prometheus_client's files for workers."""

from __future__ import annotations

import math
from bisect import bisect_left
from itertools import accumulate
from typing import Any, Iterable, Iterator

from prometheus_client import values as value_store
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class LeanChild:
    """One label set of a LeanHistogram."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1  # first bound >= v: Prometheus' le
        self.sum += v


class LeanHistogram:
    """A histogram without prometheus_client's per-value locks (the gateway runs no threads): an observation
    is one bisect and two additions, a quarter of the library's cost on the per-request path."""

    def __init__(self, name: str, doc: str, labelnames: Iterable[str] = (), buckets: Iterable[float] = ()) -> None:
        self.name, self.doc, self.labelnames = name, doc, list(labelnames)
        self.bounds = (*(float(b) for b in buckets), math.inf)
        self._children: dict[tuple[str, ...], LeanChild] = {}

    def labels(self, *values: str) -> LeanChild:
        c = self._children.get(values)
        if c is None:
            c = self._children[values] = LeanChild(self.bounds)
        return c

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds]
        for values, c in self._children.items():
            fam.add_metric(list(values), list(zip(les, accumulate(c.counts))), c.sum)
        return fam

    def file_samples(self) -> Iterator[tuple[str, list[str], tuple[str, ...], float]]:
        """As prometheus_client's value files hold a histogram: each bucket's own count (not cumulative), the sum."""
        les = [floatToGoString(b) for b in self.bounds]
        with_le = [*self.labelnames, "le"]
        for values, c in self._children.items():
            for le, n in zip(les, c.counts):
                yield self.name + "_bucket", with_le, (*values, le), float(n)
            yield self.name + "_sum", self.labelnames, values, c.sum


class LeanCounterChild:
    """One label set of a LeanCounter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LeanCounter:
    """A counter without prometheus_client's per-increment lock, for the same reason as LeanHistogram."""

    def __init__(self, name: str, doc: str, labelnames: Iterable[str] = ()) -> None:
        self.name, self.doc, self.labelnames = name, doc, list(labelnames)
        self._children: dict[tuple[str, ...], LeanCounterChild] = {}
        if not self.labelnames:
            self.labels()  # shown as 0 from the start, as prometheus_client does

    def labels(self, *values: str) -> LeanCounterChild:
        c = self._children.get(values)
        if c is None:
            c = self._children[values] = LeanCounterChild()
        return c

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def family(self) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, c in self._children.items():
            fam.add_metric(list(values), c.value)
        return fam

    def file_samples(self) -> Iterator[tuple[str, list[str], tuple[str, ...], float]]:
        for values, c in self._children.items():
            yield self.name + "_total", self.labelnames, values, c.value


class LeanCollector(Collector):
    def __init__(self, metrics: list[LeanHistogram | LeanCounter]) -> None:
        self._metrics = metrics

    def collect(self):
        return [m.family() for m in self._metrics]


class LeanFiles:
    """Several processes: this worker's counters and histograms copied into its prometheus_client value files, on
    the 0.2 s timer and before a scrape, where any worker's scrape merges them. A request pays no lock, no getpid
    and no file write per value (the library's multiprocess values do all three on every increment)."""

    def __init__(self, metrics: list[LeanHistogram | LeanCounter], value_class: Any = None) -> None:
        self._metrics = metrics
        # The library's multiprocess value (a process's file, found by its pid), chosen since the directory was set.
        self._value_class = value_class or value_store.ValueClass
        self._written: dict[tuple[str, tuple[str, ...]], tuple[Any, float]] = {}

    def flush(self) -> None:
        written = self._written
        for m in self._metrics:
            typ = "histogram" if isinstance(m, LeanHistogram) else "counter"
            for name, labelnames, labelvalues, v in m.file_samples():
                key = (name, labelvalues)
                entry = written.get(key)
                if entry is None:
                    value = self._value_class(typ, m.name, name, labelnames, labelvalues, m.doc)
                elif entry[1] == v:
                    continue
                else:
                    value = entry[0]
                value.set(v)
                written[key] = (value, v)
