"""Clairvoyant references for the routing benchmark: the live runs' seeded arrivals placed on the virtual clock.

The four engines' schedulers (the simulator's own code and profiles) run on one virtual clock, with
no real sleeping, the prompts and outputs the live engines saw (same seed, tokenizer and output
text), and sessions whose next turn comes THINK_S after the previous one ends. Three placements:

  bound     each request alone on its best backend, with the longest prefix any earlier request
            could have left in its cache: no placement can do better, so its SLO attainment is an
            upper bound on every policy's (live or virtual)
  greedy    clairvoyant placement: at each arrival, every backend that can hold the request is
            tried by draining a copy of that engine with the request added, and the request goes
            where it gains the most requests within their SLO (ties: least added e2e). It knows the
            engines' exact state and every running request's remaining length, not future arrivals
  replay    each live run's own placements (its records' backends) on the same virtual clock: the
            policy's placement judged without the live stack's overheads, comparable with greedy
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
import multiprocessing
from collections import Counter
from dataclasses import dataclass, field

from benchmarks import routing_workload as W
from gateway.sim.options import SimOptions
from gateway.sim.prefix import common_prefix
from gateway.sim.profiles import Profile
from gateway.sim.scheduler import Scheduler, SimRequest
from gateway.sim.tokens import encode, generate, render_chat

SIM_SEED = 0  # the simulated engines' seed (SimOptions' default): it fixes their output texts


@dataclass(eq=False)
class Job:
    """One request of a run: its prompt and output tokens as the engines see them."""

    id: str
    kind: W.Kind
    at: float  # arrival; a session's later turns arrive when the turn before ends
    prompt: list[int]
    output: tuple[int, ...]
    prior: tuple[int, ...] = ()  # the longest token prefix an earlier request could have cached
    next_turn: Job | None = None


@dataclass(eq=False)
class VReq(SimRequest):
    job: Job | None = None


def jobs_of(load: W.Load, window_s: float, seed: int) -> list[Job]:
    """The run's requests, in arrival order of their first turn; session turns chained by next_turn."""
    jobs: list[Job] = []
    seen: list[tuple[int, ...]] = []  # every earlier request's prompt + output

    def make(rid: str, kind: W.Kind, at: float, body: dict) -> tuple[Job, str]:
        prompt = encode(render_chat(body["messages"]))
        out = generate(SIM_SEED, prompt, body["max_tokens"], ignore_eos=True)
        prior = max(seen, key=lambda s: common_prefix(prompt, s), default=())
        seen.append(tuple(prompt) + out.ids)
        jobs.append(Job(rid, kind, at, prompt, out.ids, prior))
        return jobs[-1], out.text

    for i, a in enumerate(W.schedule(load, window_s, seed)):
        if a.body is not None:
            make(str(i), a.kind, a.at, a.body)
            continue
        history: list[dict] = []
        prev = None
        for turn in range(W.SESSION_TURNS):
            job, reply = make(f"{i}.{turn}", W.INTERACTIVE, a.at if turn == 0 else math.inf,
                              W.turn_body(a, history, turn))
            history += [{"role": "user", "content": a.turn_texts[turn]}, {"role": "assistant", "content": reply}]
            if prev is not None:
                prev.next_turn = job
            prev = job
    return jobs


def meets(req: SimRequest) -> bool:
    k = req.job.kind
    itl = (req.last_token_at - req.first_token_at) / (req.generated - 1) if req.generated > 1 else 0.0
    return req.first_token_at - req.arrival <= k.ttft_slo and itl <= k.itl_slo


def advance(sched: Scheduler, clock: float, finished) -> float:
    """One engine step from `clock` (or the wait for a request still in its frontend delay); the new clock."""
    res = sched.step(clock)
    if res is None:
        return sched.next_ready()
    for req in res.finished:
        finished(req, res.end)
    return res.end


def drain(sched: Scheduler, clock: float, finished) -> None:
    while sched.has_work():
        clock = advance(sched, clock, finished)


def wake(sched: Scheduler, clock: float, t: float) -> float:
    """The engine's clock once a request arrives at `t`: an idle engine wakes then, a busy one keeps stepping."""
    return clock if sched.has_work() else max(clock, t)


def candidates(job: Job, windows: dict[str, int]) -> list[str]:
    """Backends whose context window holds the request (prompt and every output token)."""
    return [b for b, n in windows.items() if len(job.prompt) + len(job.output) <= n]


def profiles(portfolio: tuple) -> dict[str, Profile]:
    return {bid: SimOptions(engine=engine, profile=profile).resolve_profile() for bid, engine, profile, _ in portfolio}


class Portfolio:
    """The portfolio's engines on one virtual clock; arrivals are placed by `choose(job, t)`."""

    def __init__(self, profiles: dict[str, Profile], windows: dict[str, int]) -> None:
        self.engines = {bid: Scheduler(p) for bid, p in profiles.items()}
        self.windows = windows
        self.clock = dict.fromkeys(self.engines, 0.0)
        self.outcomes: dict[str, tuple[str, bool, float]] = {}  # job id -> backend, met SLO, e2e

    def request(self, bid: str, job: Job, t: float) -> VReq:
        return VReq(prompt=job.prompt, max_new=len(job.output), arrival=t,
                    ready_at=t + self.engines[bid].profile.frontend_s, output_ids=job.output, job=job)

    def submit(self, bid: str, req: VReq) -> None:
        self.clock[bid] = wake(self.engines[bid], self.clock[bid], req.arrival)
        self.engines[bid].submit(req)

    def run(self, jobs: list[Job], choose) -> dict:
        """Every arrival placed by `choose(job, t) -> backend or None (not sent)`; the per-job outcomes."""
        tie = itertools.count()
        arrivals = [(j.at, next(tie), j) for j in jobs if j.at < math.inf]
        heapq.heapify(arrivals)

        def finished(bid: str):
            def record(req: VReq, t: float) -> None:
                self.outcomes[req.job.id] = (bid, meets(req), t - req.arrival)
                if req.job.next_turn is not None:
                    heapq.heappush(arrivals, (t + W.THINK_S, next(tie), req.job.next_turn))
            return record

        while True:
            busy = [(self.clock[b], b) for b, s in self.engines.items() if s.has_work()]
            step_at, bid = min(busy, default=(math.inf, ""))
            if arrivals and arrivals[0][0] < step_at:
                t, _, job = heapq.heappop(arrivals)
                chosen = choose(job, t)
                if chosen is not None:
                    self.submit(chosen, self.request(chosen, job, t))
            elif bid:
                # One step of the engine due first, so session turns it ends arrive in time order.
                self.clock[bid] = advance(self.engines[bid], step_at, finished(bid))
            else:
                return self.outcomes


def greedy(profiles: dict[str, Profile], windows: dict[str, int], jobs: list[Job]) -> dict:
    """The clairvoyant placement: each arrival where draining the engine with it gains most."""
    pf = Portfolio(profiles, windows)
    memo_base = {id(x): x for j in jobs for x in (j, j.prompt, j.output)}
    base: dict[str, dict[str, tuple[bool, float]]] = {b: {} for b in pf.engines}  # last drain, per engine

    def trial(bid: str, job: Job, t: float) -> dict[str, tuple[bool, float]]:
        # A deep copy that shares the (never mutated) jobs and prompts with the live schedulers.
        sched = copy.deepcopy(pf.engines[bid], dict(memo_base))
        clock = wake(sched, pf.clock[bid], t)
        sched.submit(pf.request(bid, job, t))
        out: dict[str, tuple[bool, float]] = {}
        drain(sched, clock, lambda r, end: out.__setitem__(r.job.id, (meets(r), end - r.arrival)))
        return out

    def choose(job: Job, t: float) -> str:
        scored = []
        for bid in candidates(job, pf.windows):
            out = trial(bid, job, t)
            before = base[bid]
            gain = sum(m for m, _ in out.values()) - sum(before[i][0] for i in out if i in before)
            added = sum(e for _, e in out.values()) - sum(before[i][1] for i in out if i in before)
            scored.append((-gain, added, bid, out))
        _, _, bid, out = min(scored)
        base[bid] = out
        return bid

    return pf.run(jobs, choose)


def replay(profiles: dict[str, Profile], windows: dict[str, int], jobs: list[Job], placed: dict[str, str]) -> dict:
    """A live run's placements on the virtual clock (requests it did not place are not sent)."""
    pf = Portfolio(profiles, windows)
    return pf.run(jobs, lambda job, t: placed.get(job.id) or None)


def alone(profiles: dict[str, Profile], windows: dict[str, int], job: Job) -> tuple[str, bool, float]:
    """The best (met SLO, then shortest e2e) of the job run alone on each backend, its prefix cached."""
    best = None
    for bid in candidates(job, windows):
        pf = Portfolio({bid: profiles[bid]}, windows)
        sched = pf.engines[bid]
        if sched.slots is not None:  # in every slot: wherever llama.cpp puts it, the prefix is there
            for slot in range(len(sched.slot_owner)):
                sched.slots.store(slot, job.prior)
        else:
            sched.cache.insert(job.prior)
        req = pf.request(bid, job, 0.0)
        sched.submit(req)
        drain(sched, 0.0, lambda r, end: None)
        outcome = (bid, meets(req), req.last_token_at)
        if best is None or (outcome[1], -outcome[2]) > (best[1], -best[2]):
            best = outcome
    return best


def bound(profiles: dict[str, Profile], windows: dict[str, int], jobs: list[Job]) -> dict:
    return {j.id: alone(profiles, windows, j) for j in jobs}


def figures(outcomes: dict, jobs: list[Job]) -> dict:
    """SLO attainment overall and per class (over every job of the schedule), and where each class went."""
    out: dict = {"n": len(jobs), "slo": sum(outcomes[j.id][1] for j in jobs if j.id in outcomes) / len(jobs),
                 "classes": {}}
    for kind in W.KINDS:
        js = [j for j in jobs if j.kind is kind]
        if js:
            got = [outcomes[j.id] for j in js if j.id in outcomes]
            out["classes"][kind.name] = {"n": len(js), "slo": sum(m for _, m, _ in got) / len(js),
                                         "backends": dict(Counter(b for b, _, _ in got))}
    return out


@dataclass
class Task:
    load: W.Load
    window_s: float
    seed: int
    portfolio: tuple
    windows: dict[str, int]
    placements: dict[str, dict[str, str]] = field(default_factory=dict)  # policy -> job id -> backend


def compute(task: Task) -> dict:
    jobs = jobs_of(task.load, task.window_s, task.seed)
    prof = profiles(task.portfolio)
    out = {"load": task.load.name, "seed": task.seed, "bound": figures(bound(prof, task.windows, jobs), jobs),
           "greedy": figures(greedy(prof, task.windows, jobs), jobs), "replay": {}}
    for policy, placed in task.placements.items():
        out["replay"][policy] = figures(replay(prof, task.windows, jobs, placed), jobs)
    return out


def references(runs: list[dict], loads: dict[str, W.Load], window_s: float, portfolio: tuple,
               windows: dict[str, int]) -> list[dict]:
    """The references of every (load, seed) of the live runs, two at a time (one per core); runs rejected
    for late engine steps are not replayed."""
    tasks: dict[tuple[str, int], Task] = {}
    for run in runs:
        task = tasks.setdefault((run["load"], run["seed"]),
                                Task(loads[run["load"]], window_s, run["seed"], portfolio, windows))
        if not run["rejected"]:
            task.placements[run["policy"]] = {r["id"]: r["backend"] for r in run["records"] if r["backend"]}
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        return pool.map(compute, list(tasks.values()))
