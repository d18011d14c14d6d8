"""Compiles the request path's modules to C extensions with mypyc, in a tree that runs and is not edited."""

# Why: a request spends about a third of its instructions in the interpreter's loop and frames; compiled, the
# same source runs those parts as C (benchmarks/path_instructions.py counts both builds side by side). The
# source stays plain Python: every module below also runs uncompiled, and the test suite runs on both builds.
# A compiled module (NAME.cpython-*.so) is imported in place of NAME.py, so a tree is compiled where nobody
# edits it (an image, a copy); gateway/__init__.py refuses to start when a source is newer than its compiled form.

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The modules a request runs through, by dotted name: a package stands for every module in it (its __init__ aside),
# so that a module added to a compiled package is compiled with it. Each is typed throughout (pyproject.toml's
# [tool.mypy] files hold them). Left out: modules with async generators (mypyc has none) or pydantic models (mypyc's
# C for them does not build: a policy keeps its Params in a module of its own, as policies/shape_params.py), the
# engine adapters (compiled classes cannot be subclassed from plain Python), and what runs off the request path.
COMPILED = (
    "gateway.contracts", "gateway.errors", "gateway.hot_settings", "gateway.runtime", "gateway.pipeline",
    "gateway.upstream",
    "gateway.apis", "gateway.http", "gateway.routing",
    "gateway.fleet.pool", "gateway.fleet.health", "gateway.stats.rolling", "gateway.stats.key_usage",
    "gateway.stats.ledger", "gateway.keys.auth", "gateway.keys.principal", "gateway.limits.limiter",
    "gateway.limits.buckets", "gateway.limits.quotas", "gateway.limits.headers", "gateway.experiments.experiment",
    "gateway.observe.metrics", "gateway.observe.lean_metrics", "gateway.observe.access_log",
    "backends.http1", "backends.http1_response", "backends.slots", "policies.shape",
)
PACKAGES = ("gateway", "backends", "policies")
SKIP = shutil.ignore_patterns(".git", "__pycache__", "build", "*.so", "*.egg-info", ".pytest_cache")


def compiled_modules(tree: Path = ROOT) -> list[str]:
    """COMPILED with each package spelled out: the dotted name of every module to compile, as found in `tree`."""
    found = []
    for name in COMPILED:
        path = tree / name.replace(".", "/")
        if path.is_dir():
            found += [f"{name}.{f.stem}" for f in sorted(path.glob("*.py")) if f.name != "__init__.py"]
        elif path.with_suffix(".py").exists():
            found.append(name)
    return found


def source_of(module: str) -> str:
    """A module's file, relative to the tree's top."""
    return module.replace(".", "/") + ".py"


def compiled_files(tree: Path) -> list[Path]:
    """The compiled modules now in `tree` (each package's *.so, and mypyc's shared library at the top)."""
    return [*tree.glob("*.so"), *(p for d in PACKAGES for p in (tree / d).rglob("*.so"))]


def clean(tree: Path) -> None:
    """Remove every compiled module from `tree`: it runs as plain Python again."""
    for p in compiled_files(tree):
        p.unlink()


def compile_tree(tree: Path) -> float:
    """Compile COMPILED in place in `tree` (its sources as they are now); the seconds it took."""
    clean(tree)
    t0 = time.monotonic()
    sources = [source_of(m) for m in compiled_modules(tree)]
    done = subprocess.run([sys.executable, "-m", "mypyc", *sources], cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"mypyc failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    shutil.rmtree(tree / "build", ignore_errors=True)  # C sources and objects: only the .so files are used
    missing = [m for m in sources if not list((tree / m).parent.glob(Path(m).stem + ".cpython-*.so"))]
    if missing:
        raise SystemExit(f"mypyc left no compiled module for {', '.join(missing)}")
    return time.monotonic() - t0


def copy_tree(dest: Path) -> None:
    """This tree's files (no VCS data, caches or compiled modules) into `dest`, which must not exist."""
    shutil.copytree(ROOT, dest, ignore=SKIP, symlinks=True)


def compiled_copy(dest: Path) -> float:
    """A copy of this tree in `dest` (which must not exist), compiled; the seconds the compiling took."""
    copy_tree(dest)
    return compile_tree(dest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--copy", metavar="DEST", type=Path,
                    help="copy this tree to DEST (which must not exist) and compile the copy, not this tree")
    ap.add_argument("--clean", action="store_true", help="remove the compiled modules from this tree instead")
    args = ap.parse_args()
    if args.clean:
        clean(ROOT)
        return 0
    if args.copy is None:
        tree, seconds = ROOT, compile_tree(ROOT)
    else:
        tree, seconds = args.copy, compiled_copy(args.copy)
    print(f"compiled {len(compiled_modules(tree))} modules in {tree} in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
