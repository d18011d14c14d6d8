"""The queue's figures in /stats: each process's report, and the reports of several processes merged into one."""

from __future__ import annotations

from gateway.config_queue import AdmissionConfig, QueueConfig, QueueSettings
from gateway.queueing.waiting import WaitQueue
from gateway.stats.merge import merge_queues


def report(length: int, served: int, mean: float, longest: float) -> dict:
    ended = {"served": {"count": served, "mean_wait_s": mean, "max_wait_s": longest}} if served else {}
    return {"length": length, "priorities": {"high": {"length": 0, "ended": {}},
                                             "normal": {"length": length, "ended": ended},
                                             "low": {"length": 0, "ended": {}}}}


def test_reports_add_up_across_processes_and_a_malformed_one_is_skipped():
    merged = merge_queues([report(2, 3, 0.1, 0.2), report(1, 1, 0.5, 0.9), None, {"length": "many"}])
    assert merged["length"] == 3
    normal = merged["priorities"]["normal"]
    assert normal["length"] == 3
    assert normal["ended"]["served"] == {"count": 4, "mean_wait_s": 0.2, "max_wait_s": 0.9}


def test_an_empty_queue_reports_every_priority():
    qs = QueueSettings(QueueConfig(), AdmissionConfig())
    q = WaitQueue(lambda: qs)
    assert q.report() == {"length": 0, "priorities": {p: {"length": 0, "ended": {}} for p in ("high", "normal", "low")}}
