"""Stats summaries passed between processes: one file per worker of a process group, a Redis hash across replicas."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import socket
import time

import orjson
import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway.config import StateConfig
from gateway.stats.merge import MALFORMED, read_summary

log = logging.getLogger("shapegate.stats")

# Set by `shapegate serve --workers N` (gateway/ops/workers.py) for its workers.
STATS_DIR_ENV = "SHAPEGATE_STATS_DIR"
WORKERS_ENV = "SHAPEGATE_WORKERS"
REPLICA_ENV = "SHAPEGATE_REPLICA"
PUBLISH_S = 1.0  # each process publishes its summary this often (never on the request path)
STALE_S = 5.0  # a summary older than this comes from a process that stopped publishing: left out
REDIS_KEEP_S = 60.0  # replicas' entries older than this are deleted from the Redis hash
REDIS_CHANNEL = "stats"
# Replicas' clocks agree far closer than this (NTP keeps them within milliseconds): a time read from another
# process further ahead of this one's clock is not a clock's, and what carries it is left out.
MAX_AHEAD_S = 10.0


def new_replica_id() -> str:
    """Names one process group (a replica): host, the group's pid, and a few random bits since pids repeat."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


class Sharing:
    """Where this process publishes its summaries and reads the others'.

    Workers of one `serve --workers N` group share a directory (a sibling of the Prometheus multiprocess
    directory, made by the parent): each writes `<pid>.json` atomically, any reads the fresh ones. With
    `[state] backend = "redis"` each process also puts its summary in one Redis hash, a field per process,
    so that any replica can show every replica's figures.
    """

    def __init__(self, state: StateConfig) -> None:
        self.worker = str(os.getpid())
        self.replica = os.environ.get(REPLICA_ENV) or new_replica_id()
        self.dir = os.environ.get(STATS_DIR_ENV) or None
        try:
            self.expected = max(int(os.environ.get(WORKERS_ENV, "1")), 1)
        except ValueError:
            self.expected = 1
        self.redis = state if state.backend == "redis" else None
        self.remote: list[dict] = []  # every process's summary as last read from Redis (fresh, readable ones)
        self._bad: set = set()  # fields of the summaries left out in the last read
        self.redis_errors = 0

    @property
    def active(self) -> bool:
        return self.dir is not None or self.redis is not None

    # -- worker files ------------------------------------------------------------------------------
    def _path(self, worker: str) -> str:
        return os.path.join(self.dir or "", f"{worker}.json")

    def write_file(self, payload: bytes) -> None:
        """Replace this worker's file whole (write aside, then rename): a reader never sees half of one."""
        if self.dir is None:
            return
        tmp = os.path.join(self.dir, f".{self.worker}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(payload)
            os.replace(tmp, self._path(self.worker))
        except OSError as e:
            log.warning("cannot publish this worker's stats summary in %s: %s", self.dir, e)

    def remove_file(self) -> None:
        if self.dir is not None:
            try:
                os.unlink(self._path(self.worker))
            except OSError:
                pass  # never written, or the parent already cleaned up

    def peers(self, now_wall: float) -> list[dict]:
        """The other workers' summaries taken within STALE_S (a dead or hung worker's file is left out)."""
        if self.dir is None:
            return []
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        own = f"{self.worker}.json"
        out = []
        for name in names:
            if not name.endswith(".json") or name == own:
                continue
            try:
                with open(os.path.join(self.dir, name), "rb") as f:
                    data = orjson.loads(f.read())
            except (OSError, orjson.JSONDecodeError):
                continue  # removed meanwhile (its worker ended)
            if fresh(data, now_wall):
                out.append(data)
        return out

    # -- Redis -------------------------------------------------------------------------------------
    def client(self):
        if self.redis is None:
            return None
        t = self.redis.redis_timeout_s
        return redis_asyncio.Redis.from_url(self.redis.redis_url, socket_timeout=t, socket_connect_timeout=t)

    def _key(self) -> str:
        return (self.redis.key_prefix if self.redis else "") + REDIS_CHANNEL

    def _field(self) -> str:
        return f"{self.replica}/{self.worker}"

    async def exchange(self, client, payload: bytes, now_wall: float) -> None:
        """Publish this process's summary and read everyone's, in one round trip; drop long-dead entries."""
        key = self._key()
        try:
            async with asyncio.timeout(self.redis.redis_timeout_s):
                async with client.pipeline(transaction=False) as p:
                    p.hset(key, self._field(), payload)
                    p.pexpire(key, int(REDIS_KEEP_S * 1000))  # the hash goes once every replica has stopped
                    p.hgetall(key)
                    _, _, rows = await p.execute()
        except (RedisError, OSError, TimeoutError) as e:
            self.redis_errors += 1
            if self.redis_errors == 1 or self.redis_errors % 100 == 0:
                log.warning("replica stats not shared (%d errors): %s", self.redis_errors, e)
            return
        remote, dead, bad = [], [], {}
        for name, value in rows.items():
            try:
                data = orjson.loads(value)
            except orjson.JSONDecodeError:
                dead.append(name)
                continue
            if fresh(data, now_wall):
                why = _unreadable(data)
                if why is None:
                    remote.append(data)
                else:
                    bad[name] = why
            elif not fresh(data, now_wall, REDIS_KEEP_S):
                dead.append(name)  # a process gone long ago, or one written in the future (it would never age)
                if not fresh(data, now_wall, math.inf):
                    bad[name] = f"taken at {data.get('taken_at') if isinstance(data, dict) else None!r}"
        self._note_bad(bad)
        self.remote = remote
        if dead:
            await self._quietly(client.hdel(key, *dead))

    def _note_bad(self, bad: dict) -> None:
        """Log each summary left out once (they are read every PUBLISH_S), not once a round."""
        for name, why in bad.items():
            if name not in self._bad:
                log.warning("ignoring the stats summary %s in Redis: %s", _name(name), why)
        self._bad = set(bad)

    async def withdraw(self, client) -> None:
        """At shutdown: this process's entry goes at once rather than after STALE_S."""
        await self._quietly(client.hdel(self._key(), self._field()))

    async def _quietly(self, coro) -> None:
        try:
            async with asyncio.timeout(self.redis.redis_timeout_s):
                await coro
        except (RedisError, OSError, TimeoutError):
            pass  # the next round, or the key's expiry, does it


def _name(field: object) -> str:
    return repr(field.decode(errors="replace") if isinstance(field, bytes) else str(field))


def _unreadable(data: dict) -> str | None:
    """Why another process's summary cannot be shown (None: it can): read as a client's input would be."""
    try:
        read_summary(data)
    except MALFORMED as e:
        return repr(e)
    return None


def wall_time(v: object, now_wall: float, max_age_s: float = math.inf) -> float | None:
    """`v` as a wall-clock time another process took something at: None unless a finite number, at most
    `max_age_s` old and at most MAX_AHEAD_S ahead of `now_wall`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    t = float(v)
    return t if math.isfinite(t) and now_wall - max_age_s <= t <= now_wall + MAX_AHEAD_S else None


def fresh(data: object, now_wall: float, max_age_s: float = STALE_S) -> bool:
    return isinstance(data, dict) and wall_time(data.get("taken_at"), now_wall, max_age_s) is not None


async def share_loop(sharing: Sharing, summarize, stop: asyncio.Event) -> None:
    """Every PUBLISH_S until `stop`: summarize this process (`summarize()` -> dict) and publish it.

    A flag rather than task.cancel() ends it: a cancellation that lands inside the Redis client's I/O can be
    absorbed there (see gateway.routing.affinity.sync_loop).
    """
    client = sharing.client()
    try:
        while not stop.is_set():
            try:
                async with asyncio.timeout(PUBLISH_S):
                    await stop.wait()
            except TimeoutError:
                pass
            if stop.is_set():
                break
            try:
                payload = orjson.dumps(summarize())
                sharing.write_file(payload)
                if client is not None:
                    await sharing.exchange(client, payload, time.time())
            except Exception:  # a bug, or a value no check foresaw: this round is lost, never the sharing
                log.exception("stats sharing round failed")
    finally:
        sharing.remove_file()
        if client is not None:
            await sharing.withdraw(client)
            await client.aclose()
