"""Step-based engine model: admission, batching, prefill chunks and decode tokens on the caller's clock.

Pure and synchronous: `step(now)` plans one engine iteration and returns when it ends, so the
same code runs under the real-time loop (which sleeps until that end) and under a virtual clock
(which just jumps to it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.sim.prefix import BlockCache, SlotCache
from gateway.sim.profiles import Profile

WAITING, RUNNING, DONE, ABORTED = "waiting", "running", "done", "aborted"

# How each engine mixes work in a step:
#  mixed          vLLM: decode every running sequence, fill the rest of the token budget with prefill chunks
#  prefill_first  SGLang: a step with pending prefill runs prefill only; decoding waits for it
#  slots          llama.cpp: fixed slots, mixed batches across the busy ones
MODES = {"vllm": "mixed", "sglang": "prefill_first", "llamacpp": "slots"}
# Prefix cache granularity: vLLM full 16-token blocks, SGLang single tokens (radix, page_size 1).
BLOCK_TOKENS = {"vllm": 16, "sglang": 1}


@dataclass(eq=False)
class SimRequest:
    """One request as the engine sees it; progress fields are written by the scheduler."""

    prompt: Sequence[int]
    max_new: int
    arrival: float
    ready_at: float  # when it reaches the scheduler (after frontend work)
    output_ids: Sequence[int] = ()
    slot_hint: int = -1  # llama.cpp id_slot
    cache_prompt: bool = True
    internal: bool = False  # health probes: not counted in the engine's counters
    finish_reason: str = "length"
    state: str = WAITING
    cached: int = 0
    prefilled: int = 0
    generated: int = 0
    slot: int = -1
    kv_reserved: int = 0
    admitted_at: float = -1.0
    first_token_at: float = -1.0
    prev_token_at: float = -1.0
    last_token_at: float = -1.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


@dataclass
class StepResult:
    """One engine iteration: when it ran, who got a token, who finished."""

    start: float
    end: float
    emitted: list[SimRequest]
    finished: list[SimRequest]
    prefill_tokens: int
    seqs: int


@dataclass
class Counters:
    """Cumulative engine counters (the raw material of each flavour's /metrics)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    seq_steps: int = 0
    busy_seconds: float = 0.0
    finished: int = 0
    aborted: int = 0
    last_hit_rate: float = 0.0
    by_reason: dict[str, int] = field(default_factory=dict)


class Scheduler:
    """The engine core: waiting queue, running batch or slots, KV budget, prefix cache."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.engine = profile.engine
        self.mode = MODES[profile.engine]
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.kv_reserved = 0
        self.counters = Counters()
        self.cache: BlockCache | None = None
        self.slots: SlotCache | None = None
        self.slot_owner: list[SimRequest | None] = []
        if self.mode == "slots":
            self.slots = SlotCache(profile.max_running)
            self.slot_owner = [None] * profile.max_running
        else:
            self.cache = BlockCache(BLOCK_TOKENS[self.engine], profile.prefix_cache_tokens)

    # -- queue -------------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        if req.prompt_len < 1 or req.max_new < 1:
            raise ValueError("a request needs at least one prompt token and one output token")
        req.state = WAITING
        self.waiting.append(req)

    def abort(self, req: SimRequest) -> bool:
        """Drop a request wherever it is (client gone); frees its batch entry, KV or slot."""
        if req.state == WAITING and req in self.waiting:
            self.waiting.remove(req)
            req.state = ABORTED
        elif req.state == RUNNING:
            self._release(req, ABORTED)
        else:
            return False
        if not req.internal:
            self.counters.aborted += 1
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_ready(self) -> float | None:
        """When the earliest waiting request reaches the scheduler (None if none waits)."""
        return min((r.ready_at for r in self.waiting), default=None)

    def waiting_count(self, now: float) -> int:
        return sum(1 for r in self.waiting if r.ready_at <= now)

    def kv_used_tokens(self) -> int:
        return sum(r.prefilled + r.generated for r in self.running)

    # -- one iteration -----------------------------------------------------------------------
    def step(self, now: float) -> StepResult | None:
        """Plan and account one iteration starting at `now`; None when there is nothing to run."""
        decode = [r for r in self.running if r.prefilled >= r.prompt_len]
        partial = [r for r in self.running if r.prefilled < r.prompt_len]
        budget = self.profile.max_step_tokens
        if self.mode == "prefill_first":
            chunks = self._plan_prefill(now, budget, partial)
            if chunks:
                decode = []  # SGLang does not mix: running sequences wait for the prefill batch
        else:
            chunks = self._plan_prefill(now, budget - len(decode), partial)
        if not chunks and not decode:
            return None
        prefill = sum(n for _, n in chunks)
        seqs = len(decode) + len(chunks)
        context = sum(r.prefilled + r.generated for r in decode)  # KV that decode attention reads
        end = now + self.profile.step_seconds(seqs, prefill, context)
        emitted: list[SimRequest] = []
        finished: list[SimRequest] = []
        for req in decode:
            self._emit(req, end, emitted, finished)
        for req, n in chunks:
            req.prefilled += n
            if req.prefilled >= req.prompt_len:
                if self.cache is not None:
                    self.cache.insert(req.prompt)
                self._emit(req, end, emitted, finished)
        for req in finished:
            self._release(req, DONE)
        c = self.counters
        c.steps += 1
        c.seq_steps += seqs
        c.busy_seconds += end - now
        return StepResult(now, end, emitted, finished, prefill, seqs)

    def _plan_prefill(
        self, now: float, budget: int, partial: list[SimRequest]
    ) -> list[tuple[SimRequest, int]]:
        """Prompt chunks for this step: unfinished prefills first, then newly admitted requests."""
        chunks: list[tuple[SimRequest, int]] = []
        for req in partial:
            if budget <= 0:
                return chunks
            n = min(req.prompt_len - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
        hits = queried = 0
        while budget > 0:
            admitted = self._admit_next(now)
            if admitted is None:
                break
            req = admitted
            n = min(req.prompt_len - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
            hits += req.cached
            queried += req.prompt_len
        if queried:
            self.counters.last_hit_rate = hits / queried
        return chunks

    def _admit_next(self, now: float) -> SimRequest | None:
        """The first waiting request that fits now, in arrival order (FCFS, head-of-line blocking)."""
        for i, req in enumerate(self.waiting):
            if req.ready_at > now:
                continue
            if self._try_admit(req, now):
                del self.waiting[i]
                return req
            if not (self.mode == "slots" and req.slot_hint >= 0):
                return None
            # llama.cpp defers a task pinned to a busy slot and serves the others meanwhile.
        return None

    def _try_admit(self, req: SimRequest, now: float) -> bool:
        if self.mode == "slots":
            if not self._take_slot(req):
                return False
        else:
            if len(self.running) >= self.profile.max_running:
                return False
            # Reserve the whole request (prompt plus output budget): it then never has to be
            # preempted, and a full pool makes new requests wait, as both engines do under pressure.
            need = req.prompt_len + req.max_new
            if self.running and self.kv_reserved + need > self.profile.kv_tokens:
                return False
            req.kv_reserved = need
            self.kv_reserved += need
            req.cached = self.cache.match(req.prompt) if self.cache is not None else 0
        req.prefilled = req.cached
        req.admitted_at = now
        req.state = RUNNING
        self.running.append(req)
        if not req.internal:
            self.counters.prompt_tokens += req.prompt_len
            self.counters.cached_tokens += req.cached
        return True

    def _take_slot(self, req: SimRequest) -> bool:
        assert self.slots is not None
        idle = [s for s, owner in enumerate(self.slot_owner) if owner is None]
        if not idle:
            return False
        if req.slot_hint >= 0:
            slot = req.slot_hint % len(self.slot_owner)
            if slot not in idle:
                return False
            reuse = self.slots.reusable(req.prompt, slot)
        else:
            slot, reuse = self.slots.choose(req.prompt, idle)
        req.slot = slot
        req.cached = reuse if req.cache_prompt else 0
        self.slot_owner[slot] = req
        return True

    def _emit(self, req: SimRequest, end: float, emitted: list, finished: list) -> None:
        req.generated += 1
        if req.generated == 1:
            req.first_token_at = end
        req.prev_token_at = req.last_token_at
        req.last_token_at = end
        emitted.append(req)
        if not req.internal:
            self.counters.generation_tokens += 1
        if req.generated >= req.max_new:
            finished.append(req)

    def _release(self, req: SimRequest, state: str) -> None:
        self.running.remove(req)
        req.state = state
        self.kv_reserved -= req.kv_reserved
        req.kv_reserved = 0
        kept = tuple(req.prompt[: req.prefilled]) + tuple(req.output_ids[: req.generated])
        if self.slots is not None:
            self.slot_owner[req.slot] = None
            self.slots.store(req.slot, kept)
        elif self.cache is not None and state == DONE:
            self.cache.insert(kept)
        if state == DONE and not req.internal:
            self.counters.finished += 1
            reasons = self.counters.by_reason
            reasons[req.finish_reason] = reasons.get(req.finish_reason, 0) + 1
