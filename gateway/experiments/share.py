"""Experiments across processes: run-time changes reach every worker and replica, and each one's samples too."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time

import orjson
from redis.exceptions import RedisError

from gateway.config_experiments import weight_problem
from gateway.experiments.experiment import Experiment, Experiments, check_change
from gateway.experiments.verdict import METRICS
from gateway.stats.share import REDIS_KEEP_S, Sharing, wall_time

log = logging.getLogger("shapegate.experiments")
CONTROL_S = 0.5  # a change made on one process is adopted by the others within this (plus one Redis call)
SAMPLES_S = 3.0  # how often each process publishes its experiment samples (read when a report is asked for)
SAMPLES_STALE_S = 15.0  # a process that stopped publishing this long ago is left out of the verdicts
SHARED_SAMPLES = 400  # per arm, class and metric: what one process publishes of its own bounded sample
CONTROL_FILE = "experiments.control.json"
MAX_VERSION = 2 ** 53  # versions count changes (or are a time in ms): one above this is no version
# Versions move within a range whose top moves with the wall clock: a version more than this many ms ahead of
# now is no version either. A counter pushed to the top (by a bad value or by someone else) then leaves room
# for the next change a millisecond later, where a fixed top would stop every change for good.
VERSION_AHEAD = 10 ** 9
ACK_S = 2.0  # how long a change's writer waits for the other processes to say they applied it (or why not)
ACK_FRESH_S = 3.0  # a process that has not said what it holds for this long is gone: not waited for
MAX_COUNT = 2 ** 53  # requests, errors or comparisons one process counted: one above this is no count
MAX_KEYS = 1024  # (arm, class) pairs, shadow results or arms in one process's samples: more is not a gateway's


class ExperimentShare:
    """Through the workers' directory and, with `[state] backend = "redis"`, Redis (never on a request's path)."""

    def __init__(self, sharing: Sharing) -> None:
        self.sharing = sharing
        self.client = sharing.client()  # None without Redis
        prefix = sharing.redis.key_prefix if sharing.redis else ""
        self._control_key = prefix + "experiments:control"
        self._version_key = prefix + "experiments:version"
        self._applied_key = prefix + "experiments:applied"  # a field per process: the versions it holds, refusals
        self._refusals: dict[str, tuple[int, str]] = {}  # experiment -> (the version this process refused, why)
        self._samples_key = prefix + "experiments:samples"
        self.me = f"{sharing.replica}/{sharing.worker}"
        self.others: dict[str, dict] = {}  # process -> its last published samples (fresh ones)
        self.errors = 0
        self._refused: dict[str, str] = {}  # what was left out, and why (each logged once, not every round)

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
        """A version newer than any process has: Redis' counter when there is one, else the wall clock in ms.
        Never one the other processes would refuse: a counter out of range (version_ceiling) is not used, and is
        set back to the version taken instead."""
        now_ms = time.time_ns() // 1_000_000
        if self.client is not None:
            v = await self._redis(self.client.incr(self._version_key))
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= version_ceiling(now_ms / 1000):
                return max(v, local + 1)
            if v is not None:
                chosen = max(now_ms, local + 1)
                log.warning("the experiments' version counter in Redis is out of range (%r): set back to %d", v,
                            chosen)
                await self._redis(self.client.set(self._version_key, chosen))
                return chosen
        return max(now_ms, local + 1)

    async def confirm(self, name: str, version: int) -> dict:
        """After a change of `name` to `version` went out: which other processes applied it, which refused it
        (and why), which did not say within ACK_S. Each process says what it holds every adopt round."""
        deadline = time.monotonic() + ACK_S
        while True:
            rows = await self._redis(self.client.hgetall(self._applied_key)) if self.client is not None else None
            applied, refused, pending = [], {}, []
            for field, raw in (rows or {}).items():
                proc, data = _text(field), _loads(raw)
                if proc == self.me or not isinstance(data, dict):
                    continue
                if wall_time(data.get("t"), time.time(), ACK_FRESH_S) is None:
                    continue  # gone (or no time): nobody to wait for
                has, no = _held(data, name), _refusal(data, name)
                if has is not None and has >= version:
                    applied.append(proc)
                elif no is not None and no[0] == version:
                    refused[proc] = no[1]
                elif has is not None:
                    pending.append(proc)
            if not pending or time.monotonic() >= deadline:
                return {"applied": sorted(applied), "refused": refused, "pending": sorted(pending)}
            await asyncio.sleep(0.1)

    async def say_held(self, xs: Experiments) -> None:
        """What this process holds of every experiment, and the changes it refused: for confirm() elsewhere."""
        if self.client is None:
            return
        refusals = {n: [v, why] for n, (v, why) in self._refusals.items() if n in xs.by_name}
        payload = orjson.dumps({"t": time.time(), "v": {n: x.version for n, x in xs.by_name.items()},
                                "r": refusals})
        async with self.client.pipeline(transaction=False) as p:
            p.hset(self._applied_key, self.me, payload)
            p.pexpire(self._applied_key, int(REDIS_KEEP_S * 1000))
            await self._redis(p.execute())

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
        now, refused = time.time(), {}
        for controls in found:
            for name, control in controls.items():
                x = xs.by_name.get(name)
                if x is None:
                    continue
                why = control_problem(x, control, now)
                if why is not None:
                    refused[f"control of {name!r}"] = why
                    version = control.get("version") if isinstance(control, dict) else None
                    if _newer(control, x.version) and isinstance(version, int):
                        self._refusals[name] = (version, why)  # said to its writer (say_held, confirm)
                    continue
                try:
                    if x.adopt(control):
                        log.info("experiment %s changed by another process: %s", name, x.control())
                except Exception:  # a value no check foresaw: this change is lost, never the others nor the loop
                    log.exception("experiment %s: another process's change not taken", name)
        self._note_refused(refused, "control")
        await self.say_held(xs)

    def _note_refused(self, refused: dict[str, str], kind: str) -> None:
        """Log what is left out once (the same entries are read again every round), not once a round."""
        for what, why in refused.items():
            if self._refused.get(what) != why:
                log.warning("ignoring the experiment %s in the shared state: %s", what, why)
        self._refused = {k: v for k, v in self._refused.items() if not k.startswith(kind)} | refused

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
            refused = {}
            for k, v in (res[2] if res else {}).items():
                k = _text(k)
                data = _loads(v)
                if k == self.me or not _fresh(data, now):
                    continue
                why = samples_problem(data)
                if why is None:
                    others[k] = data
                else:
                    refused[f"samples of {k!r}"] = why
            self._note_refused(refused, "samples")
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
            try:
                await share.adopt(xs)
                if time.monotonic() - last_samples >= SAMPLES_S:
                    last_samples = time.monotonic()
                    await share.exchange_samples(xs)
            except Exception:  # a bug, or a value no check foresaw: this round is lost, never the sharing
                log.exception("experiment sharing round failed")
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
    return isinstance(data, dict) and wall_time(data.get("taken_at"), now, SAMPLES_STALE_S) is not None


def version_ceiling(now_wall: float) -> int:
    """The highest version a change may have now: VERSION_AHEAD ms past the wall clock, never past MAX_VERSION."""
    return min(int(now_wall * 1000) + VERSION_AHEAD, MAX_VERSION)


def _newer(control: object, version: int) -> bool:
    v = control.get("version") if isinstance(control, dict) else None
    return isinstance(v, int) and not isinstance(v, bool) and v > version


def _held(data: dict, name: str) -> int | None:
    v = data.get("v")
    h = v.get(name) if isinstance(v, dict) else None
    return h if isinstance(h, int) and not isinstance(h, bool) else None


def _refusal(data: dict, name: str) -> tuple[int, str] | None:
    r = data.get("r")
    no = r.get(name) if isinstance(r, dict) else None
    if isinstance(no, list) and len(no) == 2 and isinstance(no[0], int) and isinstance(no[1], str):
        return no[0], no[1][:200]
    return None


def control_problem(x: Experiment, control: object, now_wall: float) -> str | None:
    """Why another process's control state of `x` must not be adopted (None: it may), checked whole before
    anything of it is applied: a version within range (version_ceiling), weights of its arms from 0 to
    MAX_WEIGHT, a time it changed at."""
    if not isinstance(control, dict):
        return "not an object"
    v = control.get("version")
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= version_ceiling(now_wall):
        return f"a version of {v!r}"
    changed_at = control.get("changed_at")
    if changed_at is not None and wall_time(changed_at, now_wall) is None:
        return f"changed at {changed_at!r}, not a time of the past"
    weights = control.get("weights")
    if isinstance(weights, dict):
        for name, w in weights.items():
            why = weight_problem(str(name), w)
            if why is not None:
                return why
    return check_change(x, control)


def _counts(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and 0 <= v <= MAX_COUNT


def _figures(v: object) -> bool:
    return isinstance(v, list) and len(v) <= SHARED_SAMPLES and all(
        not isinstance(f, bool) and isinstance(f, (int, float)) and 0 <= f < math.inf for f in v)


def _keyed(v: object, pairs: bool) -> bool:
    return isinstance(v, dict) and len(v) <= MAX_KEYS and all(
        isinstance(k, str) and (not pairs or "|" in k) for k in v)


def samples_problem(data: dict) -> str | None:
    """Why another process's experiment samples cannot go into the verdicts (None: they can): each experiment's
    counts, and figures of at most SHARED_SAMPLES finite numbers >= 0, as Experiment.shared_samples writes."""
    xs = data.get("experiments")
    if not _keyed(xs, pairs=False):
        return "no experiments"
    for name, x in xs.items():
        if not isinstance(x, dict):
            return f"{name[:64]!r}: not an object"
        classes, shadow, agreement = x.get("classes") or {}, x.get("shadow") or {}, x.get("agreement") or {}
        if not (_keyed(classes, pairs=True) and _keyed(shadow, pairs=True) and _keyed(agreement, pairs=False)):
            return f"{name[:64]!r}: malformed classes, shadow or agreement"
        for c in classes.values():
            if not (isinstance(c, dict) and _counts(c.get("requests", 0)) and _counts(c.get("errors", 0))
                    and isinstance(c.get("samples") or {}, dict)
                    and all(_figures((c.get("samples") or {}).get(m, [])) for m in METRICS)):
                return f"{name[:64]!r}: malformed class samples"
        if not all(_counts(n) for n in shadow.values()):
            return f"{name[:64]!r}: malformed shadow counts"
        for a in agreement.values():
            if not (isinstance(a, dict) and _counts(a.get("compared", 0)) and _counts(a.get("exact", 0))
                    and _figures(a.get("prefix_share", [])) and _figures(a.get("prefix_tokens", []))):
                return f"{name[:64]!r}: malformed agreement"
    return None
