"""least_loaded: fewest in-flight requests per unit of weight, engine queue as the tie-breaker."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from gateway.contracts import BackendView, Decision, RouteInput


class Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def load_of(b: BackendView) -> float:
    return b.in_flight / b.weight


class LeastLoaded:
    name = "least_loaded"

    def __init__(self, params: Params) -> None:
        self._turn = 0

    def rank(self, inp: RouteInput) -> Decision:
        c = inp.candidates
        if len(c) == 1:  # nothing to compare (a model on one backend)
            return Decision(c, f"least_loaded in_flight={c[0].in_flight}")
        # Rotate first so that equal loads spread instead of always landing on the first backend.
        self._turn += 1
        i = self._turn % len(c)
        rotated = c[i:] + c[:i]
        ranked = sorted(rotated, key=lambda b: (load_of(b), (b.load.waiting or 0.0) if b.load else 0.0))
        best = ranked[0]
        return Decision(tuple(ranked), f"least_loaded in_flight={best.in_flight}")

