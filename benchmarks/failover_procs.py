"""The processes of the failover benchmark: simulated engines (killable, restartable) and the gateway."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.procs import restartable_port as free_port  # noqa: E402  (same port rule as the tests)

ROOT = Path(__file__).resolve().parents[1]
# id -> (engine flavour, simulator profile, extra flags)
ENGINES = {
    "vllm-0": ("vllm", "r9700-vllm", ()),
    "vllm-1": ("vllm", "r9700-vllm", ()),
    "sglang-0": ("sglang", "r9700-sglang", ()),
    "llama-0": ("llamacpp", "r9700-llamacpp-vulkan", ()),
}
READY_PATH = {"vllm": "/health", "sglang": "/health", "llamacpp": "/health"}


async def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass  # not up yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready after {timeout} s")
            await asyncio.sleep(0.02)


class Proc:
    """A child process on a fixed loopback port."""

    def __init__(self, argv: list[str], port: int, ready_path: str) -> None:
        self.argv, self.port, self.ready_path = argv, port, ready_path
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout: float = 20.0) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=self.log_file(),
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        await wait_http(self.url + self.ready_path, timeout)

    def log_file(self):
        return asyncio.subprocess.DEVNULL

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                await self.kill()


class Engine(Proc):
    def __init__(self, id: str) -> None:
        engine, profile, extra = ENGINES[id]
        self.id, self.engine = id, engine
        port = free_port()
        super().__init__([sys.executable, "-m", "gateway.sim", "--engine", engine, "--profile", profile,
                          "--port", str(port), *extra], port, READY_PATH[engine])

    async def set_faults(self, **knobs) -> None:
        async with aiohttp.ClientSession() as s:
            async with s.post(self.url + "/sim/faults", json=knobs) as r:
                r.raise_for_status()


class Gateway(Proc):
    def __init__(self, config: Path) -> None:
        port = free_port()
        self.log = config.with_suffix(".log")  # kept for a look when something goes wrong
        super().__init__([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                          "--port", str(port)], port, "/readyz")

    def log_file(self):
        return open(self.log, "ab")


def gateway_toml(engines: dict[str, Engine], key_sha: str, admin_sha: str) -> str:
    backends = "".join(
        f'\n[[backends]]\nid = "{e.id}"\nengine = "{e.engine}"\nurl = "{e.url}"\nmodels = {{ "m" = "sim-model" }}\n'
        for e in engines.values())
    return f"""[server]
access_log = false
shutdown_grace_s = 5.0

[[auth.keys]]
id = "bench"
sha256 = "{key_sha}"

[[auth.keys]]
id = "ops"
sha256 = "{admin_sha}"
admin = true

[upstream]
first_byte_timeout_s = 10.0
ttft_deadline_s = {{ interactive = 0.8, default = 0.8, long_output = 0.8, long_prompt = 0.8 }}

[routing]
policy = "least_loaded"
max_attempts = 3
retry_deadline_s = 10.0

[health]
interval_s = 0.2
timeout_s = 0.5
sglang_interval_s = 2.0
sglang_timeout_s = 2.0
backoff_max_s = 0.4
load_interval_s = 0.25
breaker_failures = 3
breaker_open_s = 1.0
warmup = true
warmup_timeout_s = 2.0
{backends}"""
