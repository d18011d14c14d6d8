"""Health state machine, breaker, failure charging and Retry-After, table-driven on a fake clock."""

from __future__ import annotations

import email.utils

import pytest

from backends.openai_http import OpenAIHTTPBackend
from gateway.config import HealthConfig
from gateway.contracts import DRAINING, READY, STARTING, UNHEALTHY, ProbeResult
from gateway.errors import retry_after_header
from gateway.fleet.health import CLOSED, HALF_OPEN, OPEN, Breaker, HealthState
from gateway.routing.failover import charge_status, retry_after_s

OK = ProbeResult(True, 200, "ok")
REFUSED = ProbeResult(False, 0, "connect failed", refused=True)
LOADING = ProbeResult(False, 503, "Loading model")
DEAD = ProbeResult(False, 503, "HTTP 503")
TIMEOUT = ProbeResult(False, 0, "TimeoutError")
ALIVE = ProbeResult(True, 200, "ok", liveness_only=True)
NOT_ALIVE = ProbeResult(False, 0, "connect failed", refused=True, liveness_only=True)

CFG = HealthConfig(healthy_threshold=1, unhealthy_threshold=2)
STRICT = HealthConfig(healthy_threshold=2, unhealthy_threshold=3)


@pytest.mark.parametrize("name,cfg,probes,states", [
    ("vLLM loading: refused keeps it starting, then ready",
     CFG, [REFUSED, REFUSED, REFUSED, OK], [STARTING, STARTING, STARTING, READY]),
    ("llama.cpp / SGLang loading: 503 keeps it starting",
     CFG, [LOADING, LOADING, OK], [STARTING, STARTING, READY]),
    ("a starting engine that times out is unhealthy after the threshold",
     CFG, [TIMEOUT, TIMEOUT], [STARTING, UNHEALTHY]),
    ("ready -> one bad probe is tolerated, two are not",
     CFG, [OK, DEAD, OK, DEAD, DEAD], [READY, READY, READY, READY, UNHEALTHY]),
    ("ready -> refused means the process is gone: unhealthy at once",
     CFG, [OK, REFUSED], [READY, UNHEALTHY]),
    ("unhealthy -> ready again after healthy_threshold good probes",
     STRICT, [OK, OK, TIMEOUT, TIMEOUT, TIMEOUT, OK, OK], [STARTING, READY, READY, READY, UNHEALTHY, UNHEALTHY, READY]),
    ("a liveness answer never makes a backend ready",
     CFG, [ALIVE, ALIVE, OK, ALIVE], [STARTING, STARTING, READY, READY]),
    ("a failed liveness check on a ready backend counts like any failure",
     CFG, [OK, NOT_ALIVE], [READY, UNHEALTHY]),
])
def test_state_machine(name, cfg, probes, states):
    h = HealthState(now=0.0)
    seen = []
    for t, r in enumerate(probes, start=1):
        changed = h.on_probe(r, cfg, float(t))
        seen.append(h.state)
        if changed is not None:
            assert changed == h.state and h.changed_at == float(t)
    assert seen == states, name


def test_draining_ignores_probes_and_promotes_reports_readiness():
    h = HealthState(now=0.0)
    assert h.promotes(OK, CFG) and not h.promotes(ALIVE, CFG) and not h.promotes(DEAD, CFG)
    h.drain(now=5.0)
    assert h.on_probe(OK, CFG, 6.0) is None and h.state == DRAINING and h.changed_at == 5.0


@pytest.mark.parametrize("fails,expected", [(0, 0.5), (1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (10, 3.0)])
def test_failing_backends_back_off_exponentially_up_to_a_cap(fails, expected):
    h = HealthState(now=0.0)
    h.fail_streak = fails
    assert h.next_delay(HealthConfig(interval_s=0.5, backoff_max_s=3.0)) == expected


def test_breaker_opens_after_consecutive_failures_and_lets_one_trial_through():
    b = Breaker(threshold=3, open_s=5.0)
    for t in (1.0, 2.0):
        b.on_failure(t)
        assert b.state(t) == CLOSED and b.allows(t)
    b.on_success()  # a success in between resets the count
    for t in (3.0, 4.0, 5.0):
        b.on_failure(t)
    assert b.state(5.0) == OPEN and not b.allows(9.9) and b.reopens_in(6.0) == pytest.approx(4.0)
    assert b.state(10.0) == HALF_OPEN and b.allows(10.0)
    b.on_attempt(10.0)
    assert not b.allows(10.1), "only one trial at a time"
    b.release()  # the trial's client left: no verdict, the next request may try
    assert b.allows(10.2)
    b.on_attempt(10.2)
    b.on_failure(10.3)  # a failed trial opens again at once
    assert b.state(10.3) == OPEN and b.state(15.3) == HALF_OPEN
    b.on_attempt(15.3)
    b.on_success()
    assert b.state(15.4) == CLOSED and b.failures == 0


def test_breaker_hold_opens_at_once_and_is_never_shortened():
    b = Breaker(threshold=5, open_s=1.0)
    b.on_failure(0.0, hold_s=30.0)  # an engine's Retry-After
    assert b.state(0.0) == OPEN
    b.on_failure(1.0)
    assert b.state(29.0) == OPEN and b.state(30.0) == HALF_OPEN


@pytest.mark.parametrize("headers,expected", [
    ({}, 1.5),
    ({"Retry-After": "7"}, 7.0),
    ({"retry-after": "2.5"}, 2.5),
    ({"Retry-After": "9999"}, 120.0),
    ({"Retry-After": "-3"}, 0.0),
    ({"Retry-After": "soon"}, 1.5),
    ({"Retry-After": "nan"}, 1.5),
    ({"Retry-After": email.utils.formatdate(1_000_030, usegmt=True)}, 30.0),
])
def test_retry_after_parsing(headers, expected):
    assert retry_after_s(headers, 1.5, now=1_000_000) == pytest.approx(expected)


@pytest.mark.parametrize("seconds,header", [(0.0, "1"), (0.2, "1"), (1.2, "2"), (119.5, "120"), (500, "120")])
def test_retry_after_header_is_whole_seconds_between_1_and_120(seconds, header):
    assert retry_after_header(seconds) == header


@pytest.mark.parametrize("status,charge", [
    (400, "client"), (404, "client"), (413, "client"), (422, "client"), (501, "client"),
    (429, "hold"), (503, "hold"), (500, "suspect"), (502, "failure"), (504, "failure"),
])
def test_what_an_engine_status_means(status, charge):
    assert charge_status(status) == charge


def test_a_success_that_started_before_the_latest_failure_proves_nothing():
    b = Breaker(threshold=2, open_s=5.0)
    b.on_failure(10.0)
    b.on_success(started=9.0)  # a stream that began before the engine went bad
    b.on_failure(11.0)
    assert b.state(11.0) == OPEN, "the old success did not reset the count"
    b.on_success(started=8.0)
    assert b.state(12.0) == OPEN, "nor does it close an open breaker"
    b.on_attempt(16.0)
    b.on_success(started=16.0)  # the half-open trial started after the failures
    assert b.state(16.1) == CLOSED


@pytest.mark.parametrize("body,detail", [
    (b'{"error":{"message":"Loading model","type":"unavailable_error","code":503}}', "Loading model"),
    (b'{"error":"Loading\\u001b[31m\\nforged log line"}', "Loading?[31m?forged log line"),  # a string, not a dict
    (b'{"message":"' + b"x" * 500 + b'"}', "x" * 200),
    (b"[1, 2]", "HTTP 503"),
    (b"not json", "HTTP 503"),
])
def test_an_engines_health_message_is_logged_and_shown_only_as_printable_text(body, detail):
    """What an engine says of its health reaches log lines and `shapegate check`: never a control character
    (a forged log line, a terminal escape), never unbounded, and any JSON shape is read without failing."""
    assert OpenAIHTTPBackend.health_detail(None, 503, body) == detail
