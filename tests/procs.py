"""Simulated engines, the gateway and the `shapegate` command as real processes on loopback, and the config
files they read."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.loopback import ROOT, Proc, free_port, restartable_port


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


def write_config(directory: Path, cfg: dict[str, Any], name: str = "gw.toml") -> Path:
    """`cfg` as a TOML file in `directory`; its path."""
    path = directory / name
    path.write_text(to_toml(cfg))
    return path


async def shapegate(*args: str, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None,
                    unset: Iterable[str] = (), timeout: float = 60.0) -> tuple[int, str, str]:
    """Run `python -m gateway.cli ARGS` as a process, stdin closed, this loop serving meanwhile (its engines,
    its gateway): (exit status, stdout, stderr). `env` adds to this process's environment, less `unset`."""
    gone = set(unset)
    proc = await asyncio.create_subprocess_exec(
        *prefix, sys.executable, "-m", "gateway.cli", *args, cwd=ROOT, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**{k: v for k, v in os.environ.items() if k not in gone}, "PYTHONPATH": str(ROOT), **(env or {})})
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


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


def sim_proc(engine: str, port: int | None = None, *extra: str) -> Proc:
    port = port or restartable_port()
    ready = {"vllm": "/health", "sglang": "/ping", "llamacpp": "/health"}[engine]
    return Proc([sys.executable, "-m", "gateway.sim", "--engine", engine, "--port", str(port), *extra], port, ready)


def gateway_proc(config_path: Path, port: int | None = None, log: Path | None = None) -> Proc:
    port = port or free_port()
    return Proc([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path), "--port", str(port)],
                port, "/readyz", log)


async def set_faults(url: str, **knobs: Any) -> dict:
    """Change a simulated engine's fault knobs at run time."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/sim/faults", json=knobs) as r:
            assert r.status == 200, await r.text()
            return await r.json()
