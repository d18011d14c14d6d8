"""Simulated engines and the gateway as real processes on loopback, for kill, restart and signal tests."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.fake_engine import free_port

ROOT = Path(__file__).resolve().parents[1]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f'"{k}" = {_toml_value(x)}' for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {type(v).__name__}")


def to_toml(cfg: dict[str, Any]) -> str:
    """Enough TOML for a gateway config: [sections] of scalars/inline tables, [[backends]] and [[experiments]]."""
    lines = []
    for section, body in cfg.items():
        if section in ("backends", "auth", "experiments"):
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    auth = cfg.get("auth", {})
    lines.append("[auth]")
    lines += [f"{k} = {_toml_value(v)}" for k, v in auth.items() if k != "keys"]
    for key in auth.get("keys", ()):
        lines.append("[[auth.keys]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in key.items()]
    for table in ("backends", "experiments"):
        for b in cfg.get(table, ()):
            lines.append(f"[[{table}]]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in b.items()]
    return "\n".join(lines) + "\n"


async def wait_http(url: str, timeout: float, want: int | None = 200) -> None:
    """Until `url` answers (with `want`, or anything when None); bounded by `timeout`."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                    if want is None or r.status == want:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass  # not up yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout} s")
            await asyncio.sleep(0.05)


class Proc:
    """One child process on a fixed loopback port, killable and restartable on the same port."""

    def __init__(self, argv: list[str], port: int, ready_path: str, log: Path | None = None) -> None:
        self.argv = argv
        self.port = port
        self.ready_path = ready_path
        self.log = log  # stderr goes here (appended across restarts), else nowhere: an unread pipe would block
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, wait: bool = True, timeout: float = 15.0) -> "Proc":
        err = open(self.log, "ab") if self.log is not None else asyncio.subprocess.DEVNULL
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=err,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
        finally:
            if self.log is not None:
                err.close()  # the child has its own copy
        if wait:
            await wait_http(self.url + self.ready_path, timeout)
        return self

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def kill(self) -> None:
        """SIGKILL: no goodbye to open connections beyond what the kernel does."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            await self.proc.wait()

    async def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None or self.proc.returncode is not None:
            return None if self.proc is None else self.proc.returncode
        self.signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            await self.kill()
            return self.proc.returncode

    def stderr_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log is not None and self.log.exists() else ""


async def workers_ready(url: str, workers: int, timeout: float = 10.0) -> set[str]:
    """Every worker of a `serve --workers N` group answers /readyz with 200, not only the one that answered
    first: each GET goes on a new connection (the kernel picks the worker), told apart by the per-process
    prefix of its request id."""
    ready: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(ready) < workers:
        assert time.monotonic() < deadline, f"only {len(ready)} of {workers} workers became ready"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async with s.get(url + "/readyz") as r:
                if r.status == 200:
                    ready.add(r.headers["x-request-id"][:12])
        await asyncio.sleep(0.02)
    return ready  # the workers' request-id prefixes


def restartable_port() -> int:
    """A free port below the kernel's ephemeral range, so that no port-0 listener takes it while a
    killed engine is down and it can come back on the same port."""
    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: try another
            return port
    raise RuntimeError("no free port in 20000-32000")


def sim_proc(engine: str, port: int | None = None, *extra: str) -> Proc:
    port = port or restartable_port()
    ready = {"vllm": "/health", "sglang": "/ping", "llamacpp": "/health"}[engine]
    return Proc([sys.executable, "-m", "gateway.sim", "--engine", engine, "--port", str(port), *extra], port, ready)


def gateway_proc(config_path: Path, port: int | None = None, log: Path | None = None) -> Proc:
    port = port or free_port()
    return Proc([sys.executable, "-m", "gateway.cli.main", "serve", "--config", str(config_path), "--port", str(port)],
                port, "/readyz", log)


async def set_faults(url: str, **knobs: Any) -> dict:
    """Change a simulated engine's fault knobs at run time."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/sim/faults", json=knobs) as r:
            assert r.status == 200, await r.text()
            return await r.json()
