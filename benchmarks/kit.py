"""What the benchmark scripts share: the gateway's config, processes started and stopped, wrk, CPU time from /proc,
callgrind windows, medians and spreads, the run's provenance and its results files."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import loopback
from benchmarks.loopback import free_port

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
KEY = "sk-bench-key"  # the one API key of every gateway a benchmark starts from a config file


# -- the gateway's config ------------------------------------------------------------------------
def gateway_config(path: Path, engines: str | Sequence[str], *, access_log: bool = True, stats: bool | None = True,
                   auth: bool = True, admin: bool = False, server: str = "", stats_lines: str = "", health: str = "",
                   sections: str = "") -> Path:
    """The config the benchmarks run a gateway with: the one key (KEY, an admin's with `admin`), no warm-up request,
    each engine an openai backend serving "bench" ("engine", or "engine-1", "engine-2"... for several). `server`,
    `stats_lines` and `health` are more lines of those sections, `sections` whole sections of the benchmark's own;
    stats None leaves [stats] out; without `auth` the key stays listed (clients send it to every target alike)."""
    from gateway.keys.principal import hash_key
    urls = [engines] if isinstance(engines, str) else list(engines)
    ids = ["engine"] if len(urls) == 1 else [f"engine-{i + 1}" for i in range(len(urls))]
    backends = "".join(f'[[backends]]\nid = "{i}"\nengine = "openai"\nurl = "{u}"\nmodels = ["bench"]\n'
                       for i, u in zip(ids, urls))
    path.write_text(
        f"[server]\naccess_log = {str(access_log).lower()}\n{server}\n"
        + (f"[stats]\nenabled = {str(stats).lower()}\n{stats_lines}\n" if stats is not None else "")
        + ("" if auth else "[auth]\nenabled = false\n")
        + f'[[auth.keys]]\nid = "bench"\nsha256 = "{hash_key(KEY)}"\n' + ("admin = true\n" if admin else "")
        + f"[health]\nwarmup = false\n{health}\n{sections}\n{backends}")
    return path


def admin_reload(base: str) -> None:
    """POST /admin/reload with KEY (a config written with `admin`): the gateway reads its file again."""
    req = urllib.request.Request(base + "/admin/reload", method="POST", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200, r.read()


# -- processes -----------------------------------------------------------------------------------
# `python -m gateway.cli`, less the editable install's finder: it sits last on sys.meta_path and would hand a
# gateway run from another tree (a baseline, a compiled copy) the work tree's copy of any module that tree lacks
# (an optional `try: import` is enough).
LAUNCH = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '')"
          ".startswith('__editable__')]; runpy.run_module('gateway.cli', run_name='__main__', alter_sys=True)")


QUIET = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # Popen's arguments for a process kept silent


def script(name: str, *args: str) -> list[str]:
    """The argv of a helper script of benchmarks/ (an engine, a proxy, a load client) run as a process of its own."""
    return [sys.executable, str(BENCH / name), *args]


def serve_argv(cfg: Path, port: int, tree: Path | None = None) -> list[str]:
    """`shapegate serve` on `cfg` and `port`: `python -m` of this tree, or of the source tree `tree` alone (which
    it must run in, with `tree_env`)."""
    head = [sys.executable, "-m", "gateway.cli"] if tree is None else [sys.executable, "-c", LAUNCH]
    return [*head, "serve", "--config", str(cfg), "--port", str(port)]


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a process that imports from the source tree `tree` only."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def wait_http(url: str, timeout: float = 15.0) -> None:
    """Until `url` answers 200; TimeoutError after `timeout` seconds."""
    asyncio.run(loopback.wait_http(url, timeout))


def start(argv: list[str], procs: list[subprocess.Popen], ready: str, timeout: float = 15.0,
          **popen: Any) -> subprocess.Popen:
    """`argv` as a process (`popen`: Popen's own arguments), kept in `procs` for stop_all; once `ready` answers."""
    proc = subprocess.Popen(argv, **popen)
    procs.append(proc)
    wait_http(ready, timeout)
    return proc


def start_engine(procs: list[subprocess.Popen], *args: str, name: str = "fast_engine.py", **popen: Any) -> str:
    """An engine script of benchmarks/ (the zero-delay fast_engine.py unless `name` says) on a free port, once its
    /health answers: its base URL."""
    port = free_port()
    start(script(name, "--port", str(port), *args), procs, f"http://127.0.0.1:{port}/health", **popen)
    return f"http://127.0.0.1:{port}"


def start_gateway(cfg: Path, procs: list[subprocess.Popen], tree: Path | None = None, timeout: float = 15.0,
                  **popen: Any) -> tuple[str, subprocess.Popen]:
    """`shapegate serve` on a free port, of this tree or of the source tree `tree` alone, once /readyz answers: its
    base URL and its process."""
    port = free_port()
    where = {"cwd": ROOT} if tree is None else {"cwd": tree, "env": tree_env(tree)}
    base = f"http://127.0.0.1:{port}"
    return base, start(serve_argv(cfg, port, tree), procs, base + "/readyz", timeout, **{**where, **popen})


def stop_all(procs: Sequence[subprocess.Popen], timeout: float = 10.0) -> None:
    """Ask every process still running to stop, then wait for each; one still running after `timeout` s is killed."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout)


# -- CPU time and the gateway's own figures ------------------------------------------------------
def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: the state first, utime and stime at 11 and 12."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of the process so far."""
    fields, tick = stat_fields(pid), os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    user, system = cpu_times(pid)
    return user + system


def loop_figures(base: str) -> dict[str, float]:
    """The gateway's own loop-lag and GC-pause counters from /metrics (histogram counts and sums)."""
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("shapegate_gc_pause_seconds_", "shapegate_event_loop_lag_seconds_")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# -- wrk -----------------------------------------------------------------------------------------
WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = os.getenv("BODY")
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
done = function(summary, latency, requests)
  io.write(string.format("JSON{\\"requests\\":%%d,\\"errors\\":%%d,\\"duration_us\\":%%d,\\"p50\\":%%d,\\"p99\\":%%d}\\n",
    summary.requests, summary.errors.status + summary.errors.connect + summary.errors.read +
    summary.errors.write + summary.errors.timeout, summary.duration,
    latency:percentile(50), latency:percentile(99)))
end
""" % KEY

BODIES = {
    "nonstream": json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hello there"}],
                             "max_tokens": 16}),
    "stream": json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hello there"}],
                          "max_tokens": 200, "stream": True, "stream_options": {"include_usage": True}}),
}


def wrk_script(directory: Path) -> str:
    """WRK_SCRIPT written in `directory`: the path wrk's -s takes."""
    path = directory / "post.lua"
    path.write_text(WRK_SCRIPT)
    return str(path)


def run_wrk(url: str, body: str, conc: int, seconds: float, script: str) -> dict:
    """wrk's summary of `seconds` of POSTs of `body` on `conc` connections: requests, errors, duration_us, p50, p99."""
    threads = 1 if conc == 1 else 2
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{conc}", f"-d{seconds:g}s", "-s", script, url],
                         capture_output=True, text=True, env={**os.environ, "BODY": body}, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("JSON"))
    return json.loads(line[4:])


def wrk_version() -> str:
    try:
        wrk = subprocess.run(["wrk", "-v"], check=False, capture_output=True, text=True)
    except OSError:
        return ""
    return " ".join((wrk.stdout + wrk.stderr).split()[:2])


# -- callgrind -----------------------------------------------------------------------------------
def callgrind_argv(out_dir: Path) -> list[str]:
    """valgrind's callgrind with counting off until a window opens, its dumps in `out_dir`: put before a command."""
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_dir}/callgrind.out.%p"]


def callgrind(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=120)


def dumped_total(out_dir: Path, before: set[Path]) -> int:
    """Instructions in the newest dump (callgrind writes `summary:` or `totals:` with the Ir count)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = sorted(set(out_dir.glob("callgrind.out*")) - before, key=lambda p: p.stat().st_mtime)
        for path in new:
            for line in reversed(path.read_text(errors="replace").splitlines()):
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
        time.sleep(0.2)
    raise RuntimeError("no callgrind dump appeared")


def window(pid: int, out_dir: Path, work: Callable[[], object]) -> dict:
    """Instructions the process executes while work() runs, and the window's wall time."""
    before = set(out_dir.glob("callgrind.out*"))
    callgrind(pid, "--zero")
    callgrind(pid, "--instr=on")
    t0 = time.monotonic()
    work()
    wall = time.monotonic() - t0
    callgrind(pid, "--instr=off")
    callgrind(pid, "--dump")
    return {"instructions": dumped_total(out_dir, before), "wall_s": wall}


# -- medians and spreads -------------------------------------------------------------------------
def median_spread(values: Sequence[float]) -> tuple[float, float]:
    """The median of `values` and their spread, (max - min) / |median| (0 for a zero median)."""
    m = statistics.median(values)
    return m, ((max(values) - min(values)) / abs(m) if m else 0.0)


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def pm(median_and_spread: tuple[float, float], spec: str = ",.0f", spread: str = ".0%") -> str:
    """A median and its spread as the reports write them: "1,234 (±5%)"."""
    m, s = median_and_spread
    return f"{m:{spec}} (±{s:{spread}})"


def span(values: Sequence[float], spec: str = ".2f", sep: str = "-") -> str:
    """The median of `values` and their range: "1.00 (0.98-1.02)"."""
    return f"{statistics.median(values):{spec}} ({min(values):{spec}}{sep}{max(values):{spec}})"


# -- provenance: what a run depends on, taken before it starts -----------------------------------
QUIET_CORES = 0.5  # others' CPU use (in cores) below which the machine counts as quiet enough to start a run
QUIET_SAMPLE_S = 3.0


def git(*args: str, check: bool = False) -> str:
    """git's output in this repository; "" when git fails (with `check`, the failure is raised)."""
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    except (OSError, subprocess.CalledProcessError):
        if check:
            raise
        return ""


def commit() -> str:
    return git("rev-parse", "--short", "HEAD").strip() or "unknown"


def changed_paths(*under: str) -> list[str]:
    """The paths that differ from the commit (below `under`, else anywhere), as `git status` lists them."""
    return [line[3:] for line in git("status", "--porcelain", "--", *under).splitlines()]


def export_revision(ref: str, dest: Path) -> str:
    """The tree of `ref` in dest, by git archive (it leaves no worktree behind in the repository); its short hash."""
    rev = git("rev-parse", "--short", f"{ref}^{{commit}}", check=True).strip()
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    dest.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    return rev


def utc_date() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def host() -> str:
    """The machine in short: architecture, cores, Python."""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def machine() -> str:
    """The machine in full: CPU model, cores, kernel, Python."""
    return (f"{_cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: the architecture alone
    return platform.processor() or platform.machine()


def provenance() -> dict:
    """Commit (and the paths that differ from it), date, machine, load average: taken before the run."""
    return {"commit": commit(), "dirty_paths": changed_paths(), "date": utc_date(), "machine": machine(),
            "load_before": os.getloadavg()}


def command(module: str, argv: Sequence[str] | None = None) -> str:
    """How the run was started: `python3 -m MODULE ARGS` (the process's own arguments unless `argv` is given)."""
    return shlex.join(["python3", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def run_line(c: dict) -> str:
    """A report's provenance (from `provenance()`, with load_after and command): date, commit (and how many paths
    differed from it), machine, load average before and after, command; without the closing full stop."""
    dirty = f" (with {len(c['dirty_paths'])} changed paths)" if c["dirty_paths"] else ""
    return (f"Run {c['date']} at commit `{c['commit']}`{dirty}; {c['machine']}; load average before "
            f"{', '.join(f'{x:.2f}' for x in c['load_before'])}, after "
            f"{', '.join(f'{x:.2f}' for x in c['load_after'])}. Command: `{c['command']}`")


def _jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(sample_s: float = QUIET_SAMPLE_S) -> float:
    """Cores kept busy over `sample_s` by everything on the machine (this process sleeps meanwhile)."""
    b0, t0 = _jiffies()
    time.sleep(sample_s)
    b1, t1 = _jiffies()
    return (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)


def wait_quiet(max_wait_s: float) -> dict:
    """Wait (up to `max_wait_s`) until others leave the cores to us; how long it took and what it saw."""
    start = time.monotonic()
    busy = busy_cores()
    while busy > QUIET_CORES and time.monotonic() - start < max_wait_s:
        busy = busy_cores()
    return {"waited_s": round(time.monotonic() - start, 1), "busy_cores": round(busy, 2),
            "quiet": busy <= QUIET_CORES}


def _own_jiffies(pids: list[int]) -> int:
    """CPU time (user + system) of the processes `pids` so far; a process already gone counts 0."""
    total = 0
    for pid in pids:
        try:
            fields = stat_fields(pid)
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


class CpuMeter:
    """Cores used during a run by its own processes and by everything else on the machine."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = [os.getpid(), *pids]
        self.busy, self.total = _jiffies()
        self.own = _own_jiffies(self.pids)

    def read(self) -> dict:
        busy, total = _jiffies()
        cores = (os.cpu_count() or 1) / max(total - self.total, 1)
        own = _own_jiffies(self.pids) - self.own
        return {"ours": round(own * cores, 2), "others": round(max(busy - self.busy - own, 0) * cores, 2)}


# -- results -------------------------------------------------------------------------------------
def write_result(out: Path, data: dict, text: str) -> None:
    """OUT.json (the run's data) and OUT.md (its report), the directory made as needed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    out.with_suffix(".md").write_text(text)


def render_again(saved: Path, render: Callable[[dict], str]) -> str:
    """A saved run's report written again from its data, SAVED.md from SAVED.json; its text."""
    text = render(json.loads(saved.with_suffix(".json").read_text()))
    saved.with_suffix(".md").write_text(text)
    return text


def save_and_render(stem: str, data: dict | None, render: Callable[[dict], str]) -> None:
    """Keep a run's data as RESULTS/stem.json (None: re-render the saved one), write its report stem.md, print it."""
    out = RESULTS / f"{stem}.json"
    if data is None:
        data = json.loads(out.read_text())
    else:
        out.write_text(json.dumps(data, indent=1))
    text = render(data)
    (RESULTS / f"{stem}.md").write_text(text)
    print(text)
