"""config.example.toml: documents every option, shows each at its default, and holds no usable key."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, TypeAdapter

import policies
from gateway.config import KEY_PLACEHOLDER, ConfigError, GatewayConfig, RoutingConfig, load_config, parse_config
from gateway.keys.principal import hash_key
from gateway.runtime import build_policy

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config.example.toml"
# Yours to fill in: nothing there has a default to compare with.
FILL_IN = {("backends",), ("auth", "keys")}
MARK = "example:"  # a comment starting so marks a value worth considering that is not the default


def table_path(header: str) -> tuple[str, ...]:
    """('routing', 'models', 'qwen3-30b') for '[routing.models."qwen3-30b"]'; TOML does the quoting rules."""
    node: Any = tomllib.loads(header)
    path: list[str] = []
    while True:
        if isinstance(node, list):
            node = node[0]
        elif isinstance(node, dict) and len(node) == 1:
            (key, node), = node.items()
            path.append(key)
        else:
            return tuple(path)


def marked(text: str) -> set[tuple[str, ...]]:
    """Paths of the keys and tables whose line carries an `# example:` comment."""
    out, table = set(), ()
    for line in text.splitlines():
        code, _, comment = line.partition("#")  # no value in the example holds a '#'
        code = code.strip()
        if code.startswith("["):
            table = here = table_path(code)
        elif "=" in code:
            here = (*table, code.split("=", 1)[0].strip())
        else:
            continue
        if comment.strip().startswith(MARK):
            out.add(here)
    return out


def non_defaults(model: type[BaseModel], table: dict[str, Any], path: tuple[str, ...],
                 exempt: set[tuple[str, ...]]) -> list[str]:
    """Every value of `table` (walked along `model`) that differs from the model's default."""
    out = []
    for key, value in table.items():
        here = (*path, key)
        if here in exempt or here in FILL_IN:
            continue
        field = model.model_fields[key]
        kind = field.annotation
        if isinstance(value, dict) and isinstance(kind, type) and issubclass(kind, BaseModel):
            out += non_defaults(kind, value, here, exempt)
            continue
        if isinstance(value, dict):  # a table of entries: the marked ones are examples
            value = {k: v for k, v in value.items() if (*here, k) not in exempt}
        default = field.get_default(call_default_factory=True)
        if TypeAdapter(kind).validate_python(value) != default:
            out.append(f"{'.'.join(here)} = {value!r}; the default is {default!r}")
    return out


def test_every_value_is_the_default_unless_marked_or_filled_in():
    text = EXAMPLE.read_text()
    exempt = marked(text)
    assert ("upstream", "ttft_deadline_s") in exempt and ("routing", "models", "qwen3-30b") in exempt
    assert non_defaults(GatewayConfig, tomllib.loads(text), (), exempt) == []


def test_the_walk_notices_a_changed_default():
    text = EXAMPLE.read_text().replace("port = 8080 ", "port = 8081 ")
    assert non_defaults(GatewayConfig, tomllib.loads(text), (), marked(text)) == [
        "server.port = 8081; the default is 8080"]


def test_policy_param_defaults_in_comments_are_the_policies_own():
    # The comment under `params = {}` lists each policy's parameters as `name = default`.
    text = EXAMPLE.read_text()
    block = text[text.index("params = {}"):text.index("max_attempts")]
    seen, policy = 0, None
    for line in block.splitlines()[1:]:
        head = re.match(r"#\s*(\w+):", line)
        policy = head.group(1) if head else policy
        for name, value in re.findall(r"(\w+) = ([0-9.]+)", line):
            assert getattr(policies.REGISTRY[policy][1](), name) == float(value), (policy, name)
            seen += 1
    assert seen == 14


def test_every_option_is_documented():
    text = EXAMPLE.read_text()
    for section, field in GatewayConfig.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            for name in kind.model_fields:
                assert f"{name} " in text or f"{name}=" in text, f"[{section}] {name} is not documented"


def test_the_example_holds_no_usable_key():
    with pytest.raises(ConfigError) as ei:
        load_config(EXAMPLE, build_policy)
    lines = str(ei.value).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == ["auth.keys[team-a].sha256", "auth.keys[ops].sha256"]
    assert all("shapegate keys new" in line for line in lines)
    assert not re.search(r"\b[0-9a-f]{64}\b", EXAMPLE.read_text()), "a real digest in the example"
    assert "sk-" not in EXAMPLE.read_text(), "a plaintext key in the example"


def test_the_example_runs_once_real_digests_are_in():
    text = EXAMPLE.read_text()
    assert text.count(KEY_PLACEHOLDER) == 2
    cfg = parse_config(tomllib.loads(text.replace(KEY_PLACEHOLDER, hash_key("a-key-of-ones-own"))), build_policy)
    assert [b.id for b in cfg.backends] == ["vllm-0", "sglang-0", "llama-0"]
    assert cfg.backends[2].models == {"qwen3-30b": "Qwen3-30B-A3B-Q4_K_XL.gguf"}
    assert cfg.backends[0].models == {"qwen3-30b": "qwen3-30b"}


def test_readme_names_the_default_policy():
    readme = (ROOT / "README.md").read_text()
    assert f"| `{RoutingConfig().policy}` (default) |" in readme
    assert readme.count("(default) |") == 1
