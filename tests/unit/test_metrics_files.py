"""Several workers: counters and histograms copied into prometheus_client's value files merge to what one process shows."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import values as value_store
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe.lean_metrics import LeanCollector, LeanCounter, LeanFiles, LeanHistogram


def samples(registry: CollectorRegistry) -> set[tuple]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items())), round(s.value, 9))  # (sums added in another order)
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metrics() -> tuple[LeanHistogram, LeanCounter]:
    return (LeanHistogram("t_latency_seconds", "Latency", ["backend"], (0.1, 1.0)),
            LeanCounter("t_requests", "Requests", ["backend", "status"]))


def test_two_workers_files_merge_to_one_process_view(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    one_h, one_c = metrics()  # everything in one process: the reference
    workers = []
    for pid in (101, 102):  # two workers, each its own file (the library keys them by process id)
        h, c = metrics()
        workers.append((h, c, LeanFiles([h, c], value_store.MultiProcessValue(lambda pid=pid: pid))))
    observations = [(0, "a", 0.05), (0, "a", 0.5), (1, "a", 0.5), (1, "b", 3.0), (0, "b", 1.0), (1, "a", 0.1)]
    for i, (w, backend, v) in enumerate(observations):
        h, c, files = workers[w]
        for hist, count in ((h, c), (one_h, one_c)):
            hist.labels(backend).observe(v)
            count.labels(backend, "200").inc(2 if backend == "b" else 1)
        if i == 2:
            files.flush()  # a flush in the middle: later ones write the values that changed since
    for _, _, files in workers:
        files.flush()
        files.flush()  # nothing changed: the same values stay
    one = CollectorRegistry()
    one.register(LeanCollector([one_h, one_c]))
    merged = CollectorRegistry()
    MultiProcessCollector(merged, str(tmp_path))
    want = samples(one)
    assert ("t_latency_seconds_bucket", (("backend", "a"), ("le", "0.1")), 2.0) in want
    assert ("t_requests_total", (("backend", "b"), ("status", "200")), 4.0) in want
    assert samples(merged) == want


def test_nothing_reaches_the_files_before_a_flush(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    h, c = metrics()
    files = LeanFiles([h, c], value_store.MultiProcessValue(lambda: 7))
    c.labels("a", "200").inc()
    merged = CollectorRegistry()
    MultiProcessCollector(merged, str(tmp_path))
    assert samples(merged) == set()
    files.flush()
    assert ("t_requests_total", (("backend", "a"), ("status", "200")), 1.0) in samples(merged)
