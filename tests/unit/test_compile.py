"""The compiled build (deploy/compile.py): what it compiles is typed, the suite knows which build it runs, and a
compiled module older than its source stops the gateway from starting."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tomllib

from deploy.compile import COMPILED, compiled_files, compiled_modules, source_of
from tests.unit.test_layering import ROOT


def test_every_compiled_module_is_type_checked():
    # mypyc trusts the annotations (it checks them at run time): a module outside mypy's files could lie.
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    for module in compiled_modules():
        source = source_of(module)
        assert any(source == f or source.startswith(f.rstrip("/") + "/") for f in files), source


def test_every_compiled_name_is_a_module_or_a_package():
    # A name left behind by a move would compile nothing, silently.
    for name in COMPILED:
        path = ROOT / name.replace(".", "/")
        assert path.is_dir() or path.with_suffix(".py").exists(), name
    assert len(compiled_modules()) > len(COMPILED)  # the packages were spelled out


def test_the_suite_runs_the_build_it_was_told_to():
    # SHAPEGATE_COMPILED=1 (set by .ci/run for the compiled tree): every listed module must come from its
    # compiled form; otherwise none may, so that a stray .so never stands in for the sources under test.
    compiled = os.environ.get("SHAPEGATE_COMPILED") == "1"
    for module in compiled_modules():
        path = importlib.import_module(module).__file__ or ""
        assert path.endswith(".so") is compiled, path


def _tree(tmp_path):
    """A tree holding the gateway package's __init__ (the guard) and one module, with a stand-in compiled file."""
    (tmp_path / "gateway" / "routing").mkdir(parents=True)
    shutil.copy(ROOT / "gateway" / "__init__.py", tmp_path / "gateway" / "__init__.py")
    source = tmp_path / "gateway" / "routing" / "relay.py"
    source.write_text("X = 1\n")
    so = tmp_path / "gateway" / "routing" / "relay.cpython-311-x86_64-linux-gnu.so"
    so.write_bytes(b"")  # never loaded: the package's __init__ refuses first, or nothing imports it
    return source, so


def _import_gateway(tree) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import gateway"], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}, timeout=60)


def test_a_compiled_module_older_than_its_source_stops_the_import(tmp_path):
    source, so = _tree(tmp_path)
    os.utime(so, (1_000_000, 1_000_000))
    os.utime(source, (2_000_000, 2_000_000))
    done = _import_gateway(tmp_path)
    assert done.returncode != 0
    assert "gateway/routing/relay.py is newer than its compiled module" in done.stderr
    assert "deploy/compile.py" in done.stderr


def test_a_compiled_module_newer_than_its_source_is_taken(tmp_path):
    source, so = _tree(tmp_path)
    os.utime(source, (1_000_000, 1_000_000))
    os.utime(so, (2_000_000, 2_000_000))
    assert _import_gateway(tmp_path).returncode == 0
    assert compiled_files(tmp_path) == [so]
