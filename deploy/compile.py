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
# The modules a request runs through, typed throughout (pyproject.toml's [tool.mypy] files hold each of them).
# Left out: modules with async generators (mypyc has none) or pydantic models (mypyc's C for them does not build:
# a policy keeps its Params in a module of its own, as policies/shape_params.py), the engine adapters (compiled
# classes cannot be subclassed from plain Python), and what runs off the request path.
COMPILED = (
    "gateway/pipeline.py", "gateway/http/connection.py", "gateway/http/exchange.py", "gateway/routing/relay.py",
    "gateway/routing/shape.py", "gateway/runtime.py", "gateway/routing/context.py", "gateway/routing/admission.py",
    "gateway/routing/failover.py", "gateway/routing/request.py", "gateway/stats/rolling.py", "gateway/fleet/pool.py", "gateway/keys/auth.py",
    "gateway/http/request_head.py", "gateway/http/headers.py", "gateway/errors.py", "gateway/http/front.py", "gateway/observe/metrics.py",
    "gateway/contracts.py", "gateway/fleet/health.py", "gateway/limits/limiter.py", "gateway/routing/affinity.py", "gateway/experiments/experiment.py",
    "gateway/hot_settings.py", "gateway/observe/lean_metrics.py",
    "backends/http1.py", "backends/http1_response.py", "backends/slots.py", "policies/shape.py",
)
PACKAGES = ("gateway", "backends", "policies")
SKIP = shutil.ignore_patterns(".git", "__pycache__", "build", "*.so", "*.egg-info", ".pytest_cache")


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
    done = subprocess.run([sys.executable, "-m", "mypyc", *COMPILED], cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"mypyc failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    shutil.rmtree(tree / "build", ignore_errors=True)  # C sources and objects: only the .so files are used
    missing = [m for m in COMPILED if not list((tree / m).parent.glob(Path(m).stem + ".cpython-*.so"))]
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
    print(f"compiled {len(COMPILED)} modules in {tree} in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
