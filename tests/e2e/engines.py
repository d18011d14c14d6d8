"""Start real engines on loopback, wait for readiness their own way, and stop them by PID."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.loopback import free_port
from tests.e2e import vllm_env
from tests.e2e.build_llama import ensure_llama_server
from tests.e2e.tiny_models import ensure_gguf_model, ensure_hf_model

LLAMA_ALIAS = "tiny-llama"
VLLM_NAME = "tiny-vllm"


@dataclass(frozen=True)
class Probe:
    """One readiness poll: seconds since launch, HTTP status (None = connection refused), body."""

    t: float
    status: int | None
    body: bytes


@dataclass
class EngineHandle:
    engine: str  # "llamacpp" | "vllm"
    url: str
    model: str  # the name clients send (alias / served model name)
    pid: int
    port: int
    startup_s: float  # launch -> /health 200
    launched_at: float  # time.monotonic() just before the process was started
    log_path: Path
    argv: list[str]
    probes: list[Probe] = field(default_factory=list)
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-n:])

    async def close(self, term_timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after the deadline; returns the exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + term_timeout
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        code = await asyncio.to_thread(proc.wait)
        # The engine ran in a process group of its own (start_new_session): workers it spawned
        # (vLLM's engine core) must not outlive it and hold gigabytes.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return code


class EngineStartError(RuntimeError):
    pass


def _log_path(engine: str, port: int) -> Path:
    d = Path(tempfile.gettempdir()) / "shapegate-e2e-logs"
    d.mkdir(exist_ok=True)
    return d / f"{engine}-{port}-{os.getpid()}.log"


async def _wait_ready(handle: EngineHandle, started: float, timeout: float, interval: float) -> None:
    """Poll /health until 200, recording every answer; fail fast if the process exits."""
    url = handle.url + "/health"
    # a fresh connection per poll: the first answer after bind must not wait on a stale socket
    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            now = time.monotonic() - started
            try:
                async with http.get(url) as resp:
                    body = await resp.read()
                    handle.probes.append(Probe(now, resp.status, body))
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectorError:
                if not handle.probes or handle.probes[-1].status is not None:
                    handle.probes.append(Probe(now, None, b""))  # one entry per refused stretch
            if not handle.alive():
                raise EngineStartError(f"{handle.engine} exited during start-up:\n{handle.log_tail()}")
            if now > timeout:
                raise EngineStartError(f"{handle.engine} not ready after {timeout:.0f} s:\n{handle.log_tail()}")
            await asyncio.sleep(interval)


async def _launch(engine: str, model: str, argv: Sequence[str], port: int, env: dict[str, str] | None,
                  timeout: float, interval: float) -> EngineHandle:
    log_path = _log_path(engine, port)
    started = time.monotonic()
    with open(log_path, "wb") as log_fh:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log_fh, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    handle = EngineHandle(engine=engine, url=f"http://127.0.0.1:{port}", model=model, pid=proc.pid, port=port,
                          startup_s=0.0, launched_at=started, log_path=log_path, argv=list(argv), _proc=proc)
    try:
        await _wait_ready(handle, started, timeout, interval)
    except BaseException:
        await handle.close(term_timeout=5.0)
        raise
    handle.startup_s = time.monotonic() - started
    return handle


async def start_llama_server(*, binary: Path | None = None, model_path: Path | None = None,
                             alias: str = LLAMA_ALIAS, parallel: int = 2, ctx: int = 4096, threads: int = 2,
                             extra_args: Sequence[str] = (), timeout: float = 60.0,
                             port: int | None = None) -> EngineHandle:
    """Launch llama-server on `port` (default: a free loopback port); ready when /health answers 200."""
    binary = binary or await asyncio.to_thread(ensure_llama_server)
    model_path = model_path or await asyncio.to_thread(ensure_gguf_model)
    fixed = port
    for attempt in range(3):  # the free port can be taken between probe and bind
        port = fixed or free_port()
        argv = [str(binary), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port),
                "--parallel", str(parallel), "--metrics", "--alias", alias, "-c", str(ctx),
                "-t", str(threads), "--no-ui", *extra_args]
        try:
            # 2 ms polls: the 503 "Loading model" phase of a tiny model lasts only milliseconds
            return await _launch("llamacpp", alias, argv, port, None, timeout, interval=0.002)
        except EngineStartError as exc:
            if attempt == 2 or fixed or "bind" not in str(exc).lower():
                raise
    raise AssertionError("unreachable")


async def start_vllm_server(*, model_dir: Path | None = None, served_name: str = VLLM_NAME,
                            max_num_seqs: int | None = 2, max_model_len: int = 4096,
                            extra_args: Sequence[str] = (), timeout: float = 300.0,
                            port: int | None = None, env_changes: Mapping[str, str] | None = None) -> EngineHandle:
    """Launch vLLM's OpenAI server from its venv; ready when /health answers 200 (refused until then).
    `env_changes`: variables set (or, with "", unset) over LAUNCH_ENV."""
    python = await asyncio.to_thread(vllm_env.ensure_vllm_venv)
    model_dir = model_dir or await asyncio.to_thread(ensure_hf_model, python)
    env = {**os.environ, **vllm_env.LAUNCH_ENV}
    for name, value in (env_changes or {}).items():
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    fixed = port
    for attempt in range(3):
        port = fixed or free_port()
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
                "--enforce-eager", "--max-model-len", str(max_model_len), *extra_args]
        if max_num_seqs is not None:
            argv += ["--max-num-seqs", str(max_num_seqs)]
        try:
            handle = await _launch("vllm", served_name, argv, port, env, timeout, interval=0.25)
        except EngineStartError as exc:
            if attempt == 2 or fixed or "address already in use" not in str(exc).lower():
                raise
            continue
        try:
            yield_engine_core(handle.pid)
        except BaseException:
            await handle.close(term_timeout=5.0)
            raise
        return handle
    raise AssertionError("unreachable")


ENGINE_CORE_NICE = 19


def yield_engine_core(server_pid: int) -> list[int]:
    """Lower vLLM's engine-core process to nice 19 (each of its threads: Linux niceness is per thread); returns
    its pid(s). Its scheduler loop polls without sleeping even when idle, and on 2 cores it otherwise takes the
    CPU that vLLM's own API server (its /metrics, its streams) and the test's process need: seen here, /metrics
    answered in 0.04-5.1 s while three streams ran, and in 0.02-0.04 s with the engine core at nice 19, at the
    same generation speed (the compute runs in its worker process, on a core of its own)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # `pid (comm) state ppid ...`; comm may hold spaces and parentheses: split at the last ')'
        name_end = stat.rindex(")")
        names[int(entry)] = stat[stat.index("(") + 1:name_end]
        parents[int(entry)] = int(stat[name_end + 2:].split()[1])

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == server_pid:
                return True
        return False

    cores = [pid for pid, name in names.items() if name.startswith("VLLM::EngineCor") and descends(pid)]
    if not cores:
        raise EngineStartError(f"no VLLM::EngineCore process under vLLM's server (pid {server_pid})")
    for pid in cores:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, int(tid), ENGINE_CORE_NICE)
    return cores
