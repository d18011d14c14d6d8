"""Whether a request fits a backend's context window: the prompt estimate, its learned error per model, the window."""

from __future__ import annotations

import math
from typing import Final

from gateway.contracts import RequestShape
from gateway.errors import CONTEXT_REFUSALS, GatewayError, no_backend

# The prompt estimate has no tokenizer (about four characters a token), so the true count may be higher or
# lower. Per model the gateway keeps a high and a low bound of true/estimated, learned from engines' usage
# figures: a request is sent where it fits even at the high bound, and refused outright only when it does
# not fit the largest window even at the low bound.
START_HIGH: Final = 1.3
START_LOW: Final = 0.5
FLOOR_HIGH: Final = 1.0  # the bounds never cross the estimate itself
CEIL_LOW: Final = 1.0
MARGIN: Final = 1.05  # a bound sits this far past the ratio that moved it
EASE: Final = 0.05  # how fast a bound drifts back towards recent ratios (it jumps at once towards a worse one)


class PromptSizer:
    """Per public model: how far the prompt estimate is off, from the prompt sizes engines report."""

    __slots__ = ("_high", "_low")

    def __init__(self) -> None:
        self._high: dict[str, float] = {}
        self._low: dict[str, float] = {}

    def bounds(self, model: str) -> tuple[float, float]:
        return self._low.get(model, START_LOW), self._high.get(model, START_HIGH)

    def observe(self, model: str, estimated: int, actual: int) -> None:
        """An engine counted `actual` prompt tokens where the gateway estimated `estimated`."""
        if estimated <= 0 or actual <= 0:
            return
        r = actual / estimated
        low, high = self.bounds(model)
        up, down = r * MARGIN, r / MARGIN
        self._high[model] = max(FLOOR_HIGH, up if up > high else high + (up - high) * EASE)
        self._low[model] = min(CEIL_LOW, down if down < low else low + (down - low) * EASE)

    def at_least(self, model: str, estimated: int, tokens: int) -> None:
        """The prompt was longer than `tokens` (an engine refused it and did not say by how much)."""
        if estimated > 0 and tokens > 0:
            low, high = self.bounds(model)
            self._high[model] = max(high, tokens / estimated * MARGIN)

    def need(self, shape: RequestShape) -> tuple[int, int]:
        """(tokens the request may need at most: the prompt at the high bound plus the output the client asked
        for, none asked meaning the engine fills what is left; tokens its prompt needs at least). The prompt is
        what must fit at once (`fit_tokens`: a rerank's largest query-document pair)."""
        low, high = self.bounds(shape.model)
        n = shape.fit_tokens
        return math.ceil(n * high) + (shape.max_output or 0), math.floor(n * low)

    def learn_refusal(self, shape: RequestShape, err: GatewayError, window: int) -> None:
        """An engine with `window` tokens refused the request as too long: learn what it says of the prompt."""
        n, exact = prompt_tokens_of(err)
        if n is not None and exact:
            self.observe(shape.model, shape.fit_tokens, n)
        else:
            self.at_least(shape.model, shape.fit_tokens, max(n or 0, window - (shape.max_output or 0)))


def prompt_tokens_of(err: GatewayError) -> tuple[int | None, bool]:
    """The prompt size an engine's context error reports, and whether it is exact (vLLM 0.32 stops counting at
    the limit, so its figure is a lower bound)."""
    n = err.extra.get("n_prompt_tokens")  # llama.cpp
    if isinstance(n, int) and n > 0:
        return n, True
    for wording in CONTEXT_REFUSALS:  # how each engine words the prompt's size, if it does
        size = wording.size
        if size is not None:
            m = size.search(err.message)
            if m:
                return int(m.group(1)), wording.exact
    return None, False


def fitting(pool, sizer: PromptSizer, shape: RequestShape, candidates: list, now: float) -> list:
    """The candidates whose context window holds the request (an unknown window holds anything). None does:
    a 400 at once when even the smallest likely prompt exceeds every window of the model, a 503 when only a
    backend not usable now could hold it, else the candidates with the largest window (the estimate may be
    too high: their engine judges)."""
    high, low = sizer.need(shape)
    windows = [b.window(shape.model) for b in candidates]
    fit = [b for b, w in zip(candidates, windows) if w is None or high <= w]
    if fit:
        return fit
    largest = max(windows)
    everywhere = pool.largest_window(shape.model)
    if everywhere is not None and low >= everywhere:
        raise too_long(high, everywhere)
    if everywhere is not None and low >= largest:
        raise no_backend(shape.model, pool.retry_hint(shape.model, now))
    return [b for b, w in zip(candidates, windows) if w == largest]


def too_long(need: int, largest: int) -> GatewayError:
    """OpenAI's answer to a request no backend can hold."""
    return GatewayError(400, f"This model's maximum context length is {largest} tokens. However, your request "
                             f"needs about {need} tokens. Please reduce the length of the messages or the "
                             f"completion.", param="messages", code="context_length_exceeded")
