"""The processes of the failover benchmark: simulated engines (killable, restartable) and the gateway."""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp

from benchmarks.loopback import Proc, restartable_port  # (the same process handling as the tests)

# id -> (engine flavour, simulator profile, extra flags)
ENGINES = {
    "vllm-0": ("vllm", "r9700-vllm", ()),
    "vllm-1": ("vllm", "r9700-vllm", ()),
    "sglang-0": ("sglang", "r9700-sglang", ()),
    "llama-0": ("llamacpp", "r9700-llamacpp-vulkan", ()),
}
READY_PATH = {"vllm": "/health", "sglang": "/health", "llamacpp": "/health"}


class Engine(Proc):
    def __init__(self, id: str) -> None:
        engine, profile, extra = ENGINES[id]
        self.id, self.engine = id, engine
        port = restartable_port()  # a killed engine comes back on it
        super().__init__([sys.executable, "-m", "gateway.sim", "--engine", engine, "--profile", profile,
                          "--port", str(port), *extra], port, READY_PATH[engine])

    async def set_faults(self, **knobs) -> None:
        async with aiohttp.ClientSession() as s:
            async with s.post(self.url + "/sim/faults", json=knobs) as r:
                r.raise_for_status()


class Gateway(Proc):
    def __init__(self, config: Path) -> None:
        port = restartable_port()
        # stderr kept beside the config for a look when something goes wrong
        super().__init__([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                          "--port", str(port)], port, "/readyz", log=config.with_suffix(".log"))


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
