"""The engines' own latency figures from their /metrics: a cold-start prior and a check on the gateway's fit."""

from __future__ import annotations

from gateway.contracts import LoadSample

ALPHA = 0.3  # weight of the newest interval in the running means (a scrape interval holds few requests)


def _interval_mean(total: float | None, count: float | None, prev: LoadSample | None, field: str) -> float | None:
    """The mean of what the engine observed since the previous sample (histogram _sum over _count); over its
    whole life for the first sample or after a restart (totals that went backwards)."""
    if total is None or count is None:
        return None
    p_total = getattr(prev, field + "_sum") if prev is not None else None
    p_count = getattr(prev, field + "_count") if prev is not None else None
    if p_total is None or p_count is None or count < p_count or total < p_total:
        return total / count if count > 0 else None
    n = count - p_count
    return (total - p_total) / n if n > 0 else None


class EngineLatency:
    """Running means of one engine's own TTFT, inter-token latency and prefill rate, as it reports them."""

    __slots__ = ("ttft", "itl", "prefill_rate", "_prev")

    def __init__(self) -> None:
        self.ttft: float | None = None  # seconds
        self.itl: float | None = None  # seconds per output token
        self.prefill_rate: float | None = None  # prompt tokens per second (llama.cpp says so)
        self._prev: LoadSample | None = None

    def observe(self, s: LoadSample) -> bool:
        """Fold one load sample in; True when a figure changed."""
        ttft = _interval_mean(s.ttft_sum, s.ttft_count, self._prev, "ttft")
        itl = _interval_mean(s.itl_sum, s.itl_count, self._prev, "itl")
        if s.predicted_tps:  # llama.cpp: generation throughput of a slot, 0 while idle
            itl = 1.0 / s.predicted_tps
        self._prev = s
        changed = False
        if ttft is not None and ttft > 0:
            self.ttft, changed = _fold(self.ttft, ttft), True
        if itl is not None and itl > 0:
            self.itl, changed = _fold(self.itl, itl), True
        if s.prompt_tps:
            self.prefill_rate, changed = _fold(self.prefill_rate, s.prompt_tps), True
        return changed


def _fold(mean: float | None, value: float) -> float:
    return value if mean is None else mean + ALPHA * (value - mean)
