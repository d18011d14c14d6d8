"""Free ports on 127.0.0.1, waiting for a URL to answer, and child processes that can be killed and restarted: the
one copy the benchmarks and the tests share (the tests may take these; no benchmark takes a helper of tests/)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick; another port-0 bind may take it once it is let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    """One child process on a fixed loopback port, killable and restartable on the same port; it runs with this
    tree's root as its directory and on its PYTHONPATH."""

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
