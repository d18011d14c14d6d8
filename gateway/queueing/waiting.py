"""The queue itself: requests wait here, holding no engine connection, while every backend that could serve them is
saturated, and go out in the order of gateway/queueing/order.py when a seat frees (a request ending on a backend, a
fresh load scrape). Bounded in length and in waiting time; a client that leaves is taken out at once."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Final, Iterable, Mapping, Sequence

from gateway.config_queue import PRIORITIES, QueueSettings
from gateway.contracts import INTERACTIVE
from gateway.errors import GatewayError, overloaded
from gateway.queueing.order import FairOrder, Waiter
from gateway.queueing.priority import DEADLINE_HEADER, deadline_missed, deadline_of, level_of
from gateway.queueing.seats import Seated, room, seat_count, share_basis
from gateway.routing.admission import saturated

NEVER: Final = float("-inf")
MAX_SESSIONS: Final = 4096  # sessions remembered; ids are client strings, so the memory is bounded


def elsewhere(candidates: Iterable) -> bool:
    """Whether a request may go to a backend not marked interactive (then those marked keep seats for sessions)."""
    return any(not b.interactive for b in candidates)


class Entry:
    """A waiting request: what it may be served by, and how its wait ends."""

    __slots__ = ("future", "candidates", "klass", "model", "capped", "deadline_at", "deadline_s", "prompt_tokens",
                 "since", "elsewhere")

    def __init__(self, future: asyncio.Future, candidates: Sequence, klass: str, model: str, capped: bool,
                 deadline_s: float | None, since: float, prompt_tokens: int) -> None:
        self.future = future
        self.candidates = candidates
        self.klass, self.model, self.capped = klass, model, capped
        self.deadline_s = deadline_s
        self.deadline_at = since + deadline_s if deadline_s is not None else None
        self.since = since
        self.prompt_tokens = prompt_tokens
        self.elsewhere = elsewhere(candidates)


class WaitQueue:
    """One process's queue. `settings` gives the settings in force (a reload may change them); `observe` is told of
    every wait's end (priority, outcome, seconds waited) and `changed` of every change in length."""

    def __init__(self, settings: Callable[[], QueueSettings | None],
                 observe: Callable[[str, str, float], None] = lambda p, o, s: None,
                 changed: Callable[[WaitQueue], None] = lambda q: None) -> None:
        self._settings = settings
        self._observe, self._changed = observe, changed
        self.order = FairOrder(len(PRIORITIES), self._weight)
        self.by_model: dict[str, int] = {}  # waiters per model: none waiting for it, a request with a seat goes at once
        self.demand: dict[str, float] = {}  # model -> when a request of a class without a seat share last came in
        # Interactive sessions by when their last turn came in, oldest first: a backend marked interactive keeps a
        # seat for each one seen within reserve_window_s (as the shape policy keeps its slots for them).
        self.sessions: dict[str, float] = {}
        self.outcomes: dict[tuple[str, str], list[float]] = {}  # (priority, outcome) -> [count, seconds waited, max]
        self._scheduled = False

    @property
    def length(self) -> int:
        return self.order.length

    def _weight(self, key: str) -> float:
        qs = self._settings()
        return qs.key_weights.get(key, 1.0) if qs is not None else 1.0

    # -- a backend's seat ------------------------------------------------------------------------------
    def takes(self, b, klass: str, model: str, now: float, qs: QueueSettings, elsewhere: bool = True) -> bool:
        """Whether `b` can take a request of `klass` for `model` now: usable, and open (below)."""
        return b.usable(now) and self.open(b, klass, model, now, qs, elsewhere)

    def open(self, b, klass: str, model: str, now: float, qs: QueueSettings, elsewhere: bool = True) -> bool:
        """Whether usable `b` has a seat for a request of `klass` for `model` now: not saturated by [admission], a
        seat free, and its class under its share of the seats while other classes came in for the model lately.
        `elsewhere`: the request has a candidate not marked interactive (else no seat is kept from it for sessions:
        it would wait for nothing)."""
        if qs.admission_on and saturated(b, klass, now, qs.admission):
            return False
        free = room(b, now)
        if free is not None and free <= 0:
            return False
        if b.interactive and klass != INTERACTIVE and free is not None and elsewhere:
            kept = max(qs.keep_interactive, self._active_sessions(now, qs.reserve_window_s))
            if kept and free <= kept:
                return False  # its free seats are kept for the sessions that use it
        share = qs.shares.get(klass)
        if share is not None and now - self.demand.get(model, NEVER) <= qs.reserve_window_s:
            n, assumed = share_basis(b, now)
            if n and b.capped >= max(1, int(n * share)):
                if assumed:
                    b.held_by_share = True  # (the assumed count grows at the next load sample if there is room)
                return False
        return True

    def _session_seen(self, sid: str, now: float) -> None:
        sessions = self.sessions
        sessions.pop(sid, None)  # (re-inserted last: the dict stays oldest first)
        sessions[sid] = now
        if len(sessions) > MAX_SESSIONS:
            del sessions[next(iter(sessions))]

    def _active_sessions(self, now: float, window_s: float) -> int:
        """Sessions with a turn within the window; older ones are forgotten on the way."""
        sessions = self.sessions
        while sessions:
            sid, seen = next(iter(sessions.items()))
            if now - seen <= window_s:
                break
            del sessions[sid]
        return len(sessions)

    # -- the request path ---------------------------------------------------------------------------------
    def admit_now(self, headers: Mapping[str, str], caller: Any, shape: Any, candidates: list, now: float,
                  qs: QueueSettings) -> list | None:
        """The candidates (usable now: the pool's) with a seat for the request when nothing waits for its model:
        one check per candidate, and no coroutine. None: it waits (admit)."""
        klass, model = shape.klass, shape.model
        if klass not in qs.shares:
            self.demand[model] = now
        if klass == INTERACTIVE and shape.session_id is not None:
            self._session_seen(shape.session_id, now)
        # Both headers checked on every request (a bad one is a 400 whether or not it would have waited).
        if headers.get(DEADLINE_HEADER) is not None:
            deadline_of(headers, qs.max_deadline_ms)
        if caller.priority_header:
            level_of(headers, caller.priority, True, qs.class_level, klass)
        if self.by_model.get(model):
            return None
        other = elsewhere(candidates)
        return [b for b in candidates if self.open(b, klass, model, now, qs, other)] or None

    async def admit(self, headers: Mapping[str, str], caller: Any, shape: Any, candidates: list, now: float,
                    qs: QueueSettings) -> list:
        """admit_now's candidates, else the ones open after the request's wait in the queue. Raises 503/429
        (Retry-After) past the queue's bounds, 504 past the client's deadline."""
        open_ = self.admit_now(headers, caller, shape, candidates, now, qs)
        if open_ is not None:
            return open_
        return await self.wait(headers, caller, shape, candidates, now, qs)

    async def wait(self, headers: Mapping[str, str], caller: Any, shape: Any, candidates: list, now: float,
                   qs: QueueSettings) -> list:
        """The request waits for a seat (admit_now said it must): the candidates open once it has one."""
        model = shape.model
        deadline_s = deadline_of(headers, qs.max_deadline_ms)
        level = level_of(headers, caller.priority, caller.priority_header, qs.class_level, shape.klass)
        priority, key = PRIORITIES[level], caller.id
        if self.order.length >= qs.max_length:
            self._end(priority, "full", 0.0)
            raise overloaded(model, qs.status, qs.retry_after_s)
        limit = qs.max_wait_s
        if deadline_s is not None:
            limit = min(limit, deadline_s - self._soonest_ttft(candidates, shape.prompt_tokens))
            if limit <= 0:
                self._end(priority, "deadline", 0.0)
                raise deadline_missed(model, deadline_s, 0.0)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        e = Entry(fut, candidates, shape.klass, model, shape.klass in qs.shares, deadline_s, now,
                  shape.prompt_tokens)
        due = now + (deadline_s if deadline_s is not None else qs.ttft_target_s.get(shape.klass, 1.0))
        w = self.order.add(level, key, due, e)
        self.by_model[model] = self.by_model.get(model, 0) + 1
        self._changed(self)
        self.wake()  # a seat may be free now: the order decides who takes it
        outcome = "left"
        try:
            async with asyncio.timeout(limit):
                b = await fut
            outcome = "served"
        except TimeoutError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                b, outcome = fut.result(), "served"  # granted in the same turn as the timeout: served all the same
            elif deadline_s is not None and limit < qs.max_wait_s:
                outcome = "deadline"
                raise deadline_missed(model, deadline_s, time.monotonic() - now) from None
            else:
                outcome = "timeout"
                raise overloaded(model, qs.status, qs.retry_after_s) from None
        except GatewayError:
            outcome = "deadline"  # refused when a seat came: the deadline could not be met there
            raise
        finally:
            if fut.done() and not fut.cancelled() and fut.exception() is None and outcome != "served":
                self._release(fut.result(), e)  # granted, but its client left first: the seat goes to another
                self.wake()
            self._leave(w, e)
            self._end(priority, outcome, time.monotonic() - now)
            if not fut.done():
                fut.cancel()
        self._release(b, e)
        t = time.monotonic()
        return [c for c in candidates if self.takes(c, e.klass, model, t, qs, e.elsewhere)] or [b]

    def _leave(self, w: Waiter, e: Entry) -> None:
        self.order.remove(w)
        n = self.by_model.get(e.model, 0) - 1
        if n > 0:
            self.by_model[e.model] = n
        else:
            self.by_model.pop(e.model, None)
        self._changed(self)

    def _end(self, priority: str, outcome: str, waited: float) -> None:
        c = self.outcomes.get((priority, outcome))
        if c is None:
            c = self.outcomes[priority, outcome] = [0, 0.0, 0.0]
        c[0] += 1
        c[1] += waited
        c[2] = max(c[2], waited)
        self._observe(priority, outcome, waited)

    @staticmethod
    def _hold(b, e: Entry) -> None:
        b.held += 1
        if e.capped:
            b.capped += 1

    @staticmethod
    def _release(b, e: Entry) -> None:
        """The seat a grant held, given back as the request goes out (its attempt takes it for real)."""
        b.held -= 1
        if e.capped:
            b.capped -= 1

    @staticmethod
    def _soonest_ttft(candidates: Iterable, prompt_tokens: int) -> float:
        """The first-token time the latency models predict on the quickest candidate, with nothing queued."""
        return min((b.latency.estimate().ttft(prompt_tokens) for b in candidates), default=0.0)

    # -- granting seats ---------------------------------------------------------------------------------
    def wake(self) -> None:
        """A seat may have freed (a request ended, a load scrape came): look at the queue once this turn's
        callbacks have run (many wakes in one turn make one pass)."""
        if not self._scheduled and self.order.length:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._pass)

    def _pass(self) -> None:
        self._scheduled = False
        qs = self._settings()
        if qs is None:  # a reload turned the queue off: every waiter goes on, as it would have without a queue
            for w in list(self.order.in_order()):
                if w.item.future.done():
                    continue  # its client left (the future cancelled with its task): its task takes it out
                self.order.grant(w)
                self._hold(w.item.candidates[0], w.item)
                w.item.future.set_result(w.item.candidates[0])
            return
        now = time.monotonic()
        full: set[tuple[int, str, str, bool]] = set()  # (backend, class, model, elsewhere) found full: stays full
        granted = True
        while granted and self.order.length:
            granted = False
            for w in self._in_turn(now - qs.promote_after_s):
                e: Entry = w.item
                if e.future.done():
                    continue  # its client left (the future cancelled with its task): its task takes it out
                b = self._pick(e, now, qs, full)
                if b is None:
                    continue
                if e.deadline_at is not None and now + b.latency.estimate().ttft(e.prompt_tokens) > e.deadline_at:
                    self.order.remove(w)  # refused, not served: its key is not charged
                    e.future.set_exception(deadline_missed(e.model, e.deadline_s or 0.0, now - e.since))
                else:
                    self.order.grant(w)
                    self._hold(b, e)
                    e.future.set_result(b)
                granted = True
                break

    def _in_turn(self, promoted_since: float) -> list[Waiter]:
        """The waiters in the order they get seats: the queue's order, those waiting since before `promoted_since`
        first (among themselves in the same order: priority, then the fair share across keys)."""
        order = list(self.order.in_order())
        if order and min(w.item.since for w in order) <= promoted_since:
            return ([w for w in order if w.item.since <= promoted_since]
                    + [w for w in order if w.item.since > promoted_since])
        return order

    def _pick(self, e: Entry, now: float, qs: QueueSettings, full: set) -> Any:
        """The candidate with the most free seats that takes the request now, or None."""
        best, best_room = None, None
        for b in e.candidates:
            k = (id(b), e.klass, e.model, e.elsewhere)
            if k in full:
                continue
            if not self.takes(b, e.klass, e.model, now, qs, e.elsewhere):
                full.add(k)
                continue
            free = room(b, now)
            if best is None or (free is not None and (best_room is None or free > best_room)):
                best, best_room = b, free
        return best

    # -- what it shows ----------------------------------------------------------------------------------
    @staticmethod
    def seats(b: Seated, now: float) -> int:
        """The seats `b` is known to have (0: not known yet), for /stats."""
        return seat_count(b, now)

    def report(self) -> dict:
        """Lengths now and how waits ended since start, per priority (/stats, the dashboard)."""
        lengths = self.order.level_lengths()
        out: dict[str, Any] = {"length": self.order.length, "priorities": {}}
        for i, p in enumerate(PRIORITIES):
            ends = {o: {"count": c[0], "mean_wait_s": round(c[1] / c[0], 4) if c[0] else 0.0,
                        "max_wait_s": round(c[2], 4)}
                    for (pp, o), c in sorted(self.outcomes.items()) if pp == p}
            out["priorities"][p] = {"length": lengths[i], "ended": ends}
        return out
