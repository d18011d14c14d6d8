"""The request's path type-checks: mypy over the modules pyproject.toml lists, the runtime typed throughout."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.unit.test_layering import ROOT


def test_mypy_passes_on_the_request_path():
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_request_path_takes_a_typed_runtime():
    # mypy accepts an unannotated parameter as Any: this is the check that there is none for the runtime.
    for name in ("pipeline.py", "experiments/shadow.py", "experiments/experiment.py"):
        tree = ast.parse((ROOT / "gateway" / name).read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in fn.args.args:
                    if arg.arg in ("g", "st"):
                        assert arg.annotation is not None, f"{name}: {fn.name}({arg.arg}) has no type"
