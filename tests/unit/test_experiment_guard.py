"""The error guard of a split experiment, and the report around it: a failing arm is stopped (and says so),
an arm as good as the other never is, an admin's change lifts the stop."""

from __future__ import annotations

import logging
import random

import pytest

from gateway.config import parse_config
from gateway.contracts import ENGINE_ERROR, OK, Outcome, RequestShape
from gateway.experiments.experiment import ALL, Experiment, Experiments, enter
from gateway.experiments.guard import WINDOW, shared_stop
from gateway.experiments.report import report
from gateway.keys.auth import ANONYMOUS
from gateway.keys.principal import Principal
from gateway.runtime import build_policy

SHAPE = RequestShape("m", "chat", True, 10, 10, "default")


def experiment(weights=(1, 1), **over) -> Experiment:
    x = {"name": "ab", "model": "m", "arms": [{"name": "a", "backends": ["e0"], "weight": weights[0]},
                                              {"name": "b", "backends": ["e1"], "weight": weights[1]}], **over}
    backends = [{"id": f"e{i}", "engine": "vllm", "url": f"http://127.0.0.1:{9000 + i}", "models": ["m"]}
                for i in range(2)]
    return Experiment(parse_config({"auth": {"enabled": False}, "backends": backends, "experiments": [x]},
                                   build_policy).experiments[0])


def outcome(arm: str, failed: bool) -> Outcome:
    if failed:
        return Outcome("e1" if arm == "b" else "e0", SHAPE, False, 500, e2e=0.01, result=ENGINE_ERROR)
    return Outcome("e1" if arm == "b" else "e0", SHAPE, True, 200, ttft=0.1, itl=0.01, e2e=0.2,
                   completion_tokens=10, result=OK)


def serve(x: Experiment, rates: dict[str, float], n: int, seed: int = 0) -> None:
    """`n` requests per arm, in turn, each an engine error with its arm's rate."""
    rng = random.Random(seed)
    for _ in range(n):
        for arm, rate in rates.items():
            x.record(arm, "default", outcome(arm, rng.random() < rate))


def test_a_failing_arm_is_stopped_and_its_subjects_go_to_the_other(caplog):
    caplog.set_level(logging.WARNING, logger="shapegate.experiments")
    x = experiment()
    before = {s: x.assign(s).name for s in (f"k{i}" for i in range(200))}
    assert set(before.values()) == {"a", "b"}
    serve(x, {"a": 0.01, "b": 0.30}, 60)
    assert set(x.guard.stopped) == {"b"}
    assert {x.assign(s).name for s in before} == {"a"}
    stop = x.guard.stopped["b"]
    assert stop.other == "a" and stop.requests >= 50 and stop.errors / stop.requests > 0.15
    (line,) = [r.getMessage() for r in caplog.records if "error guard" in r.getMessage()]
    assert line.startswith("experiment ab: arm b stopped by the error guard: ") and "shapegate ab start ab" in line
    # The report: the arm takes no share here, and says why.
    r = report(x.snapshot([]))
    b = r["arms"][1]
    assert (b["share"], b["serving"], b["weight"]) == (0.0, False, 1.0)
    assert b["guard"]["against"] == "a" and b["guard"]["processes"] == 1 and "engine errors" in b["guard"]["reason"]
    assert r["arms"][0]["guard"] is None and r["arms"][0]["share"] == 1.0
    assert r["error_guard"] == {"margin": 0.05, "min_requests": 50, "window": WINDOW}


@pytest.mark.parametrize("rate", [0.0, 0.02, 0.10])
def test_arms_as_good_as_each_other_are_never_stopped(rate):
    for seed in range(10):
        x = experiment()
        serve(x, {"a": rate, "b": rate}, 3000, seed)
        assert not x.guard.stopped, (rate, seed)


def test_a_few_unlucky_errors_on_few_requests_stop_nothing():
    # 5 errors in 50 against 0 in 50: 10 points over, but within chance (the z-test), so not yet.
    x = experiment()
    serve(x, {"a": 0.0}, 50)
    for i in range(50):
        x.record("b", "default", outcome("b", i < 5))
    assert not x.guard.stopped
    # Below the minimum of requests nothing is judged at all, however bad.
    y = experiment()
    serve(y, {"a": 0.0, "b": 1.0}, 49)
    assert not y.guard.stopped


def test_the_last_arm_serving_is_never_stopped():
    x = experiment(weights=(1, 0))  # a ramp not yet begun: b takes no traffic, a is all there is
    serve(x, {"a": 0.5, "b": 0.0}, 200)
    assert not x.guard.stopped


def test_a_run_time_change_lifts_the_stop_and_the_old_errors_do_not_stop_it_again(caplog):
    caplog.set_level(logging.INFO, logger="shapegate.experiments")
    x = experiment()
    serve(x, {"a": 0.0, "b": 0.5}, 100)
    assert "b" in x.guard.stopped
    x.change(enabled=True)  # `shapegate ab start ab`
    assert not x.guard.stopped and {x.assign(f"k{i}").name for i in range(100)} == {"a", "b"}
    assert any("stops lifted" in r.getMessage() for r in caplog.records)
    x.record("b", "default", outcome("b", True))  # one more error: judged on the new window only
    assert not x.guard.stopped
    serve(x, {"a": 0.0, "b": 0.5}, 100)  # still failing: stopped again
    assert "b" in x.guard.stopped
    x.adopt({"version": x.version + 5, "weights": {"a": 1, "b": 1}})  # another process's change lifts it too
    assert not x.guard.stopped


def test_the_guard_judges_recent_requests_not_the_whole_past():
    x = experiment()
    serve(x, {"a": 0.0, "b": 0.0}, 5000)  # hours of good service
    serve(x, {"a": 0.0, "b": 0.2}, 2 * WINDOW)  # then 20 % errors: stopped within two windows
    assert "b" in x.guard.stopped
    assert x.classes["b", ALL].errors / x.classes["b", ALL].requests < 0.05  # all time, it would not be


def test_shadow_experiments_have_no_guard_and_a_margin_of_one_is_off():
    shadow = {"name": "sh", "model": "m", "mode": "shadow", "arms": [{"name": "c", "backends": ["e1"]}]}
    backends = [{"id": f"e{i}", "engine": "vllm", "url": f"http://127.0.0.1:{9000 + i}", "models": ["m"]}
                for i in range(2)]
    cfg = parse_config({"auth": {"enabled": False}, "backends": backends, "experiments": [shadow]}, build_policy)
    assert Experiment(cfg.experiments[0]).guard is None
    x = experiment(error_guard_margin=1.0)
    serve(x, {"a": 0.0, "b": 1.0}, 200)
    assert not x.guard.stopped


def test_stops_shared_by_other_processes_are_checked_and_counted():
    x = experiment()
    serve(x, {"a": 0.0, "b": 0.5}, 100)
    mine = x.shared_samples(400)["guard"]["b"]
    assert shared_stop(mine) == mine
    for bad in (None, [], {**mine, "error_rate": 2}, {**mine, "at": "now"}, {**mine, "reason": "x" * 401},
                {**mine, "requests": True}, {**mine, "against": ""}, {**mine, "margin": float("nan")}):
        assert shared_stop(bad) is None, bad
    y = experiment()  # a process that stopped nothing, told of two that did and one that sent rubbish
    b = report(y.snapshot([{"guard": {"b": mine}}, {"guard": {"b": mine}}, {"guard": {"b": {"at": 1}}}]))["arms"][1]
    assert b["guard"]["processes"] == 2 and b["serving"] is True


def test_the_report_nests_each_metrics_quantile_verdicts_under_its_mean():
    x = experiment(practical_margin=0.1)
    serve(x, {"a": 0.0, "b": 0.0}, 40)
    r = report(x.snapshot([]))
    assert r["practical_margin"] == 0.1
    by_metric = {c["metric"]: c for c in r["comparisons"] if c["class"] == "default"}
    assert set(by_metric) == {"ttft", "itl", "e2e", "output_tps", "error_rate"}
    assert set(by_metric["ttft"]["quantiles"]) == {"p50", "p99"} and by_metric["error_rate"]["quantiles"] == {}
    assert set(by_metric["output_tps"]["quantiles"]) == {"p50"}
    for c in by_metric.values():
        assert c["stat"] == "mean" and c["margin"] == 0.1 and c["summary"]
        for stat, q in c["quantiles"].items():
            assert (q["stat"], q["metric"], q["class"]) == (stat, c["metric"], "default") and q["summary"]


def test_without_its_subject_a_request_keeps_to_its_session_then_its_key():
    xs = Experiments([experiment(subject="header:x-end-user").cfg])
    x = xs.by_name["ab"]
    user = Principal("team-1", admin=False)

    def arm(caller, session, headers):
        shape = RequestShape("m", "chat", True, 10, 10, "default", principal=caller.id, session_id=session)
        return enter(xs, caller, shape, {}, headers, []).arm.name

    assert arm(user, "s-9", {"x-end-user": "u-1"}) == x.assign("u-1").name
    assert {arm(user, "s-9", {}) for _ in range(20)} == {x.assign("s-9").name}
    assert {arm(user, None, {}) for _ in range(20)} == {x.assign("team-1").name}
    # Auth off: every caller is the same anonymous one, no key to keep a client to; it draws, as before.
    assert {arm(ANONYMOUS, None, {}) for _ in range(60)} == {"a", "b"}
