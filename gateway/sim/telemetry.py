"""Engine-side measurements of a simulated engine: latency histograms and the counters /metrics needs."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from gateway.sim.scheduler import SimRequest, StepResult

# Bucket bounds as each engine declares them (vLLM v1 loggers, SGLang's collector defaults).
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0)
VLLM_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
SGLANG_TTFT = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
               100.0, 200.0, 400.0)
SGLANG_ITL = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
              0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
SGLANG_E2E = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
              100.0, 200.0, 400.0, 800.0, 1200.0, 1800.0, 2400.0)


class Histogram:
    """Cumulative-on-render histogram: per-bucket counts, sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


@dataclass
class RateBucket:
    """llama.cpp's throughput gauges: tokens and milliseconds since the previous scrape."""

    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    predicted_tokens: int = 0
    predicted_ms: float = 0.0


@dataclass
class Telemetry:
    """Latencies as the engine itself would log them, from the modelled step times."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue: Histogram
    tpot: Histogram
    requests_total: int = 0
    prompt_seconds: float = 0.0  # llama.cpp prompt_seconds_total
    predicted_tokens: int = 0  # llama.cpp tokens_predicted_total (counted at slot release)
    predicted_seconds: float = 0.0
    n_tokens_max: int = 0
    bucket: RateBucket = field(default_factory=RateBucket)
    gen_throughput: float = 0.0
    _window_tokens: int = 0
    _window_start: float = -1.0
    late_steps: int = 0  # steps whose tokens went out after their modelled end
    rebases: int = 0  # times the real-time loop gave up catching up and restarted its clock

    @classmethod
    def for_engine(cls, engine: str) -> Telemetry:
        if engine == "sglang":
            return cls(Histogram(SGLANG_TTFT), Histogram(SGLANG_ITL), Histogram(SGLANG_E2E),
                       Histogram(SGLANG_E2E), Histogram(SGLANG_ITL))
        return cls(Histogram(VLLM_TTFT), Histogram(VLLM_ITL), Histogram(VLLM_E2E),
                   Histogram(VLLM_E2E), Histogram(VLLM_ITL))

    def on_submit(self, req: SimRequest) -> None:
        if not req.internal:
            self.requests_total += 1

    def on_step(self, res: StepResult) -> None:
        """Per-token latencies of one step, at its modelled end."""
        for req in res.emitted:
            if req.internal:
                continue
            if req.generated == 1:
                self.ttft.observe(req.first_token_at - req.arrival)
                self.queue.observe(max(req.admitted_at - req.ready_at, 0.0))
                prompt_s = req.first_token_at - req.admitted_at
                self.prompt_seconds += prompt_s
                self.bucket.prompt_tokens += req.prompt_len - req.cached
                self.bucket.prompt_ms += prompt_s * 1000.0
            else:
                self.itl.observe(req.last_token_at - req.prev_token_at)
        for req in res.finished:
            if not req.internal:
                self.on_release(req)
        self._throughput(res)

    def on_release(self, req: SimRequest) -> None:
        """A request left the engine (finished or aborted): the slot-release counters."""
        if req.first_token_at < 0:
            return
        self.e2e.observe(req.last_token_at - req.arrival)
        decode_s = req.last_token_at - req.first_token_at
        if req.generated > 1:
            self.tpot.observe(decode_s / (req.generated - 1))
        self.predicted_tokens += req.generated
        self.predicted_seconds += decode_s
        self.bucket.predicted_tokens += req.generated
        self.bucket.predicted_ms += decode_s * 1000.0
        self.n_tokens_max = max(self.n_tokens_max, req.prompt_len + req.generated)

    def _throughput(self, res: StepResult) -> None:
        # SGLang logs generation throughput over windows of decode steps; one second here.
        if self._window_start < 0:
            self._window_start = res.start
        self._window_tokens += len(res.emitted)
        span = res.end - self._window_start
        if span >= 1.0:
            self.gen_throughput = self._window_tokens / span
            self._window_tokens = 0
            self._window_start = res.end

    def take_bucket(self) -> RateBucket:
        """The llama.cpp rate bucket, reset: scrapes are destructive there."""
        bucket, self.bucket = self.bucket, RateBucket()
        return bucket
