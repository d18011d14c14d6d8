"""Run conditions of the routing benchmark: commit, machine, load, a quiet machine, simulated engines' loop health."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

# A run whose simulated engines delivered more than this share of their steps over 2 ms late ran
# slower engines than the profiles describe: it is rejected and run again.
LATE_LIMIT = 0.05
# An engine that ran fewer steps than this (one that a policy hardly used) decides nothing: a
# handful of late steps would be a large share.
MIN_STEPS = 100
# Others' CPU use (in cores) below which the machine counts as quiet enough to start a run.
QUIET_CORES = 0.5
QUIET_SAMPLE_S = 3.0
ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: the architecture alone
    return platform.processor() or platform.machine()


def machine() -> dict:
    """Commit (and whether the tree differs from it), date, machine, load average: taken before the run."""
    dirty = [line[3:] for line in _git("status", "--porcelain").splitlines()]
    return {"commit": _git("rev-parse", "--short", "HEAD").strip() or "unknown", "dirty_paths": dirty,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{_cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
                       f"Python {platform.python_version()}",
            "load_before": os.getloadavg()}


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(sample_s: float = QUIET_SAMPLE_S) -> float:
    """Cores kept busy over `sample_s` by everything on the machine (this process sleeps meanwhile)."""
    b0, t0 = _cpu_times()
    time.sleep(sample_s)
    b1, t1 = _cpu_times()
    return (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)


def _own_jiffies(pids: list[int]) -> int:
    """CPU time (user + system) of the processes `pids` so far; a process already gone counts 0."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


class CpuMeter:
    """Cores used during a run by its own processes and by everything else on the machine."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = [os.getpid(), *pids]
        self.busy, self.total = _cpu_times()
        self.own = _own_jiffies(self.pids)

    def read(self) -> dict:
        busy, total = _cpu_times()
        cores = (os.cpu_count() or 1) / max(total - self.total, 1)
        own = _own_jiffies(self.pids) - self.own
        return {"ours": round(own * cores, 2), "others": round(max(busy - self.busy - own, 0) * cores, 2)}


def wait_quiet(max_wait_s: float) -> dict:
    """Wait (up to `max_wait_s`) until others leave the cores to us; how long it took and what it saw."""
    start = time.monotonic()
    busy = busy_cores()
    while busy > QUIET_CORES and time.monotonic() - start < max_wait_s:
        busy = busy_cores()
    return {"waited_s": round(time.monotonic() - start, 1), "busy_cores": round(busy, 2),
            "quiet": busy <= QUIET_CORES}


def late_verdict(health: dict) -> tuple[float | None, bool]:
    """(worst late-step share among engines that ran enough steps, whether the run is rejected)."""
    shares = [h["late_share"] for h in health.values() if h is not None and h["steps"] >= MIN_STEPS]
    worst = max(shares, default=None)
    missing = any(h is None for h in health.values())  # an engine that did not answer /sim/state
    return worst, missing or (worst is not None and worst > LATE_LIMIT)
