"""Config loading: the example file, field-path errors, unknown keys, explicit auth, model tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from gateway.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
BACKEND = {"id": "a", "engine": "vllm", "url": "http://127.0.0.1:1", "models": ["m"]}


def test_example_config_loads_and_documents_every_option():
    cfg = load_config(ROOT / "config.example.toml")
    assert [b.id for b in cfg.backends] == ["vllm-0", "sglang-0", "llama-0"]
    assert cfg.backends[2].models == {"qwen3-30b": "Qwen3-30B-A3B-Q4_K_XL.gguf"}
    assert cfg.backends[0].models == {"qwen3-30b": "qwen3-30b"}
    text = (ROOT / "config.example.toml").read_text()
    for section in type(cfg).model_fields:
        sub = getattr(cfg, section)
        if isinstance(sub, BaseModel):
            for name in type(sub).model_fields:
                assert f"{name} " in text or f"{name}=" in text, f"[{section}] {name} is not documented"


def test_unknown_key_rejected_with_its_path():
    with pytest.raises(ConfigError) as ei:
        parse_config({"auth": {"enabled": False}, "backends": [{**BACKEND, "urll": "x"}]})
    assert "backends.0.urll: unknown key" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        parse_config({"auth": {"enabled": False}, "server": {"prot": 1}, "backends": [BACKEND]})
    assert "server.prot" in str(ei.value)


def test_auth_must_be_explicitly_disabled():
    with pytest.raises(ConfigError) as ei:
        parse_config({"backends": [BACKEND]})
    assert "enabled = false" in str(ei.value)
    assert not parse_config({"auth": {"enabled": False}, "backends": [BACKEND]}).auth.enabled


@pytest.mark.parametrize("bad,where", [
    ({"engine": "tgi"}, "backends.0.engine"),
    ({"url": "ftp://x"}, "backends.0.url"),
    ({"models": []}, "backends.0.models"),
    ({"classes": ["huge"]}, "backends.0.classes"),
])
def test_invalid_backend_fields(bad, where):
    with pytest.raises(ConfigError) as ei:
        parse_config({"auth": {"enabled": False}, "backends": [{**BACKEND, **bad}]})
    assert where in str(ei.value)


def test_duplicate_backend_ids_and_bad_digest():
    with pytest.raises(ConfigError, match="unique"):
        parse_config({"auth": {"enabled": False}, "backends": [BACKEND, BACKEND]})
    with pytest.raises(ConfigError, match="sha256"):
        parse_config({"auth": {"keys": [{"id": "k", "sha256": "abc"}]}, "backends": [BACKEND]})


def test_config_is_frozen():
    cfg = parse_config({"auth": {"enabled": False}, "backends": [BACKEND]})
    with pytest.raises(Exception):
        cfg.server.port = 1  # type: ignore[misc]


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    p = tmp_path / "bad.toml"
    p.write_text("[server\nport=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)
