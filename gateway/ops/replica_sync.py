"""Replicas that agree: latency-model learning, breaker openings and engines' learned seat counts shared through Redis,
off the request path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway.ops.breaker_share import BREAKER_KEEP_S, BREAKER_KEY, BreakerShare
from gateway.ops.replica_checks import (FIT_LEN, MALFORMED, SVC_LEN, figures_now, implausible, max_hold_s,
                                        read_entry)
from gateway.ops.seat_share import SEATS_KEEP_S, SEATS_KEY, SeatShare
from gateway.stats.rolling import LatencyModel
from gateway.stats.share import wall_time

if TYPE_CHECKING:
    from gateway.fleet.pool import BackendState
    from gateway.runtime import Gateway

log = logging.getLogger("shapegate.replicas")

TICK_S = 0.2  # breaker openings go out, and the others' come in, at this pace
LATENCY_EVERY_S = 2.0  # latency sums go out, and the others' come in, at this pace
LATENCY_KEY = "latency"  # a hash: a field per process, its own learning per backend
ERRORS = (RedisError, OSError, TimeoutError)


def latency_keep_s(half_life_s: float) -> float:
    """How long a process's latency entry is kept after its last update: after four half-lives it weighs 1/16."""
    return max(60.0, 4.0 * half_life_s)


@dataclass(slots=True)
class Folded:
    """The entry of one (process, backend) this process folded in last, and what of it is in our model now."""

    model: LatencyModel  # ours it went into (a reload that replaces the backend starts a new model)
    epoch: str  # the publisher's model it came from
    t: float  # wall time the publisher took its sums
    n: int  # its requests (each counted once among the imports, however often the entry comes and goes)
    fit: list[float] | None  # what of it our model holds, as of `at` (None: withdrawn, the entry went)
    svc: list[float]
    at: float  # monotonic

    def held(self, model: LatencyModel, now_mono: float) -> tuple[list[float], list[float], int]:
        """What of this entry `model` holds now: its sums decayed since they went in, and its requests."""
        if self.fit is None or self.model is not model:
            return [0.0] * FIT_LEN, [0.0] * SVC_LEN, 0
        f = 0.5 ** (max(now_mono - self.at, 0.0) / model.half_life)
        return [v * f for v in self.fit], [v * f for v in self.svc], self.n


class LatencyShare:
    """Each process publishes, per backend, the decayed sums of what its latency model learned itself (its own
    requests only). They are cumulative: a reader holds of each entry exactly its latest sums, decayed from when
    they were taken, and adds only the difference when a newer one comes, so nothing is counted twice, and what a
    replica took from others is never published back.

    An entry is checked before anything of it is taken (read_entry, its time, implausible): one that fails is
    logged once and left out, and what an earlier one of the same process gave stays. When an entry goes from
    Redis, what it gave goes too, within one round: a bad value never outlives its removal. After Redis lost
    its data that is everyone's learning for a moment; each process writes its sums again within
    LATENCY_EVERY_S and they are taken back whole (their requests not counted again)."""

    def __init__(self, me: str) -> None:
        self.me = me  # this process's field
        self._epochs: dict[str, tuple[LatencyModel, str]] = {}
        self._folded: dict[tuple[str, str], Folded] = {}
        self._refused: dict[tuple[str, str], str] = {}  # entries left out, and why (each logged once)
        # backend -> (its model, when the window began (monotonic), the figures then): see FAR_FACTOR
        self._anchors: dict[str, tuple[LatencyModel, float, tuple[float, float, float]]] = {}

    def _epoch(self, backend: str, model: LatencyModel) -> str:
        known = self._epochs.get(backend)
        if known is None or known[0] is not model:
            known = self._epochs[backend] = (model, secrets.token_hex(4))
        return known[1]

    def export(self, backends: Iterable[BackendState], now_wall: float, now_mono: float) -> bytes | None:
        """This process's own learning per backend (None: it has learned nothing yet)."""
        out = {}
        for b in backends:
            m = b.latency
            if m.samples:
                fit, svc = m.own_moments(now_mono)
                out[b.id] = {"e": self._epoch(b.id, m), "n": m.samples, "f": fit, "s": svc}
        return orjson.dumps({"t": now_wall, "b": out}) if out else None

    def fold(self, entries: Mapping[str, bytes], backends: Mapping[str, BackendState], now_wall: float,
             now_mono: float) -> int:
        """Fold in what the other processes' entries add since they were last folded, withdraw what entries
        gone from Redis gave; returns the requests newly learned from."""
        imported = 0
        present: set[tuple[str, str]] = set()
        unreadable: set[str] = set()  # fields that say nothing: what they gave before stays until they go
        for field, raw in entries.items():
            if field == self.me:
                continue  # our own learning is in our model already
            try:
                data = orjson.loads(raw)
                t, per_backend = wall_time(data["t"], now_wall), data["b"]
                if t is None:
                    raise ValueError(f"taken at {data['t']!r}, not a time of the last while")
                if not isinstance(per_backend, dict):
                    raise TypeError("no backends")
            except MALFORMED as e:
                unreadable.add(field)
                self._refuse((field, ""), "malformed", f"ignoring a malformed latency entry of {field!r}: {e!r}")
                continue
            self._refused.pop((field, ""), None)
            for bid, entry in per_backend.items():
                key = (field, bid)
                present.add(key)
                b = backends.get(bid)
                if b is None:
                    continue
                try:
                    anchor = self._anchor(bid, b.latency, now_mono)
                    imported += self._fold_one(key, b.latency, read_entry(entry), t, now_wall, now_mono, anchor)
                except MALFORMED as e:
                    why = f"ignoring a malformed latency entry of {field!r} for {bid}: {e!r}"
                    self._refuse(key, "malformed", why)
        for key, f in self._folded.items():
            if f.fit is not None and key not in present and key[0] not in unreadable:
                self._withdraw(f, now_mono)
        for key in [k for k in self._refused if k[0] not in entries]:
            del self._refused[key]
        return imported

    def _anchor(self, backend: str, model: LatencyModel, now_mono: float) -> tuple[float, float, float] | None:
        """The figures `model` had when the current window of one half-life began (None while it is cold)."""
        known = self._anchors.get(backend)
        if known is not None and known[0] is model and now_mono - known[1] < model.half_life:
            return known[2]
        figures = figures_now(model, now_mono)
        if figures is None:
            self._anchors.pop(backend, None)
            return None
        self._anchors[backend] = (model, now_mono, figures)
        return figures

    def _fold_one(self, key: tuple[str, str], model: LatencyModel, entry: tuple[str, int, list[float], list[float]],
                  t: float, now_wall: float, now_mono: float, anchor: tuple[float, float, float] | None = None) -> int:
        epoch, n, fit, svc = entry
        prev = self._folded.get(key)
        same = prev is not None and prev.model is model and prev.epoch == epoch
        if same and prev is not None and prev.fit is not None and t <= prev.t:
            return 0  # seen already
        age = 0.5 ** (max(now_wall - t, 0.0) / model.half_life)  # decayed from when it was taken to now
        want_fit, want_svc = [v * age for v in fit], [v * age for v in svc]
        had_fit, had_svc, had_n = prev.held(model, now_mono) if prev is not None else ([0.0] * FIT_LEN,
                                                                                          [0.0] * SVC_LEN, 0)
        add_fit = [w - h for w, h in zip(want_fit, had_fit)]
        add_svc = [w - h for w, h in zip(want_svc, had_svc)]
        why = implausible(model, add_fit, add_svc, now_mono, anchor)
        if why is not None:
            self._refuse(key, "implausible", f"not taking the latency entry of {key[0]!r} for {key[1]}: {why}")
            return 0
        if self._refused.pop(key, None) is not None:
            log.info("taking the latency entry of %r for %s again", *key)
        model.absorb(add_fit, add_svc, n - had_n, now_mono)
        self._folded[key] = Folded(model, epoch, t, n, want_fit, want_svc, now_mono)
        return max(n - prev.n, 0) if same and prev is not None else n

    def _withdraw(self, f: Folded, now_mono: float) -> None:
        fit, svc, n = f.held(f.model, now_mono)
        f.model.absorb([-v for v in fit], [-v for v in svc], -n, now_mono)
        f.fit, f.svc = None, []

    def _refuse(self, key: tuple[str, str], kind: str, why: str) -> None:
        """Log an entry left out once (it is read again every round), not once a round."""
        if self._refused.get(key) != kind:
            log.warning("%s", why)
        self._refused[key] = kind

    def forget_before(self, oldest_wall: float) -> None:
        """Drop what is remembered of entries not updated since `oldest_wall` (a process gone long ago; its
        entry was deleted from Redis, and what it gave withdrawn, long before)."""
        for key in [k for k, v in self._folded.items() if v.t < oldest_wall]:
            del self._folded[key]


def _text(rows: Mapping) -> dict[str, bytes]:
    # (errors="replace": a field name no replica writes must not stop the round that reads the others)
    return {k.decode(errors="replace") if isinstance(k, bytes) else str(k): v for k, v in rows.items()}


class ReplicaSync:
    """The loop that carries them, one Redis client, every call bounded by [state] redis_timeout_s."""

    def __init__(self, g: Gateway) -> None:
        self.g = g
        st = g.cfg.state
        self.me = f"{g.sharing.replica}/{g.sharing.worker}"
        self.latency = LatencyShare(self.me)
        self.breakers = BreakerShare(self.me)
        self.seats = SeatShare()
        self._seats_key = st.key_prefix + SEATS_KEY
        self._latency_key = st.key_prefix + LATENCY_KEY
        self._breaker_key = st.key_prefix + BREAKER_KEY
        self._timeout = st.redis_timeout_s
        self._client = redis_asyncio.Redis.from_url(st.redis_url, socket_timeout=st.redis_timeout_s,
                                                    socket_connect_timeout=st.redis_timeout_s)
        self._failing = False
        self._stopping = False
        self._task: asyncio.Task | None = None

    @classmethod
    async def start(cls, g: Gateway) -> ReplicaSync:
        """Watch breakers, pull what the other replicas know (so the first request routes on it), start the loop."""
        self = cls(g)
        g.pool.watch_breakers(self.breakers.opened)
        await self._round(latency=True)
        self._task = asyncio.create_task(self._loop(), name="replica-sync")
        return self

    async def stop(self) -> None:
        """A flag rather than task.cancel() (a cancellation inside the Redis client's I/O can be absorbed there);
        a last latency and seat round leaves this process's learning to the replicas that come later."""
        self._stopping = True
        self.breakers.wake.set()
        if self._task is not None:
            await self._task
        await self.latency_round()
        await self.seat_round()
        await self._client.aclose()

    async def _loop(self) -> None:
        next_latency = time.monotonic() + LATENCY_EVERY_S
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await self.breakers.wake.wait()
            self.breakers.wake.clear()
            if self._stopping:
                break
            latency = time.monotonic() >= next_latency
            if latency:
                next_latency = time.monotonic() + LATENCY_EVERY_S
            await self._round(latency)

    async def _round(self, latency: bool) -> None:
        try:
            await self.breaker_round()
            if latency:
                await self.latency_round()
                await self.seat_round()
        except Exception:  # a bug here must not end the sharing for good, nor the start-up, nor the shutdown
            log.exception("replica sync round failed")

    async def breaker_round(self) -> None:
        """Write this process's new openings and read everyone's, in one round trip."""
        now_wall, now_mono = time.time(), time.monotonic()
        until = dict(self.breakers.pending)
        out = self.breakers.outgoing(now_wall, now_mono)
        try:
            async with asyncio.timeout(self._timeout), self._client.pipeline(transaction=False) as p:
                for bid, entry in out.items():
                    p.hset(self._breaker_key, bid, entry)
                if out:  # (a longer [health] breaker_open_s keeps the entries longer: a hold ends with its entry)
                    keep = max(BREAKER_KEEP_S, max_hold_s(self.g.cfg.health) + 60.0)
                    p.pexpire(self._breaker_key, int(keep * 1000))
                p.hgetall(self._breaker_key)
                rows = (await p.execute())[-1]
        except ERRORS as e:
            self._failed(e)
            return
        self._succeeded()
        self.breakers.sent(out, until)
        applied = self.breakers.apply(_text(rows), self.g.pool, time.time(), time.monotonic(),
                                      max_hold_s(self.g.cfg.health))
        if applied:
            self.g.metrics.replica_import("breaker", applied)

    async def latency_round(self) -> None:
        """Write this process's own latency learning, fold in the others', drop entries of long-gone processes."""
        g = self.g
        if not g.cfg.stats.enabled:
            return  # no learning here: routing runs on the priors, as configured
        now_wall, now_mono = time.time(), time.monotonic()
        keep = latency_keep_s(g.cfg.stats.model_half_life_s)
        payload = self.latency.export(g.pool.all(), now_wall, now_mono)
        rows = await self._write_and_read(self._latency_key, {self.me: payload} if payload is not None else {},
                                          keep if payload is not None else None)
        if rows is None:
            return
        imported = self.latency.fold(rows, self._active(), time.time(), time.monotonic())
        if imported:
            g.metrics.replica_import("latency", imported)
        self.latency.forget_before(now_wall - 3 * keep)
        stale = [f for f, raw in rows.items() if f != self.me and not _usable(raw, now_wall, keep)]
        if stale:
            with contextlib.suppress(*ERRORS):
                async with asyncio.timeout(self._timeout):
                    await self._client.hdel(self._latency_key, *stale)

    async def seat_round(self) -> None:
        """Write the seat counts this process learned beyond the hash's, refresh the hash, take the others'."""
        g = self.g
        active = self._active()
        rows = await self._write_and_read(self._seats_key, self.seats.outgoing(active.values()), SEATS_KEEP_S)
        if rows is None:
            return
        learned = self.seats.take(rows, active)
        if learned:
            g.metrics.replica_import("seats", learned)
            g.queue.wake()  # more seats known: a waiting request may go now

    def _active(self) -> dict[str, BackendState]:
        """The backends by id, not those draining (a reload may have pointed an id at another engine)."""
        pool = self.g.pool
        return {b.id: b for b in pool.all() if pool.get(b.id) is b}

    async def _write_and_read(self, key: str, fields: Mapping[str, bytes],
                              keep_s: float | None) -> dict[str, bytes] | None:
        """Write `fields` into the hash `key` (its expiry set to `keep_s` when given) and read the hash whole, in one
        round trip; None when Redis failed (counted and logged)."""
        try:
            async with asyncio.timeout(self._timeout), self._client.pipeline(transaction=False) as p:
                if fields:
                    p.hset(key, mapping=dict(fields))
                if keep_s is not None:
                    p.pexpire(key, int(keep_s * 1000))
                p.hgetall(key)
                rows = _text((await p.execute())[-1])
        except ERRORS as e:
            self._failed(e)
            return None
        self._succeeded()
        return rows

    def _failed(self, e: BaseException) -> None:
        self.g.metrics.replica_sync_error()
        if not self._failing:  # once per outage; the metric counts every failed round
            log.warning("replicas' latency learning, breaker openings and seat counts not shared (Redis: %s); "
                        "routing on what this replica knows until it answers again", str(e) or type(e).__name__)
        self._failing = True

    def _succeeded(self) -> None:
        if self._failing:
            log.info("Redis answers again: sharing latency learning, breaker openings and seat counts with the other "
                     "replicas")
            self._failing = False


def _usable(raw: bytes, now_wall: float, keep: float) -> bool:
    """Whether an entry may still be of use: readable, taken within `keep` and not in the future (an entry
    that is neither is deleted: nobody can use it, and it would never grow old)."""
    try:
        return wall_time(orjson.loads(raw)["t"], now_wall, keep) is not None
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False
