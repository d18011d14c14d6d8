"""Replicas that agree: latency-model learning and breaker openings shared through Redis, off the request path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway.stats.rolling import LatencyModel

if TYPE_CHECKING:
    from gateway.fleet.pool import BackendState, Pool
    from gateway.runtime import Gateway

log = logging.getLogger("shapegate.replicas")

TICK_S = 0.2  # breaker openings go out, and the others' come in, at this pace
LATENCY_EVERY_S = 2.0  # latency sums go out, and the others' come in, at this pace
LATENCY_KEY = "latency"  # a hash: a field per process, its own learning per backend
BREAKER_KEY = "breakers"  # a hash: a field per backend, the latest opening any process saw there
BREAKER_KEEP_S = 180.0  # longer than any hold (an engine's Retry-After is capped at 120 s)
FIT_LEN, SVC_LEN = 30, 2  # the sums of LatencyModel's fit (5 parameters) and of its service time
ERRORS = (RedisError, OSError, TimeoutError)


def latency_keep_s(half_life_s: float) -> float:
    """How long a process's latency entry is kept after its last update: after four half-lives it weighs 1/16."""
    return max(60.0, 4.0 * half_life_s)


@dataclass(slots=True)
class Folded:
    """The entry of one (process, backend) this process folded in last: the next one adds only what is new."""

    model: LatencyModel  # ours it went into (a reload that replaces the backend starts a new model)
    epoch: str  # the publisher's model it came from
    t: float  # wall time the publisher took its sums
    n: int
    fit: list[float]
    svc: list[float]


def _floats(v: object, n: int) -> list[float]:
    if not isinstance(v, list) or len(v) != n:
        raise ValueError(f"expected {n} numbers")
    out = [float(x) for x in v]
    if not all(math.isfinite(x) for x in out):
        raise ValueError("a sum is not finite")
    return out


class LatencyShare:
    """Each process publishes, per backend, the decayed sums of what its latency model learned itself (its own
    requests only). They are cumulative: a reader that missed rounds, or a replica that starts, takes them whole
    once and then only what each new entry adds (the entry less the previous one decayed to the new one's time),
    so nothing is counted twice, and what a replica took from others is never published back."""

    def __init__(self, me: str) -> None:
        self.me = me  # this process's field
        self._epochs: dict[str, tuple[LatencyModel, str]] = {}
        self._folded: dict[tuple[str, str], Folded] = {}

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
        """Fold in what the other processes' entries add since they were last folded; returns the requests."""
        imported = 0
        for field, raw in entries.items():
            if field == self.me:
                continue  # our own learning is in our model already
            try:
                data = orjson.loads(raw)
                t, per_backend = float(data["t"]), data["b"]
                for bid, entry in per_backend.items():
                    b = backends.get(bid)
                    if b is not None:
                        imported += self._fold_one((field, bid), b.latency, entry, t, now_wall, now_mono)
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
                log.warning("ignoring a malformed latency entry of %s: %r", field, e)
        return imported

    def _fold_one(self, key: tuple[str, str], model: LatencyModel, entry: dict, t: float, now_wall: float,
                  now_mono: float) -> int:
        epoch, n = str(entry["e"]), int(entry["n"])
        fit, svc = _floats(entry["f"], FIT_LEN), _floats(entry["s"], SVC_LEN)
        prev = self._folded.get(key)
        hl = model.half_life
        if prev is not None and prev.model is model and prev.epoch == epoch:
            if t <= prev.t:
                return 0  # seen already
            f = 0.5 ** ((t - prev.t) / hl)  # what we folded last, as it stands at this entry's time
            add_fit = [c - p * f for c, p in zip(fit, prev.fit)]
            add_svc = [c - p * f for c, p in zip(svc, prev.svc)]
            requests = max(n - prev.n, 0)
        else:  # new to us (or a new model on either side): the whole of it
            add_fit, add_svc, requests = fit, svc, n
        age = 0.5 ** (max(now_wall - t, 0.0) / hl)  # decayed from when it was taken to now
        model.absorb([v * age for v in add_fit], [v * age for v in add_svc], requests, now_mono)
        self._folded[key] = Folded(model, epoch, t, n, fit, svc)
        return requests

    def forget_before(self, oldest_wall: float) -> None:
        """Drop what is remembered of entries not updated since `oldest_wall` (a process gone long ago).

        An entry missing from one read is not forgotten: after Redis loses its data the publisher writes the same
        cumulative sums again, and only the remembered entry keeps them from being counted a second time."""
        for key in [k for k, v in self._folded.items() if v.t < oldest_wall]:
            del self._folded[key]


class BreakerShare:
    """A breaker that opens here is written to one Redis hash (a field per backend); the others' openings are
    applied once each (see Breaker.hold): they keep requests off the engine for the rest of the opener's hold."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.pending: dict[str, float] = {}  # backend -> opened_until (monotonic), not yet written to Redis
        self._seq = 0
        self._seen: dict[str, bytes] = {}  # backend -> the field's value last read (each opening applies once)
        self.wake = asyncio.Event()

    def opened(self, backend: str, until: float) -> None:
        """Breaker.on_open, on the request path: take note and wake the loop; the write happens there."""
        self.pending[backend] = until
        self.wake.set()

    def outgoing(self, now_wall: float, now_mono: float) -> dict[str, bytes]:
        out = {}
        for bid, until in list(self.pending.items()):
            if until <= now_mono:
                del self.pending[bid]  # over before it could be told: nothing to tell
                continue
            self._seq += 1
            out[bid] = orjson.dumps({"by": self.me, "n": self._seq, "at": now_wall, "hold_s": until - now_mono})
        return out

    def sent(self, written: Mapping[str, bytes], until: Mapping[str, float]) -> None:
        for bid in written:
            if self.pending.get(bid) == until.get(bid):
                del self.pending[bid]  # unless it opened again meanwhile

    def apply(self, rows: Mapping[str, bytes], pool: Pool, now_wall: float, now_mono: float) -> int:
        """Apply the openings other processes wrote since the last read; returns how many held a breaker open."""
        applied = 0
        for bid, raw in rows.items():
            if self._seen.get(bid) == raw:
                continue
            self._seen[bid] = raw
            try:
                e = orjson.loads(raw)
                by, at, hold_s = str(e["by"]), float(e["at"]), float(e["hold_s"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                log.warning("ignoring a malformed breaker entry for %s: %r", bid, err)
                continue
            left = hold_s - max(now_wall - at, 0.0)
            b = pool.get(bid)
            if by == self.me or b is None or not math.isfinite(left) or left <= 0:
                continue
            if b.breaker.hold(now_mono + left, now_mono):
                applied += 1
                log.info("breaker of %s held open for %.1f s: it opened on another replica", bid, left)
        return applied


def _text(rows: Mapping) -> dict[str, bytes]:
    return {k.decode() if isinstance(k, bytes) else str(k): v for k, v in rows.items()}


class ReplicaSync:
    """The loop that carries both, one Redis client, every call bounded by [state] redis_timeout_s."""

    def __init__(self, g: Gateway) -> None:
        self.g = g
        st = g.cfg.state
        self.me = f"{g.sharing.replica}/{g.sharing.worker}"
        self.latency = LatencyShare(self.me)
        self.breakers = BreakerShare(self.me)
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
        await self.breaker_round()
        await self.latency_round()
        self._task = asyncio.create_task(self._loop(), name="replica-sync")
        return self

    async def stop(self) -> None:
        """A flag rather than task.cancel() (a cancellation inside the Redis client's I/O can be absorbed there);
        a last latency round leaves this process's learning to the replicas that come later."""
        self._stopping = True
        self.breakers.wake.set()
        if self._task is not None:
            await self._task
        await self.latency_round()
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
            try:
                await self.breaker_round()
                if time.monotonic() >= next_latency:
                    next_latency = time.monotonic() + LATENCY_EVERY_S
                    await self.latency_round()
            except Exception:  # a bug here must not end the sharing for good, nor the shutdown
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
                if out:
                    p.pexpire(self._breaker_key, int(BREAKER_KEEP_S * 1000))
                p.hgetall(self._breaker_key)
                rows = (await p.execute())[-1]
        except ERRORS as e:
            self._failed(e)
            return
        self._succeeded()
        self.breakers.sent(out, until)
        applied = self.breakers.apply(_text(rows), self.g.pool, time.time(), time.monotonic())
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
        try:
            async with asyncio.timeout(self._timeout), self._client.pipeline(transaction=False) as p:
                if payload is not None:
                    p.hset(self._latency_key, self.me, payload)
                    p.pexpire(self._latency_key, int(keep * 1000))
                p.hgetall(self._latency_key)
                rows = _text((await p.execute())[-1])
        except ERRORS as e:
            self._failed(e)
            return
        self._succeeded()
        backends = {b.id: b for b in g.pool.all() if g.pool.get(b.id) is b}  # active ones, not draining
        imported = self.latency.fold(rows, backends, time.time(), time.monotonic())
        if imported:
            g.metrics.replica_import("latency", imported)
        self.latency.forget_before(now_wall - 3 * keep)
        stale = [f for f, raw in rows.items() if f != self.me and _taken_before(raw, now_wall - keep)]
        if stale:
            with contextlib.suppress(*ERRORS):
                async with asyncio.timeout(self._timeout):
                    await self._client.hdel(self._latency_key, *stale)

    def _failed(self, e: BaseException) -> None:
        self.g.metrics.replica_sync_error()
        if not self._failing:  # once per outage; the metric counts every failed round
            log.warning("replicas' latency learning and breaker openings not shared (Redis: %s); routing on what "
                        "this replica knows until it answers again", str(e) or type(e).__name__)
        self._failing = True

    def _succeeded(self) -> None:
        if self._failing:
            log.info("Redis answers again: sharing latency learning and breaker openings with the other replicas")
            self._failing = False


def _taken_before(raw: bytes, when: float) -> bool:
    try:
        return float(orjson.loads(raw)["t"]) < when
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return True  # unreadable: nobody can use it
