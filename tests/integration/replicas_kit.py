"""Shared pieces of the replica tests: gateway processes on one Redis store, what they publish there, and waits."""

from __future__ import annotations

import secrets
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import redis.asyncio as redis_asyncio
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.loopback import Proc
from gateway.routing.shape import session_key
from tests import kit
from tests.fake_engine import FakeEngine
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config
from tests.needs import REDIS_URL, skip_or_fail
from tests.procs import gateway_proc, to_toml

MODEL = "m"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def redis_client(url: str = REDIS_URL) -> redis_asyncio.Redis:
    """A client of a Redis that answers; skipped (failed under CI) when none does."""
    client = redis_asyncio.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        await client.ping()
    except (OSError, redis_asyncio.RedisError):
        await client.aclose()
        skip_or_fail(f"no redis-server answers at {url} (.ci/run starts one)")
    return client


def new_prefix() -> str:
    return f"shapegate-test:{secrets.token_hex(6)}:"


async def drop_keys(client: redis_asyncio.Redis, prefix: str) -> None:
    keys = [k async for k in client.scan_iter(match=prefix + "*")]
    if keys:
        await client.delete(*keys)


def backend(id: str, engine: FakeEngine) -> dict:
    return {"id": id, "engine": "vllm", "url": engine.url, "models": [MODEL]}


# The replicas are processes sharing Redis: what they publish takes up to seconds to show, so the waits allow
# 10 s and poll every 50 ms.
until = partial(kit.until, timeout=10.0, every=0.05)


class Replicas:
    """Gateway processes (`shapegate serve`) that share one Redis store, each started from the same file."""

    def __init__(self, tmp_path: Path, backends: list[dict], prefix: str, redis_url: str = REDIS_URL,
                 **sections: Any) -> None:
        state = {"backend": "redis", "redis_url": redis_url, "key_prefix": prefix, "flush_interval_s": 0.05,
                 **sections.pop("state", {})}
        self.path = tmp_path / "gw.toml"
        self.path.write_text(to_toml(gateway_config(backends, state=state, **sections)))
        self.tmp_path = tmp_path
        self.procs: list[Proc] = []

    async def start(self) -> Proc:
        p = gateway_proc(self.path, log=self.tmp_path / f"gw{len(self.procs)}.log")
        self.procs.append(p)
        await p.start(timeout=20.0)
        await until(lambda: all_ready(p), "every backend ready")
        return p

    async def stop(self) -> None:
        for p in self.procs:
            await p.stop()

    def logs(self) -> str:
        return "\n".join(p.stderr_text()[-3000:] for p in self.procs)


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url, headers=ADMIN) as r:
        return orjson.loads(await r.read())


async def all_ready(p: Proc) -> bool:
    states = (await get_json(p.url + "/readyz"))["backends"]
    return bool(states) and set(states.values()) == {"ready"}


async def replica_id(p: Proc) -> str:
    """The replica id a gateway process shares its figures under."""
    rep = await get_json(p.url + "/stats")
    return next(r["replica"] for r in rep["replicas"] if r["self"])


async def metric(p: Proc, name: str, **labels: str) -> float:
    """One sample of the process's /metrics (0 when it has none yet)."""
    async with aiohttp.ClientSession() as s, s.get(p.url + "/metrics") as r:
        text = (await r.read()).decode()
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def chat(p: Proc, text: str = "hi", max_tokens: int = 4, stream: bool = False,
               session: str | None = None) -> tuple[str, str]:
    """One request through the official client: (backend that served it, the gateway's reason)."""
    headers = {"x-session-id": session} if session else None
    async with openai.AsyncOpenAI(base_url=p.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, stream=stream,
            extra_headers=headers)
        if stream:
            async for _ in raw.parse():
                pass
        else:
            raw.parse()
    return raw.headers["x-shapegate-backend"], raw.headers["x-shapegate-reason"]


async def session_turn(client: redis_asyncio.Redis, prefix: str, p: Proc, other: Proc, session: str,
                       text: str) -> tuple[str, str]:
    """One turn of a session through `p`, then the client's pause before the next: until `p` has written the
    session to Redis and `other` has run since (it reads the store every 0.05 s; its stats summary, written once
    a second, shows that it ran)."""
    stream = prefix + "affinity"
    last = await client.xrevrange(stream, count=1)
    after = last[0][0].decode() if last else "0-0"
    served = await chat(p, text, session=session)
    key = session_key(MODEL, session)

    async def written() -> float | None:
        for cid, fields in await client.xrange(stream, min=f"({after}"):
            if any(key in keys for keys in orjson.loads(fields[b"p"])["e"].values()):
                return int(cid.split(b"-")[0]) / 1000
        return None

    at = await until(written, f"session {session} written to Redis after its turn")
    theirs = await replica_id(other)

    async def ran_since() -> bool:
        for field, raw in (await client.hgetall(prefix + "stats")).items():
            if field.decode().startswith(theirs + "/") and orjson.loads(raw)["taken_at"] > at + 0.5:
                return True
        return False

    await until(ran_since, "the other replica ran after the session was written")
    return served
