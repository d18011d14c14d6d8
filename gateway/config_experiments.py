"""The configuration of A/B experiments ([[experiments]]) and of the support probe ([probe])."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.config_base import Strict

# An arm's weight: its share is weight / the arms' total. Weights are relative, so a bound costs nothing (a
# 0.0001 % canary is 1 against 1e6) and keeps the total finite: weights summing past a float's range would
# make every share 0.
MAX_WEIGHT = 1e6


def weight_problem(name: str, w: object) -> str | None:
    """Why `w` cannot be the weight of arm `name` (None: it can): a number, 0 to MAX_WEIGHT."""
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= MAX_WEIGHT:
        return f"the weight of {name!r} must be a number from 0 to {MAX_WEIGHT:g}"
    return None


class ArmConfig(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    backends: tuple[str, ...] = Field(min_length=1)
    weight: float = Field(1.0, ge=0, le=MAX_WEIGHT)


class ExperimentConfig(Strict):
    """Arms of one public model's backends compared on live traffic (see gateway/experiments/experiment.py)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    model: str = Field(min_length=1)
    # split: the subject's arm serves it. shadow: the model is served as usual (by its backends in no shadow
    # arm) and a copy of a `fraction` of its requests goes to the subject's arm, off the client's path.
    mode: Literal["split", "shadow"] = "split"
    # What keeps one client on one arm: its API key, its session, the body's `user`, or `header:<name>`.
    subject: str = "key"
    arms: tuple[ArmConfig, ...] = Field(min_length=1)
    fraction: float = Field(1.0, ge=0, le=1)
    shadow_max_in_flight: int = Field(4, ge=1)  # copies in flight per shadow arm; more are skipped
    # The smallest difference that matters (0.05: 5 %): a verdict calls a smaller one no difference however
    # certain it is. Two engine processes set up alike differ by a few % with nothing changed, which the noise
    # measured inside one arm cannot see.
    practical_margin: float = Field(0.05, ge=0, lt=1)
    # A split arm whose engine error rate over its recent requests exceeds another serving arm's by this much
    # (0.05: 5 points, and beyond chance) is stopped, once both have error_guard_min_requests; 1 turns it off.
    error_guard_margin: float = Field(0.05, gt=0, le=1)
    error_guard_min_requests: int = Field(50, ge=10)
    enabled: bool = True

    @field_validator("subject")
    @classmethod
    def _known_subject(cls, v: str) -> str:
        if v in ("key", "session", "user"):
            return v
        name = v.removeprefix("header:").strip().lower()
        if not v.startswith("header:") or not name or any(c.isspace() or c == ":" for c in name):
            raise ValueError("expected `key`, `session`, `user` or `header:<header name>`")
        return f"header:{name}"

    @model_validator(mode="after")
    def _arms(self) -> "ExperimentConfig":
        names = [a.name for a in self.arms]
        if len(names) != len(set(names)):
            raise ValueError("arm names must be unique within an experiment")
        seen: dict[str, str] = {}
        for a in self.arms:
            for b in a.backends:
                if b in seen:
                    raise ValueError(f"backend {b!r} is in two arms ({seen[b]!r} and {a.name!r}): "
                                     "arms must not share a backend")
                seen[b] = a.name
        if not any(a.weight > 0 for a in self.arms):
            raise ValueError("at least one arm needs a weight greater than 0")
        if self.mode == "split" and len(self.arms) < 2:
            raise ValueError("a split experiment needs two or more arms")
        if self.mode == "shadow" and self.fraction <= 0:
            raise ValueError("a shadow experiment needs a fraction greater than 0")
        return self


# What the support probe (gateway/fleet/probe_apis.py, probe_checks.py) tries on each backend, in this order:
# whether the engine answers, one check per API the gateway serves, then features of chat.
PROBE_APIS = ("chat", "completions", "embeddings", "responses", "response_store", "messages", "rerank", "score",
              "transcriptions", "translations", "conversations")
PROBE_FEATURES = ("stream", "stream_usage", "n", "tools", "json_schema", "logprobs", "context")
PROBE_CHECKS = ("answers", *PROBE_APIS, *PROBE_FEATURES)


class ProbeConfig(Strict):
    # Run the support probe (gateway/fleet/probe.py) when a backend becomes ready, and stop routing a model to a
    # backend that fails one of the `require`d checks for it.
    at_start: bool = False
    timeout_s: float = Field(20.0, gt=0)  # each check as a whole (its requests together)
    # Checks of one backend that run at once: an engine on a CPU has few slots, and clients share them.
    concurrency: int = Field(2, ge=1, le=16)
    require: tuple[str, ...] = ("chat",)

    @field_validator("require")
    @classmethod
    def _known_checks(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            if name not in PROBE_CHECKS:
                raise ValueError(f"unknown check {name!r}; expected some of {', '.join(PROBE_CHECKS)}")
        return v
