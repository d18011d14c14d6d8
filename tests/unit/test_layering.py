"""Import rules: contracts import nothing of ours, policies only contracts, backends only contracts."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("gateway", "policies", "backends")
STDLIB = set(sys.stdlib_module_names)


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_contracts_import_nothing_of_ours():
    assert not [n for n in imports(ROOT / "gateway/contracts.py") if n.split(".")[0] in OURS]


def test_policies_import_only_contracts_pydantic_stdlib():
    for f in (ROOT / "policies").glob("*.py"):
        for n in imports(f):
            top = n.split(".")[0]
            assert top in STDLIB or top in ("pydantic", "__future__") or n == "gateway.contracts" \
                or top == "policies", f"{f.name} imports {n}"


def test_backends_import_only_contracts_aiohttp_httptools_orjson():
    for f in (ROOT / "backends").glob("*.py"):
        for n in imports(f):
            top = n.split(".")[0]
            assert top in STDLIB or top in ("aiohttp", "httptools", "orjson", "__future__", "backends") \
                or n == "gateway.contracts", f"{f.name} imports {n}"


def test_only_app_layer_touches_registries():
    for f in (ROOT / "gateway").rglob("*.py"):
        if f.name in ("runtime.py", "app.py"):
            continue
        text = f.read_text()
        assert "REGISTRY" not in text, f"{f.relative_to(ROOT)} uses a registry"


def test_every_module_has_a_docstring():
    for pkg in OURS:
        for f in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(f.read_text())
            if f.name == "__init__.py" and not tree.body:
                continue
            assert ast.get_docstring(tree), f"{f.relative_to(ROOT)} has no module docstring"


def test_the_runtime_and_the_request_never_import_the_pipeline():
    # The pipeline uses them; they never use it (an import cycle made every change to one a change to both).
    for name in ("runtime.py", "routing/request.py", "experiments/experiment.py", "experiments/shadow.py"):
        assert "gateway.pipeline" not in imports(ROOT / "gateway" / name), name
