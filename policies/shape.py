"""shape: predict each candidate's latency for the request's class from the live-fitted model, pick the best."""

from __future__ import annotations

from typing import Final

from gateway.contracts import INTERACTIVE, LONG_PROMPT, BackendView, Decision, RouteInput
from policies.shape_params import Params

# Score added to a backend that is still being explored and already has its exploration requests:
# it stays in the ranking (failover) but loses to every measured backend.
EXPLORE_PENALTY_S: Final = 1e4
# Score added to a backend predicted to stream a TTFT-scored request slower than max_itl_s.
SLOW_STREAM_PENALTY_S: Final = 100.0
# Score added to a slot engine where a request would queue for a slot while another candidate can start it
# now, and to an interactive backend whose slots are all kept for sessions: both stay as failover only.
QUEUED_SLOT_PENALTY_S: Final = 1e3
MAX_SESSIONS: Final = 4096  # sessions remembered; ids are client strings, so the memory is bounded


def idle_slot(b: BackendView, assumed_slots: int) -> bool:
    """A free llama.cpp slot: the gateway's own in-flight count against the slot total, else the scraped idle count."""
    load = b.load
    if load is not None and load.total_slots:
        return b.in_flight < load.total_slots
    if load is not None and load.idle_slots is not None:
        return load.idle_slots > 0
    return b.in_flight < assumed_slots


class Settings:
    """Params as plain attributes: a request reads a dozen, and each read of a pydantic model's field goes
    through its __getattr__ hook (a few hundred instructions); compiled (mypyc cannot compile a pydantic model,
    hence Params in a module of its own), each is a field of a C struct.

    Written out rather than copied in a loop over Params.model_fields: mypy then types each attribute from
    Params (a loop would need the types declared a second time, unchecked), and mypyc sees every attribute set
    in __init__, so a read skips its "undefined?" check. tests/unit/test_policies.py fails if one is left out.
    """

    def __init__(self, p: Params) -> None:
        self.herd_weight = p.herd_weight
        self.wait_weight = p.wait_weight
        self.max_itl_s = p.max_itl_s
        self.explore_samples = p.explore_samples
        self.explore_in_flight = p.explore_in_flight
        self.explore_max_output = p.explore_max_output
        self.reserve_interactive_slots = p.reserve_interactive_slots
        self.session_memory_s = p.session_memory_s
        self.kv_high = p.kv_high
        self.assumed_slots = p.assumed_slots
        self.size_alpha = p.size_alpha


class Shape:
    name = "shape"
    needs_prefix = True

    def __init__(self, params: Params) -> None:
        self.p = Settings(params)
        # Running mean (prompt, output) tokens of the requests this policy sent to each backend. Known at
        # dispatch, so unlike the mean of finished requests it is not biased towards the short ones.
        self._sizes: dict[str, tuple[float, float]] = {}
        # Session id -> when its last turn was routed: the sessions an interactive backend keeps slots for.
        self._sessions: dict[str, float] = {}

    def predict(self, b: BackendView, inp: RouteInput, reserve: int) -> tuple[float, float, float, float]:
        """(queue wait, TTFT, ITL, cost to the streams already running) of the request on backend b, in seconds."""
        shape = inp.shape
        est = b.latency
        load = b.load
        n_out = shape.output_tokens if shape.output_tokens > 0 else 1
        cached = 0
        if b.id == inp.affinity and (shape.session_id is not None or load is None or not load.total_slots):
            # A slot engine keeps one prompt per slot: only a session that returns to its own slot finds it.
            cached = inp.affinity_tokens
        uncached = shape.prompt_tokens - cached
        if uncached < 1:
            uncached = 1  # an engine always computes at least the last prompt token
        in_flight = b.in_flight
        if load is not None and load.total_slots and load.idle_slots is not None:
            # Slots busy by the engine's own count: requests of other clients or replicas hold slots too.
            in_flight = max(in_flight, load.total_slots - load.idle_slots)
        running = float(in_flight)
        wait = 0.0
        if load is not None and load.total_slots:  # slot engine: beyond the slots, requests wait for one
            cap = load.total_slots - reserve
            if cap < 1:
                cap = 1
            if in_flight >= cap:
                wait = (in_flight - cap + 1) * self.service(b, cap) / cap
                running = float(cap)
        elif load is not None:
            engine_running = load.running or 0.0
            if load.waiting:  # the engine queues: departures come at running / service per second
                ahead = max(load.waiting, in_flight - engine_running)
                wait = (ahead + 1) * self.service(b, engine_running) / max(engine_running, 1.0)
                running = max(min(running, engine_running), 1.0)
            elif load.kv_usage is not None and load.kv_usage >= self.p.kv_high:
                wait = self.service(b, engine_running) / max(engine_running, 1.0)
        ttft = est.ttft(uncached, wait, running)
        itl = est.itl(running + 1.0)  # with this request among the streams
        herd = running * (uncached / est.prefill_rate + est.itl_b * n_out)
        return wait, ttft, itl, herd

    def service(self, b: BackendView, running: float) -> float:
        """Mean time a request holds a slot of b: the model applied to the sizes sent there, else measured."""
        sizes = self._sizes.get(b.id)
        est = b.latency
        if sizes is None:
            return est.service_s
        n_in, n_out = sizes
        return est.ttft(n_in) + n_out * est.itl(running)

    def rank(self, inp: RouteInput) -> Decision:
        p = self.p
        klass = inp.shape.klass
        use_ttft = klass == LONG_PROMPT or klass == INTERACTIVE
        steps = (inp.shape.output_tokens if inp.shape.output_tokens > 0 else 1) - 1
        scored: list[tuple[float, float, int, BackendView]] = []
        slot_ok: set[int] = set()
        explore: tuple[int, float, int] | None = None  # (samples, score, index) of the backend to try
        # Sessions are never the guinea pigs: they wait on every token.
        cheap = klass != INTERACTIVE and inp.shape.output_tokens <= p.explore_max_output
        kept = p.reserve_interactive_slots
        if klass == INTERACTIVE and inp.shape.session_id is not None:
            self._session_seen(inp.shape.session_id, inp.now)
        elif any(b.interactive for b in inp.candidates):
            kept = max(kept, self._active_sessions(inp.now))
        queued: list[int] = []  # slot engines where the request would wait for a slot
        can_start_now = False
        for i, b in enumerate(inp.candidates):
            reserve = kept if b.interactive and klass != INTERACTIVE else 0
            wait, ttft, itl, herd = self.predict(b, inp, reserve)
            if use_ttft:
                metric = ttft
                score = ttft + p.wait_weight * wait
                if itl > p.max_itl_s:
                    score += SLOW_STREAM_PENALTY_S
            else:
                metric = ttft + steps * itl
                score = metric + p.wait_weight * wait + p.herd_weight * herd
            slots = b.load.total_slots if b.load is not None else None
            if reserve and slots and reserve >= slots:
                score += QUEUED_SLOT_PENALTY_S  # every slot is kept for the sessions that use this backend
            elif wait > 0 and slots:
                queued.append(i)
            elif wait == 0:
                can_start_now = True
            if b.latency.samples < p.explore_samples:
                if b.in_flight >= p.explore_in_flight:
                    score += EXPLORE_PENALTY_S
                elif cheap and (explore is None or (b.latency.samples, score) < explore[:2]):
                    explore = (b.latency.samples, score, i)
            if klass == INTERACTIVE and b.interactive and idle_slot(b, p.assumed_slots):
                slot_ok.add(i)
            scored.append((score, metric, i, b))
        if queued and can_start_now and not use_ttft:
            # A request behind busy slots waits for as long as a whole request takes there, the least certain
            # prediction of all: never when an engine that batches (or a free slot elsewhere) can start it now.
            scored = [(s[0] + QUEUED_SLOT_PENALTY_S, *s[1:]) if s[2] in queued else s for s in scored]
        scored.sort(key=_score)
        name = "ttft" if use_ttft else "e2e"
        if explore is not None:
            # The prior of an unmeasured engine is only a guess: measure it with a small request.
            first = next(s for s in scored if s[2] == explore[2])
            scored.remove(first)
            scored.insert(0, first)
            self._routed(first[3].id, inp)
            return Decision(tuple(s[3] for s in scored), f"shape:{klass} explore {first[3].id}")
        if slot_ok:
            # A single interactive session runs best alone on a slot engine: take its idle slot first.
            first = next(s for s in scored if s[2] in slot_ok)
            scored.remove(first)
            scored.insert(0, first)
            self._routed(first[3].id, inp)
            return Decision(tuple(s[3] for s in scored),
                            f"shape:interactive slot {first[3].id} {name}={_fmt(first[1])}")
        best = scored[0]
        self._routed(best[3].id, inp)
        if len(scored) == 1:
            return Decision((best[3],), f"shape:{klass} {name}={_fmt(best[1])}")
        runner_up = scored[1]  # named: "vs 0.80s" alone would not say which backend lost
        return Decision(tuple(s[3] for s in scored),
                        f"shape:{klass} {name}={_fmt(best[1])} vs {runner_up[3].id}={_fmt(runner_up[1])}")

    def _routed(self, backend: str, inp: RouteInput) -> None:
        shape = inp.shape
        old = self._sizes.get(backend)
        if old is None:
            self._sizes[backend] = (float(shape.prompt_tokens), float(shape.output_tokens))
            if len(self._sizes) > 4096:  # ids come from config; only a long run of reloads gets here
                self._sizes.clear()
            return
        a = self.p.size_alpha
        self._sizes[backend] = (old[0] + a * (shape.prompt_tokens - old[0]),
                                old[1] + a * (shape.output_tokens - old[1]))

    def _session_seen(self, session: str, now: float) -> None:
        self._sessions.pop(session, None)
        self._sessions[session] = now  # re-inserted: the dict stays in the order of last use
        if len(self._sessions) > MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]

    def _active_sessions(self, now: float) -> int:
        """Sessions with a turn within session_memory_s; older ones are forgotten on the way."""
        horizon = now - self.p.session_memory_s
        sessions = self._sessions
        while sessions:
            oldest = next(iter(sessions))
            if sessions[oldest] >= horizon:
                break
            del sessions[oldest]
        return len(sessions)


def _score(s: tuple[float, float, int, BackendView]) -> tuple[float, int]:
    return s[0], s[2]


def _fmt(seconds: float) -> str:
    return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.0f}s"
