"""What the gateway does when every backend for a request is saturated: [admission] (when a backend counts as
saturated beyond its seats, and what a refusal looks like) and [queue] (where requests wait instead)."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, field_validator, model_validator

from gateway.config_base import CLASS_NAMES, Strict

# Priorities, first served first. A name, not a number: a key's or a header's value reads the same everywhere.
Priority = Literal["high", "normal", "low"]
PRIORITIES: Final = ("high", "normal", "low")
LEVEL: Final = {name: i for i, name in enumerate(PRIORITIES)}  # 0 first
# Interactive turns first, long outputs last: a short wait costs a long generation little of its time.
CLASS_PRIORITY: Final[dict[str, Priority]] = {
    "interactive": "high", "long_prompt": "normal", "default": "normal", "long_output": "low"}


def _known_classes(names) -> None:
    for name in names:
        if name not in CLASS_NAMES:
            raise ValueError(f"unknown class {name!r}; expected one of {', '.join(CLASS_NAMES)}")


class AdmissionConfig(Strict):
    """When a backend counts as saturated besides its seats, and how a request is refused when none can take it:
    at once with [queue] enabled = false, after waiting in the queue otherwise."""

    max_waiting: float | None = Field(None, ge=0)
    max_in_flight: int | None = Field(None, ge=1)
    slot_classes: tuple[str, ...] = ()
    status: Literal[429, 503] = 503
    retry_after_s: int = Field(1, ge=1, le=120)

    @field_validator("slot_classes")
    @classmethod
    def _known_slot_classes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        _known_classes(v)
        return v


class QueueConfig(Strict):
    """[queue]: requests wait in the gateway, in priority order and fairly across keys, while every backend that
    could serve them is saturated, instead of in an engine's first-come queue."""

    # On by default: it needs no configuration (seat counts come from llama.cpp's slots and what an engine is seen
    # running; a seat share is taken of an assumed count until then). Off: [admission] refuses at once, nothing waits.
    enabled: bool = True
    max_length: int = Field(1024, ge=1)  # requests waiting in this process; past it, refused at once
    # The longest a request waits for a seat (as long as the first byte of an engine's reply is waited for).
    max_wait_s: float = Field(120.0, gt=0)
    # A request that has waited this long goes before every request that has not (in the queue's order among those
    # that have), within its class's seat share: higher priorities cannot take every seat that frees while it waits
    # out max_wait_s.
    promote_after_s: float = Field(60.0, gt=0)
    # The share of a backend's seats a class may hold while requests of other classes for the same model came in
    # within reserve_window_s: the rest stay free for them (long outputs cannot take every seat).
    seat_shares: dict[str, float] = Field(default_factory=lambda: {"long_output": 0.5})
    reserve_window_s: float = Field(30.0, ge=0)
    # A request's priority when neither its key nor an allowed header sets one.
    class_priority: dict[str, Priority] = Field(default_factory=lambda: dict(CLASS_PRIORITY))
    # Within a priority and a key, the sooner a request's target for its first token ends, the sooner it goes.
    ttft_target_s: dict[str, float] = Field(default_factory=lambda: {
        "interactive": 0.5, "long_prompt": 2.0, "default": 1.0, "long_output": 5.0})
    # Weighted fair share across keys within a priority (by key id; unnamed keys weigh 1).
    key_weights: dict[str, float] = Field(default_factory=dict)
    max_deadline_ms: int = Field(3_600_000, ge=1)  # the largest x-shapegate-deadline-ms a client may send

    @field_validator("seat_shares")
    @classmethod
    def _shares(cls, v: dict[str, float]) -> dict[str, float]:
        _known_classes(v)
        for name, share in v.items():
            if not 0 < share <= 1:
                raise ValueError(f"the seat share of {name!r} must be greater than 0 and at most 1")
        return v

    @field_validator("class_priority", "ttft_target_s")
    @classmethod
    def _classes(cls, v: dict) -> dict:
        _known_classes(v)
        return v

    @field_validator("key_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        for key_id, w in v.items():
            if not 0 < w <= 1000:
                raise ValueError(f"the weight of key {key_id!r} must be greater than 0 and at most 1000")
        return v

    @model_validator(mode="after")
    def _targets_positive(self) -> "QueueConfig":
        for name, s in self.ttft_target_s.items():
            if not s > 0:
                raise ValueError(f"ttft_target_s: the target of {name!r} must be greater than 0")
        return self


class QueueSettings:
    """What the queue reads of one configuration, as plain attributes (made once per configuration)."""

    def __init__(self, cfg: QueueConfig, admission: AdmissionConfig, keep_interactive: int = 1) -> None:
        self.max_length = cfg.max_length
        self.max_wait_s = cfg.max_wait_s
        self.promote_after_s = cfg.promote_after_s
        self.shares = dict(cfg.seat_shares)
        self.reserve_window_s = cfg.reserve_window_s
        self.class_level = {k: LEVEL[p] for k, p in cfg.class_priority.items()}
        self.ttft_target_s = dict(cfg.ttft_target_s)
        self.key_weights = dict(cfg.key_weights)
        self.max_deadline_ms = cfg.max_deadline_ms
        self.admission = admission
        self.admission_on = admission.max_waiting is not None or admission.max_in_flight is not None or \
            bool(admission.slot_classes)  # (gateway/routing/admission.py's enabled(), read once)
        self.status, self.retry_after_s = admission.status, admission.retry_after_s
        # Seats of a backend marked interactive that other classes leave free even before any session was seen (the
        # shape policy's reserve_interactive_slots): the first turn of a session finds one.
        self.keep_interactive = keep_interactive
