"""The request-path stage map: every stage it stamps still exists where callers find it, and stage times are read
from the requests that met the stages in the commonest order."""

from __future__ import annotations

import importlib

from benchmarks import path_stages


def test_every_stage_names_a_callable_its_callers_look_up():
    for label, module, attr in path_stages.STAGES:
        owner = importlib.import_module(module)
        for part in attr.split("."):
            owner = getattr(owner, part)
        assert callable(owner), label


def test_stamping_marks_the_first_entry_and_starts_a_row_after_finish():
    stamps = path_stages.Stamps()
    calls = []
    fn = path_stages._stamped(lambda x: calls.append(x) or x * 2, "classify", stamps)
    assert fn(3) == 6 and calls == [3]
    for label in (path_stages.FIRST, "classify", "classify", "finish", path_stages.FIRST):
        stamps.mark(label)
    rows = stamps.take()
    assert len(rows) == 1 and sorted(rows[0]) == sorted({path_stages.FIRST, "classify", "finish"})


def test_stage_times_use_the_commonest_order_only():
    rows = [{"a": 0, "b": 2_000, "c": 5_000}, {"a": 0, "b": 4_000, "c": 6_000}, {"a": 0, "c": 1_000, "b": 9_000}]
    order, times = path_stages.stage_times(rows)
    assert order == ["a", "b", "c"]
    assert times == {"a → b": [2.0, 4.0], "b → c": [3.0, 2.0]}
