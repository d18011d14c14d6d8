"""Experiments across processes: run-time changes reach every worker and replica, and each one's samples too."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import orjson
from redis.exceptions import RedisError

from gateway.experiments.experiment import Experiments
from gateway.stats.share import REDIS_KEEP_S, Sharing

log = logging.getLogger("shapegate.experiments")
CONTROL_S = 0.5  # a change made on one process is adopted by the others within this (plus one Redis call)
SAMPLES_S = 3.0  # how often each process publishes its experiment samples (read when a report is asked for)
SAMPLES_STALE_S = 15.0  # a process that stopped publishing this long ago is left out of the verdicts
SHARED_SAMPLES = 400  # per arm, class and metric: what one process publishes of its own bounded sample
CONTROL_FILE = "experiments.control.json"


class ExperimentShare:
    """Through the workers' directory and, with `[state] backend = "redis"`, Redis (never on a request's path)."""

    def __init__(self, sharing: Sharing) -> None:
        self.sharing = sharing
        self.client = sharing.client()  # None without Redis
        prefix = sharing.redis.key_prefix if sharing.redis else ""
        self._control_key = prefix + "experiments:control"
        self._version_key = prefix + "experiments:version"
        self._samples_key = prefix + "experiments:samples"
        self.me = f"{sharing.replica}/{sharing.worker}"
        self.others: dict[str, dict] = {}  # process -> its last published samples (fresh ones)
        self.errors = 0

    @property
    def active(self) -> bool:
        return self.sharing.dir is not None or self.client is not None

    async def _redis(self, coro):
        """One Redis call within the state timeout; None (counted, logged now and then) when it fails."""
        try:
            async with asyncio.timeout(self.sharing.redis.redis_timeout_s):
                return await coro
        except (RedisError, OSError, TimeoutError) as e:
            self.errors += 1
            if self.errors == 1 or self.errors % 100 == 0:
                log.warning("experiment state not shared (%d errors): %s", self.errors, e)
            return None

    # -- run-time changes ------------------------------------------------------------------------------
    async def next_version(self, local: int) -> int:
        """A version newer than any process has: Redis' counter when there is one, else the wall clock in ms."""
        if self.client is not None:
            v = await self._redis(self.client.incr(self._version_key))
            if isinstance(v, int):
                return max(v, local + 1)
        return max(time.time_ns() // 1_000_000, local + 1)

    async def publish(self, xs: Experiments) -> bool:
        """Every experiment's control state where the other processes look; False when Redis did not take it."""
        controls = {name: x.control() for name, x in xs.by_name.items()}
        if self.sharing.dir is not None:
            _write_atomic(os.path.join(self.sharing.dir, CONTROL_FILE), orjson.dumps(controls))
        if self.client is None:
            return True
        mapping = {name: orjson.dumps(c) for name, c in controls.items()}
        return await self._redis(self.client.hset(self._control_key, mapping=mapping)) is not None

    async def adopt(self, xs: Experiments) -> None:
        """Take every newer change another process made."""
        found: list[dict] = []
        if self.sharing.dir is not None:
            data = _read_json(os.path.join(self.sharing.dir, CONTROL_FILE))
            if isinstance(data, dict):
                found.append(data)
        if self.client is not None:
            rows = await self._redis(self.client.hgetall(self._control_key))
            if rows:
                found.append({_text(k): _loads(v) for k, v in rows.items()})
        for controls in found:
            for name, control in controls.items():
                x = xs.by_name.get(name)
                if x is not None and isinstance(control, dict) and x.adopt(control):
                    log.info("experiment %s changed by another process: %s", name, x.control())

    # -- samples -----------------------------------------------------------------------------------------
    async def exchange_samples(self, xs: Experiments) -> None:
        now = time.time()
        payload = orjson.dumps({"taken_at": now, "experiments": {n: x.shared_samples(SHARED_SAMPLES)
                                                                   for n, x in xs.by_name.items()}})
        others: dict[str, dict] = {}
        d = self.sharing.dir
        if d is not None:
            _write_atomic(os.path.join(d, f"{self.sharing.worker}.experiments.json"), payload)
            for name in _listdir(d):
                if name.endswith(".experiments.json") and name != f"{self.sharing.worker}.experiments.json":
                    data = _read_json(os.path.join(d, name))
                    if _fresh(data, now):
                        others[f"{self.sharing.replica}/{name.split('.', 1)[0]}"] = data
        if self.client is not None:
            async with self.client.pipeline(transaction=False) as p:
                p.hset(self._samples_key, self.me, payload)
                p.pexpire(self._samples_key, int(REDIS_KEEP_S * 1000))
                p.hgetall(self._samples_key)
                res = await self._redis(p.execute())
            for k, v in (res[2] if res else {}).items():
                k = _text(k)
                data = _loads(v)
                if k != self.me and _fresh(data, now):
                    others[k] = data
        self.others = others

    def remote_samples(self, name: str) -> list[dict]:
        """The other processes' samples of experiment `name` (see Experiment.shared_samples)."""
        return [d["experiments"][name] for d in self.others.values()
                if isinstance(d.get("experiments"), dict) and isinstance(d["experiments"].get(name), dict)]

    async def close(self) -> None:
        if self.sharing.dir is not None:
            try:
                os.unlink(os.path.join(self.sharing.dir, f"{self.sharing.worker}.experiments.json"))
            except OSError:
                pass
        if self.client is not None:
            await self._redis(self.client.hdel(self._samples_key, self.me))
            await self.client.aclose()


async def share_loop(share: ExperimentShare, experiments, stop: asyncio.Event) -> None:
    """Adopt other processes' changes every CONTROL_S and exchange samples every SAMPLES_S, until `stop`.
    `experiments()` gives the current set (a reload replaces it)."""
    last_samples = 0.0
    try:
        while not stop.is_set():
            try:
                async with asyncio.timeout(CONTROL_S):
                    await stop.wait()
            except TimeoutError:
                pass
            if stop.is_set():
                break
            xs = experiments()
            if not xs:
                continue
            await share.adopt(xs)
            if time.monotonic() - last_samples >= SAMPLES_S:
                last_samples = time.monotonic()
                await share.exchange_samples(xs)
    finally:
        await share.close()


def _write_atomic(path: str, payload: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot write %s: %s", path, e)


def _read_json(path: str):
    try:
        with open(path, "rb") as f:
            return orjson.loads(f.read())
    except (OSError, orjson.JSONDecodeError):
        return None


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def _loads(v):
    try:
        return orjson.loads(v)
    except orjson.JSONDecodeError:
        return None


def _text(k) -> str:
    return k.decode() if isinstance(k, bytes) else str(k)


def _fresh(data, now: float) -> bool:
    return isinstance(data, dict) and isinstance(data.get("taken_at"), (int, float)) \
        and now - data["taken_at"] <= SAMPLES_STALE_S
