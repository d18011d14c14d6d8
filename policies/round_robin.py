"""round_robin: each request starts one step further along the candidate list."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from gateway.contracts import Decision, RouteInput


class Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RoundRobin:
    name = "round_robin"

    def __init__(self, params: Params) -> None:
        self._next = 0

    def rank(self, inp: RouteInput) -> Decision:
        c = inp.candidates
        if len(c) == 1:
            return Decision(c, "round_robin")
        i = self._next % len(c)
        self._next += 1
        return Decision(c[i:] + c[:i], "round_robin")

