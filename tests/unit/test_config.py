"""Config loading: field-path errors, unknown keys, explicit auth, policies and their params, unreadable files."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, load_config, parse_config
from gateway.ops.reload import Reloader
from gateway.runtime import Gateway, build_policy

BACKEND = {"id": "a", "engine": "vllm", "url": "http://127.0.0.1:1", "models": ["m"]}
OPEN = {"auth": {"enabled": False}, "backends": [BACKEND]}


def test_unknown_key_rejected_with_its_path():
    with pytest.raises(ConfigError) as ei:
        parse_config({"auth": {"enabled": False}, "backends": [{**BACKEND, "urll": "x"}]}, build_policy)
    assert "backends[a].urll: unknown key (did you mean `url`?)" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        parse_config({"auth": {"enabled": False}, "server": {"prot": 1}, "backends": [BACKEND]}, build_policy)
    assert "server.prot" in str(ei.value)


def test_auth_must_be_explicitly_disabled():
    with pytest.raises(ConfigError) as ei:
        parse_config({"backends": [BACKEND]}, build_policy)
    assert "enabled = false" in str(ei.value)
    assert not parse_config({"auth": {"enabled": False}, "backends": [BACKEND]}, build_policy).auth.enabled


@pytest.mark.parametrize("bad,where", [
    ({"engine": "tgi"}, "backends[a].engine"),
    ({"url": "ftp://x"}, "backends[a].url"),
    ({"models": []}, "backends[a].models"),
    ({"classes": ["huge"]}, "backends[a].classes"),
])
def test_invalid_backend_fields(bad, where):
    with pytest.raises(ConfigError) as ei:
        parse_config({"auth": {"enabled": False}, "backends": [{**BACKEND, **bad}]}, build_policy)
    assert where in str(ei.value)


def test_duplicate_backend_ids_and_bad_digest():
    with pytest.raises(ConfigError, match="unique"):
        parse_config({"auth": {"enabled": False}, "backends": [BACKEND, BACKEND]}, build_policy)
    with pytest.raises(ConfigError, match="sha256"):
        parse_config({"auth": {"keys": [{"id": "k", "sha256": "abc"}]}, "backends": [BACKEND]}, build_policy)


def test_config_is_frozen():
    cfg = parse_config({"auth": {"enabled": False}, "backends": [BACKEND]}, build_policy)
    with pytest.raises(Exception):
        cfg.server.port = 1  # type: ignore[misc]


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml", build_policy)
    p = tmp_path / "bad.toml"
    p.write_text("[server\nport=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p, build_policy)
    p.write_bytes(b"\xff\xfe[server]")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(p, build_policy)
    with pytest.raises(ConfigError, match="cannot read configuration file .*: Is a directory"):
        load_config(tmp_path, build_policy)


def test_default_policy_is_shape():
    assert parse_config(OPEN, build_policy).routing.policy == "shape"


def routing_errors(routing: dict) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config({**OPEN, "routing": routing}, build_policy)
    head, *lines = str(ei.value).splitlines()
    assert head == "invalid configuration:"
    return [line.strip() for line in lines]


def test_unknown_policy_names_its_field_and_the_known_ones():
    assert routing_errors({"policy": "least-loaded"}) == [
        "routing.policy: unknown routing policy 'least-loaded' (did you mean `least_loaded`?); "
        "expected one of least_loaded, prefix_affinity, round_robin, shape"]
    lines = routing_errors({"policy": "shape", "models": {"m": {"policy": "fastest"}}})
    assert lines == ["routing.models.m.policy: unknown routing policy 'fastest'; "
                     "expected one of least_loaded, prefix_affinity, round_robin, shape"]


def test_bad_policy_params_name_their_path():
    lines = routing_errors({"policy": "prefix_affinity", "params": {"cache_threshold": 2, "cache_treshold": 0.5}})
    assert lines == ["routing.params.cache_threshold: Input should be less than or equal to 1",
                     "routing.params.cache_treshold: unknown key"]
    # A model's params are checked against its own policy, or the default one it inherits.
    lines = routing_errors({"policy": "shape", "models": {
        "a": {"params": {"herd_weight": -1}},
        "b": {"policy": "round_robin", "params": {"herd_weight": 1}},
        "c": {"policy": "prefix_affinity", "params": {"balance_rel": 1.2}}}})
    assert lines == ["routing.models.a.params.herd_weight: Input should be greater than or equal to 0",
                     "routing.models.b.params.herd_weight: unknown key"]


def test_unknown_default_policy_is_reported_once():
    # Models that inherit it have nothing to check their params against: one line, not one per model.
    assert routing_errors({"policy": "nope", "params": {"x": 1}, "models": {"m": {"params": {"y": 2}}}}) == [
        "routing.policy: unknown routing policy 'nope'; "
        "expected one of least_loaded, prefix_affinity, round_robin, shape"]


def test_policies_are_checked_when_a_file_loads(tmp_path):
    p = tmp_path / "gw.toml"
    p.write_text('[auth]\nenabled = false\n[routing]\npolicy = "shape"\nparams = { herd_weigth = 1 }\n'
                 '[[backends]]\nid = "a"\nengine = "vllm"\nurl = "http://127.0.0.1:1"\nmodels = ["m"]\n')
    with pytest.raises(ConfigError, match=r"routing\.params\.herd_weigth: unknown key"):
        load_config(p, build_policy)


def test_placeholder_and_bad_digests_say_how_to_make_one():
    for digest, words in (("run-shapegate-keys-new-and-put-its-sha256-here", "placeholder"), ("abc", "64-character")):
        with pytest.raises(ConfigError) as ei:
            parse_config({"auth": {"keys": [{"id": "k", "sha256": digest}]}, "backends": [BACKEND]}, build_policy)
        assert "auth.keys[k].sha256:" in str(ei.value) and words in str(ei.value)
        assert "shapegate keys new" in str(ei.value) and "Value error" not in str(ei.value)


def test_a_reload_refuses_a_bad_policy_the_same_way(tmp_path):
    g = Gateway(parse_config(OPEN, build_policy))
    p = tmp_path / "gw.toml"
    p.write_text('[auth]\nenabled = false\n[routing]\npolicy = "fastest"\n'
                 '[[backends]]\nid = "a"\nengine = "vllm"\nurl = "http://127.0.0.1:1"\nmodels = ["m"]\n')
    with pytest.raises(ConfigError, match=r"routing\.policy: unknown routing policy 'fastest'; expected one of"):
        Reloader(g, p).reload()
    assert g.cfg.routing.policy == "shape" and g.default_policy.name == "shape"
