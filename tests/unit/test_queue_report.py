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


def test_the_metrics_label_configured_keys_by_id_and_every_other_key_as_other():
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.observe.lean_metrics import LeanCounter, LeanHistogram
    from gateway.observe.queue_metrics import QueueMetrics
    from gateway.queueing.order import FairOrder

    class Queue:
        order = FairOrder(3, lambda key: 1.0)

    r = CollectorRegistry()
    m = QueueMetrics(lambda *a: LeanHistogram(*a), lambda *a: LeanCounter(*a), r, lambda: {"team-a"})
    q = Queue()
    for key in ("team-a", "team-a", "runtime-1", "runtime-2"):
        q.order.add(1, key, 0.0, None)
    m.changed(q)
    text = generate_latest(r).decode()
    assert 'shapegate_queue_length{priority="normal"} 4.0' in text
    assert 'shapegate_queue_length_by_key{key="team-a"} 2.0' in text
    assert 'shapegate_queue_length_by_key{key="other"} 2.0' in text and "runtime-1" not in text
    for w in list(q.order.in_order()):
        q.order.remove(w)
    m.changed(q)
    text = generate_latest(r).decode()
    assert 'shapegate_queue_length_by_key{key="team-a"} 0.0' in text  # not its last length
