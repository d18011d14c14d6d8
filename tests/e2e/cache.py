"""Cache locations, a cross-process build lock and a timed subprocess runner for the e2e engines."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


def cache_root() -> Path:
    """Engines, venvs and models live outside the clone so every checkout on the machine shares them."""
    override = os.environ.get("SHAPEGATE_CACHE")
    root = Path(override) if override else Path.home() / ".cache" / "shapegate"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Serialise builders of the same artefact (two pytest sessions, or pytest and a manual build)."""
    lock_path = cache_root() / f"{name}.lock"
    with open(lock_path, "w") as fh:
        waited = time.monotonic()
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"{name}: another process is building it, waiting for its lock {lock_path}")
            fcntl.flock(fh, fcntl.LOCK_EX)
            log(f"{name}: lock acquired after {time.monotonic() - waited:.0f} s")
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def log(msg: str) -> None:
    # stderr, unbuffered: a build of several minutes should show progress even under pytest -s
    print(f"[shapegate-e2e] {msg}", file=sys.stderr, flush=True)


def run(cmd: Sequence[str | os.PathLike[str]], *, cwd: Path | None = None,
        env: dict[str, str] | None = None, log_file: Path | None = None, nice: bool = True) -> None:
    """Run a build step; its output goes to a log file so a failure can be read after the fact."""
    argv = [str(c) for c in cmd]
    if nice:
        # two shared cores: builds yield to the tests and the engines
        argv = ["nice", "-n", "10", *argv]
    log("$ " + " ".join(argv[3:] if nice else argv))
    started = time.monotonic()
    if log_file is None:
        proc = subprocess.run(argv, cwd=cwd, env=env, check=False)
    else:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "ab") as out:
            proc = subprocess.run(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        where = f"; see {log_file}" if log_file else ""
        raise RuntimeError(f"command failed with exit code {proc.returncode}: {' '.join(argv)}{where}")
    log(f"  done in {time.monotonic() - started:.1f} s")
