"""prefix_affinity: stick to the backend that served the prompt's prefix (or the session) unless it is overloaded."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from gateway.contracts import BackendView, Decision, RouteInput


class Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # SGLang's cache-aware router defaults: follow the cache when at least this share of the prompt is cached...
    cache_threshold: float = Field(0.3, ge=0, le=1)
    # ...unless the load is imbalanced: more than balance_abs requests above the least loaded AND
    # more than balance_rel times its load.
    balance_abs: float = Field(64, ge=0)
    balance_rel: float = Field(1.5, ge=1)


def load_of(b: BackendView) -> float:
    """Requests on the backend: ours in flight, or the engine's own count when it reports more (other clients)."""
    n = float(b.in_flight)
    if b.load is not None and b.load.running is not None:
        n = max(n, b.load.running + (b.load.waiting or 0.0))
    return n / b.weight


def overloaded(load: float, least: float, p: Params) -> bool:
    return load - least > p.balance_abs and load > p.balance_rel * least


def sticky_choice(inp: RouteInput, p: Params) -> tuple[BackendView | None, str]:
    """The affinity backend if the request should stick to it, with a short reason either way."""
    aff = inp.affinity
    if aff is None:
        return None, "no affinity"
    target = next((b for b in inp.candidates if b.id == aff), None)
    if target is None:
        return None, f"{aff} unavailable"
    shape = inp.shape
    session = shape.session_id is not None
    ratio = inp.affinity_tokens / max(shape.prompt_tokens, 1)
    if not session and ratio < p.cache_threshold:
        return None, f"match {ratio:.0%} < {p.cache_threshold:.0%}"
    lightest = min(inp.candidates, key=load_of)
    least = load_of(lightest)
    mine = load_of(target)
    if overloaded(mine, least, p):
        return None, f"{aff} overloaded {mine:g} vs {lightest.id}={least:g}"
    return target, ("session" if session else f"prefix {ratio:.0%}")


class PrefixAffinity:
    name = "prefix_affinity"
    needs_prefix = True

    def __init__(self, params: Params) -> None:
        self.p = params
        self._turn = 0

    def rank(self, inp: RouteInput) -> Decision:
        c = inp.candidates
        # Rotate before the stable sort so that equal loads spread instead of piling on the first backend.
        self._turn += 1
        i = self._turn % len(c)
        ranked = sorted(c[i:] + c[:i], key=load_of)
        target, why = sticky_choice(inp, self.p)
        if target is not None:
            ranked.remove(target)
            ranked.insert(0, target)
            return Decision(tuple(ranked), f"prefix_affinity:{why} -> {target.id}")
        return Decision(tuple(ranked), f"prefix_affinity:least_loaded ({why})")

