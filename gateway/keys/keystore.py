"""The API keys made at run time: one set per gateway that outlives reloads, kept in step across processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time

from gateway.config import GatewayConfig, KeyLimits
from gateway.keys.principal import Principal, hash_key, new_key, principal
from gateway.keys.storage import (ID_PATTERN, FileKeys, KeyBackend, KeyExists, KeyNotFound, KeyRecord, MemoryKeys,
                                  Records, RedisKeys, StoreUnavailable)
from gateway.stats.share import STATS_DIR_ENV

__all__ = ["ID_PATTERN", "KeyExists", "KeyNotFound", "KeyRecord", "KeyStore", "StoreUnavailable"]

log = logging.getLogger("shapegate.keys")

POLL_S = 0.25  # how often a process looks for keys another process made or revoked
USED_PUBLISH_S = 2.0  # how often it publishes when its keys were last used
GROUP_FILE = "runtime-keys"  # `serve --workers N` without Redis or keys_file, in the workers' shared directory
# (named apart from the `*.json` stats summaries read there)


def default_keys_file(config_path: str) -> str:
    """Where `serve` keeps run-time keys when neither Redis nor [auth] keys_file is configured: beside the
    configuration file, named after it (gateway.toml -> gateway.keys.json)."""
    directory, name = os.path.split(os.path.abspath(config_path))
    return os.path.join(directory, name.rpartition(".")[0] or name) + ".keys.json"


def needs_keys_place(cfg: GatewayConfig) -> bool:
    """Whether run-time keys would otherwise live in memory only (and be lost when the gateway stops)."""
    return cfg.auth.enabled and cfg.state.backend != "redis" and not cfg.auth.keys_file


def keeping_keys_in(cfg: GatewayConfig, path: str) -> GatewayConfig:
    """The configuration with run-time keys kept in `path` (checked the way [auth] keys_file is: a ValueError
    saying why when another local user could change that place, or this process cannot write there)."""
    FileKeys(path, "the run-time keys file beside the configuration")
    if not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
        raise ValueError(f"the run-time keys file beside the configuration {path}: its directory is not writable")
    return cfg.model_copy(update={"auth": cfg.auth.model_copy(update={"keys_file": path})})


def with_default_keys_file(old: GatewayConfig, new: GatewayConfig, config_path: str) -> GatewayConfig:
    """A reloaded configuration keeps the keys file serve chose beside it (the file itself still names none)."""
    default = default_keys_file(config_path)
    if old.auth.keys_file == default and needs_keys_place(new):
        return new.model_copy(update={"auth": new.auth.model_copy(update={"keys_file": default})})
    return new


def where_kept(cfg: GatewayConfig) -> str:
    """Where run-time keys live, in words for the start-up log."""
    if cfg.state.backend == "redis":
        return f"in Redis ({cfg.state.key_prefix}keys)"
    if cfg.auth.keys_file:
        return f"in {cfg.auth.keys_file}"
    return "in memory only (--ephemeral-keys): they are lost when the gateway stops"


def backend_for(cfg: GatewayConfig) -> KeyBackend:
    """Redis when replicas share it; else the keys file; else a file only the workers of this group share
    (gone with them), or this process's memory."""
    if cfg.state.backend == "redis":
        return RedisKeys(cfg.state)
    if cfg.auth.keys_file:
        return FileKeys(cfg.auth.keys_file)
    group_dir = os.environ.get(STATS_DIR_ENV)
    return FileKeys(os.path.join(group_dir, GROUP_FILE)) if group_dir else MemoryKeys()


class KeyStore:
    """Run-time keys by digest, for the Authenticator; made, listed and revoked through gateway.ops.admin_keys.

    `by_digest` and `generation` change together, with no await in between: an Authenticator that sees a new
    generation drops the keys it had cached as proven, so a revoked key is refused at once.
    """

    def __init__(self, backend: KeyBackend) -> None:
        self.backend = backend
        self.records: Records = {}
        self.by_digest: dict[str, tuple[str, Principal]] = {}
        self.generation = 0
        # id -> when a key last authenticated a request here (written per request, published in batches)
        self.used: dict[str, float] = {}
        self._published: dict[str, float] = {}
        self._lock = asyncio.Lock()  # a change and a reload never interleave (a reload could undo the change)
        self._errors = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    @classmethod
    def for_config(cls, cfg: GatewayConfig) -> KeyStore:
        return cls(backend_for(cfg))

    @property
    def kind(self) -> str:
        return self.backend.kind

    def _swap(self, records: Records) -> None:
        self.by_digest = {r.sha256: (r.sha256, principal(r.id, r.admin, r.limits, r.sha256, r.priority,
                                                                 r.priority_header)) for r in records.values()}
        self.records = records
        self.generation += 1

    # -- changes (admin routes) ----------------------------------------------------------------------
    async def create(self, key_id: str | None, admin: bool, limits: KeyLimits | None,
                     taken: frozenset[str] = frozenset(), priority: str | None = None,
                     priority_header: bool = False) -> tuple[str, KeyRecord]:
        """A new key and its record; KeyExists when `key_id` is taken (here or in `taken`), StoreUnavailable
        when the store cannot take it (then nothing changed)."""
        for _ in range(5):  # a generated id that happens to exist is drawn again
            rid = key_id or f"key-{secrets.token_hex(6)}"
            if rid in taken:
                if key_id is not None:
                    raise KeyExists(rid)
                continue
            key = new_key()
            rec = KeyRecord(id=rid, sha256=hash_key(key), admin=admin, limits=limits, priority=priority,
                            priority_header=priority_header, created=round(time.time(), 3))
            async with self._lock:
                try:
                    fresh = await self.backend.add(rec)
                except KeyExists:
                    if key_id is not None:
                        raise
                    continue
                self._swap(fresh if fresh is not None else {**self.records, rid: rec})
            return key, rec
        raise KeyExists("generated ids")

    async def revoke(self, key_id: str) -> None:
        """KeyNotFound when no run-time key has this id; StoreUnavailable when the store cannot take it."""
        async with self._lock:
            fresh = await self.backend.remove(key_id)
            self._swap(fresh if fresh is not None else {k: r for k, r in self.records.items() if k != key_id})
        self.used.pop(key_id, None)

    async def last_used(self) -> dict[str, float]:
        """When each key was last used, here or (as far as they published it) by the other processes."""
        try:
            merged = await self.backend.read_used()
        except StoreUnavailable as e:
            log.warning("last use of keys from other processes unavailable: %s", e)
            merged = {}
        for k, t in self.used.items():
            merged[k] = max(t, merged.get(k, 0.0))
        return merged

    # -- keeping in step ------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Take the stored set if it changed; on a store error keep the set in use (logged now and then)."""
        try:
            async with self._lock:
                records = await self.backend.poll()
                if records is not None and records != self.records:
                    self._swap(records)
        except StoreUnavailable as e:
            self._errors += 1
            if self._errors == 1 or self._errors % 400 == 0:
                log.warning("run-time keys not refreshed (%d errors), the last loaded set stays in use: %s",
                            self._errors, e)
            return
        if self._errors:
            log.info("run-time keys refreshed again after %d errors", self._errors)
            self._errors = 0

    async def publish_used(self) -> None:
        changed = {k: t for k, t in self.used.items() if self._published.get(k) != t}
        if not changed:
            return
        try:
            await self.backend.publish_used(changed)
        except StoreUnavailable as e:
            log.debug("last use of keys not published: %s", e)
            return
        self._published.update(changed)

    async def start(self) -> None:
        """Load the stored keys, then follow changes in the background (a store shared with no other process
        needs no following)."""
        await self.refresh()
        if self.backend.kind != "memory":
            self._task = asyncio.create_task(self._follow(), name="key-sync")

    async def _follow(self) -> None:
        # Ends on a flag, not task.cancel(): a cancellation inside the Redis client's I/O can be absorbed there.
        published = time.monotonic()
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self._stop.wait()
            if self._stop.is_set():
                break
            try:
                await self.refresh()
                if time.monotonic() - published >= USED_PUBLISH_S:
                    published = time.monotonic()
                    await self.publish_used()
            except Exception:  # a surprise must not stop the following for good; the next round tries again
                log.exception("run-time keys: refresh failed")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task  # within one store round trip (each bounded by a timeout)
            self._task = None
        await self.publish_used()
        await self.backend.close()
