"""A backend's circuit breaker says when it opens (WARNING, once per opening) and when it closes again (INFO)."""

from __future__ import annotations

import logging

from gateway.fleet.health import Breaker


def test_a_breaker_logs_each_opening_once_and_its_recovery(caplog):
    caplog.set_level(logging.INFO, logger="shapegate.health")
    b = Breaker(2, 5.0, "vllm-0")
    b.on_failure(100.0)
    assert not caplog.records  # one failure opens nothing
    b.on_failure(100.5)
    b.on_failure(101.0)  # while open: no new opening, no new line
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "backend vllm-0 is failing: 2 failed request(s) in a row; its circuit breaker is open for 5.0 s")]
    caplog.clear()
    b.on_failure(120.0, hold_s=30.0)  # a new opening: an engine's Retry-After
    assert caplog.records[0].getMessage() == ("backend vllm-0 is failing: it asked to wait (Retry-After) or refused "
                                              "the connection; its circuit breaker is open for 30.0 s")
    caplog.clear()
    b.on_success()
    b.on_success()  # already closed: nothing more to say
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "backend vllm-0 recovered: its health probe passed, its circuit breaker closed")]
