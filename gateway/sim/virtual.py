"""Virtual-clock runs of the scheduler: closed-loop benchmark workloads measured without real sleeping."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from gateway.sim.profiles import Profile
from gateway.sim.scheduler import Scheduler, SimRequest
from gateway.sim.tokens import VOCAB


@dataclass(frozen=True)
class Workload:
    """N streams, each sending its next request as soon as the previous one finishes."""

    streams: int
    requests_per_stream: int
    prompt_tokens: int
    output_tokens: int
    # bench_serving's "random" dataset: lengths drawn uniformly from [1, n] (range ratio 0),
    # which also spreads the streams apart in time instead of running them in lock-step.
    random_lengths: bool = False
    seed: int = 0


@dataclass(frozen=True)
class RunResult:
    """GenAI-Perf style figures of one run: TTFT, TPOT = (e2e - TTFT) / (out - 1), throughput."""

    requests: int
    mean_ttft_s: float
    median_ttft_s: float
    mean_tpot_s: float
    median_tpot_s: float
    output_tps: float
    total_tps: float
    makespan_s: float


def _lengths(rng: random.Random, work: Workload) -> tuple[int, int]:
    if work.random_lengths:
        return rng.randint(1, work.prompt_tokens), rng.randint(1, work.output_tokens)
    return work.prompt_tokens, work.output_tokens


def run_closed_loop(profile: Profile, work: Workload) -> RunResult:
    """Drive one scheduler with the workload on a virtual clock and measure it like a client would."""
    sched = Scheduler(profile)
    rng = random.Random(work.seed)
    owner: dict[SimRequest, int] = {}
    left = [work.requests_per_stream] * work.streams
    done: list[SimRequest] = []

    def send(stream: int, t: float) -> None:
        n_in, n_out = _lengths(rng, work)
        prompt = [rng.randrange(VOCAB) for _ in range(n_in)]  # random tokens: no prefix hits
        req = SimRequest(prompt=prompt, max_new=n_out, arrival=t, ready_at=t + profile.frontend_s)
        owner[req] = stream
        sched.submit(req)

    for stream in range(work.streams):
        send(stream, 0.0)
    now = 0.0
    while sched.has_work():
        res = sched.step(now)
        if res is None:
            now = max(now, sched.next_ready() or now)
            continue
        now = res.end
        for req in res.finished:
            done.append(req)
            stream = owner.pop(req)
            left[stream] -= 1
            if left[stream] > 0:
                send(stream, now)
    return summarize(done)


def summarize(done: list[SimRequest]) -> RunResult:
    """Client-side figures for finished requests (times relative to a start at 0)."""
    ttft = [r.first_token_at - r.arrival for r in done]
    tpot = [
        (r.last_token_at - r.first_token_at) / (r.generated - 1) for r in done if r.generated > 1
    ]
    makespan = max(r.last_token_at for r in done)
    out_tokens = sum(r.generated for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    return RunResult(
        requests=len(done),
        mean_ttft_s=statistics.fmean(ttft),
        median_ttft_s=statistics.median(ttft),
        mean_tpot_s=statistics.fmean(tpot) if tpot else 0.0,
        median_tpot_s=statistics.median(tpot) if tpot else 0.0,
        output_tps=out_tokens / makespan,
        total_tps=(out_tokens + in_tokens) / makespan,
        makespan_s=makespan,
    )
