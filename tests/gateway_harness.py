"""Start a real gateway on a loopback port for tests and benchmarks, from a config dict."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from gateway.app import build_app, serve
from gateway.config import parse_config
from gateway.http.front import Front
from gateway.keys.principal import hash_key
from gateway.runtime import GATEWAY, build_policy

USER_KEY = "sk-test-user-key"
ADMIN_KEY = "sk-test-admin-key"


def gateway_config(backends: list[dict[str, Any]], **sections: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "auth": {"keys": [{"id": "user", "sha256": hash_key(USER_KEY)},
                          {"id": "ops", "sha256": hash_key(ADMIN_KEY), "admin": True}]},
        "server": {"access_log": False},
        "dashboard": {"secure_cookie": False},
        "health": {"interval_s": 0.1, "timeout_s": 1.0, "warmup": False, "load_interval_s": 0.2},
        "backends": backends,
    }
    for name, value in sections.items():
        cfg[name] = {**cfg.get(name, {}), **value}
    return cfg


class RunningGateway:
    def __init__(self, front: Front) -> None:
        self.front = front
        self.port = front.port
        self.app = front.runner.app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self):
        return self.app[GATEWAY]

    async def stop(self) -> None:
        await self.front.close(timeout=5.0)


async def start_gateway(cfg: dict[str, Any], wait_ready: bool = True, timeout: float = 10.0) -> RunningGateway:
    app = build_app(parse_config(cfg, build_policy))
    gw = RunningGateway(await serve(app, "127.0.0.1", 0))
    if wait_ready:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while True:
                async with s.get(gw.url + "/readyz") as r:
                    if r.status == 200:
                        break
                if time.monotonic() > deadline:
                    await gw.stop()
                    raise TimeoutError("gateway did not become ready")
                await asyncio.sleep(0.05)
    return gw
