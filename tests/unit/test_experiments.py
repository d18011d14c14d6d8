"""Experiment assignment and configuration: shares that follow the weights, sticky subjects, errors with paths."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config
from gateway.contracts import OK, Outcome, RequestShape
from gateway.experiments.experiment import ALL, Experiment, Experiments, bucket, check_change
from gateway.runtime import build_policy


def backends(n: int = 3, model: str = "m") -> list[dict]:
    return [{"id": f"e{i}", "engine": "vllm", "url": f"http://127.0.0.1:{9000 + i}", "models": [model]}
            for i in range(n)]


def config(*experiments: dict, n: int = 3) -> dict:
    return {"auth": {"enabled": False}, "backends": backends(n), "experiments": list(experiments)}


def split(**over) -> dict:
    x = {"name": "ab", "model": "m", "arms": [{"name": "a", "backends": ["e0"], "weight": 90},
                                              {"name": "b", "backends": ["e1"], "weight": 10}]}
    return {**x, **over}


def experiment(**over) -> Experiment:
    return Experiment(parse_config(config(split(**over)), build_policy).experiments[0])


@pytest.mark.parametrize("weights", [(90, 10), (50, 50), (1, 99), (1, 1)])
def test_ten_thousand_subjects_split_within_two_points_of_the_weights(weights):
    x = experiment(arms=[{"name": "a", "backends": ["e0"], "weight": weights[0]},
                         {"name": "b", "backends": ["e1"], "weight": weights[1]}])
    got_a = sum(x.assign(f"subject-{i}").name == "a" for i in range(10_000)) / 10_000
    assert abs(got_a - weights[0] / sum(weights)) <= 0.02


def test_a_subject_always_gets_the_same_arm_and_a_ramp_moves_only_the_ramped_share():
    x = experiment()
    before = {s: x.assign(s).name for s in (f"k{i}" for i in range(2000))}
    assert before == {s: x.assign(s).name for s in before}
    x.change({"a": 50, "b": 50})
    after = {s: x.assign(s).name for s in before}
    # Ramping the candidate up never moves one of its subjects back to the other arm.
    assert all(after[s] == "b" for s, arm in before.items() if arm == "b")
    assert bucket("ab", "k1") == bucket("ab", "k1") != bucket("other", "k1")


def test_subjects_by_key_session_user_and_header():
    body = {"user": "u-1"}
    headers = {"x-team": "blue"}
    assert experiment(subject="key").subject_of("alice", "s1", body, headers) == "alice"
    assert experiment(subject="session").subject_of("alice", "s1", body, headers) == "s1"
    assert experiment(subject="user").subject_of("alice", "s1", body, headers) == "u-1"
    assert experiment(subject="header:X-Team").subject_of("alice", "s1", body, headers) == "blue"
    # Without its subject a request keeps to its session, else to its key: one conversation never hops arms.
    assert experiment(subject="user").subject_of("alice", None, {"user": 5}, {}) == "alice"
    assert experiment(subject="header:x-end-user").subject_of("alice", "s1", body, headers) == "s1"
    assert experiment(subject="header:x-end-user").subject_of("alice", None, body, headers) == "alice"
    assert experiment(subject="session").subject_of(None, None, body, headers) is None  # auth off: no key


@pytest.mark.parametrize("bad, where", [
    (split(model="nope"), "experiments[ab].model"),
    (split(arms=[{"name": "a", "backends": ["e0"]}, {"name": "b", "backends": ["zz"]}]), "experiments[ab].arms[b].backends"),
    (split(arms=[{"name": "a", "backends": ["e0"], "weight": 0}, {"name": "b", "backends": ["e1"], "weight": 0}]),
     "at least one arm"),
    (split(arms=[{"name": "a", "backends": ["e0"], "weight": -1}, {"name": "b", "backends": ["e1"]}]),
     "experiments[ab].arms[a].weight"),
    (split(arms=[{"name": "a", "backends": ["e0"]}, {"name": "b", "backends": ["e0"]}]), "two arms"),
    (split(arms=[{"name": "a", "backends": ["e0"]}]), "two or more arms"),
    (split(subject="cookie"), "experiments[ab].subject"),
    (split(mode="both"), "experiments[ab].mode"),
])
def test_bad_experiments_are_config_errors_with_the_fields_path(bad, where):
    with pytest.raises(ConfigError) as e:
        parse_config(config(bad), build_policy)
    assert where in str(e.value)


def test_an_arm_in_two_modes_at_once_is_refused():
    shadow = {"name": "sh", "model": "m", "mode": "shadow", "arms": [{"name": "c", "backends": ["e1"]}]}
    with pytest.raises(ConfigError) as e:
        parse_config(config(split(), shadow), build_policy)
    assert "two modes at once" in str(e.value)
    only = {"name": "sh", "model": "m", "mode": "shadow", "arms": [{"name": "c", "backends": ["e0", "e1"]}]}
    with pytest.raises(ConfigError) as e:
        parse_config(config(only, n=2), build_policy)
    assert "leave at least one to serve" in str(e.value)


def test_run_time_changes_are_checked_before_anything_changes():
    x = experiment()
    for bad in ({"weights": {"a": 0, "b": 0}}, {"weights": {"c": 1}}, {"weights": {"a": True}},
                {"weights": {"a": float("nan")}}, {"weights": {"a": float("inf")}}, {"fraction": 0.5},
                {"enabled": 1}):
        assert check_change(x, bad) is not None, bad
    assert check_change(x, {"weights": {"a": 0}, "enabled": False}) is None


def test_a_reload_keeps_samples_of_an_unchanged_experiment_and_not_of_a_changed_one():
    cfg = parse_config(config(split()), build_policy)
    xs = Experiments(cfg.experiments)
    shape = RequestShape("m", "chat", True, 10, 10, "default")
    xs.by_name["ab"].record("a", "default", Outcome("e0", shape, True, 200, ttft=0.1, itl=0.01, e2e=0.2,
                                                    completion_tokens=10, result=OK))
    kept = Experiments(cfg.experiments, previous=xs)
    assert kept.by_name["ab"] is xs.by_name["ab"]
    reweighted = parse_config(config(split(arms=[{"name": "a", "backends": ["e0"], "weight": 1},
                                                 {"name": "b", "backends": ["e1"], "weight": 1}])), build_policy)
    renewed = Experiments(reweighted.experiments, previous=xs).by_name["ab"]
    assert renewed.classes[("a", ALL)].requests == 1 and renewed.arms[0].weight == 1
    moved = parse_config(config(split(arms=[{"name": "a", "backends": ["e2"]}, {"name": "b", "backends": ["e1"]}])),
                         build_policy)
    assert Experiments(moved.experiments, previous=xs).by_name["ab"].classes == {}
