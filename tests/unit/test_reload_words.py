"""What a reload logs: the changes in words (gateway/ops/reload.py in_words), never a Python dict."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from gateway.config import GatewayConfig, parse_config
from gateway.keys.principal import hash_key
from gateway.ops import reload
from gateway.ops.reload import in_words, plan
from gateway.runtime import build_policy
from tests.procs import write_config


def backend(i: str, url: str = "http://127.0.0.1:1") -> dict[str, Any]:
    return {"id": i, "engine": "vllm", "url": url, "models": ["m"]}


def key(i: str, admin: bool = False) -> dict[str, Any]:
    return {"id": i, "sha256": hash_key("sk-" + i), "admin": admin}


def cfg(backends: list[dict[str, Any]], keys: list[dict[str, Any]] = (), **sections: Any) -> GatewayConfig:
    return parse_config({"auth": {"keys": list(keys)}, "backends": backends, **sections}, build_policy)


def words(old: GatewayConfig, new: GatewayConfig) -> str:
    return in_words(old, new, plan(old, new))


def test_the_example_of_the_brief():
    old = cfg([backend("a"), backend("b")], [key("u1")])
    new = cfg([backend("a"), backend("c")], [key("u1"), key("u2"), key("u3")], routing={"policy": "least_loaded"})
    assert words(old, new) == "backends added c, removed b; policy shape -> least_loaded; 2 keys added"


def test_every_kind_of_change_in_words():
    old = cfg([backend("a"), backend("b"), backend("c"), backend("d")], [key("k1"), key("k2"), key("k3")],
              routing={"models": {"m": {"policy": "round_robin"}}})
    new = cfg([backend("a", "http://127.0.0.1:2"), {**backend("b"), "weight": 2.0}, backend("e"), backend("f"),
               backend("c")],
              [key("k1", admin=True), key("k4")],
              routing={"params": {"herd_weight": 0.5}, "models": {"m": {"policy": "least_loaded"}},
                       "max_attempts": 2},
              limits={"rpm": 60})
    assert words(old, new) == (
        "backends added e and f, removed d, replaced a, updated b; policy shape's params changed; "
        "model m policy round_robin -> least_loaded; failover settings changed; "
        "1 key added, 2 removed, 1 changed; also [limits]")


def test_nothing_changed():
    same = cfg([backend("a")], [key("k")])
    assert words(same, cfg([backend("a")], [key("k")])) == "no changes"


def test_the_reload_log_line_says_it_in_words(tmp_path, caplog, monkeypatch):
    old = cfg([backend("a")], [key("k")])
    path = write_config(tmp_path, {"auth": {"keys": [key("k")]}, "backends": [backend("a"), backend("b")]})
    g = SimpleNamespace(cfg=old, metrics=SimpleNamespace(reload=lambda outcome: None))
    monkeypatch.setattr(reload, "apply", lambda g, new: plan(g.cfg, new))  # the words, not the swap, are tested
    with caplog.at_level(logging.INFO, logger="shapegate.reload"):
        summary = reload.Reloader(g, path).reload()
    assert f"configuration reloaded from {path}: backends added b" in caplog.messages
    assert summary["added"] == ["b"]  # the admin route's answer stays data
