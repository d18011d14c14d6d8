"""The shape policy's settings ([policy.shape] in the config), validated; apart so the policy compiles."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # Share of the slow-down a request imposes on the streams already running where it lands (its prefill
    # stalls their next token; each of its decode steps makes theirs slower) counted against that backend,
    # for the classes scored on e2e. Classes scored on TTFT are not: their own metric is one first token,
    # and the others' summed delay is on a different scale (it would push them onto slow-decoding engines).
    herd_weight: float = Field(1.0, ge=0)
    # Extra weight of a predicted queue wait: the least certain part of a prediction, and time a client
    # spends with no token at all.
    wait_weight: float = Field(1.0, ge=0)
    # Classes scored on TTFT (interactive sessions, long prompts) avoid backends predicted to stream slower
    # than this per token, unless every backend is: an early first token is worth little if the rest
    # crawls, and streaming faster than people read gains nothing.
    max_itl_s: float = Field(0.05, gt=0)
    # A backend taught by fewer samples is explored: it gets the next request (not a session) that expects
    # at most explore_max_output tokens (cheap to get wrong), at most explore_in_flight at once. Until it is
    # measured it keeps its optimistic prior.
    explore_samples: int = Field(2, ge=0)
    explore_in_flight: int = Field(1, ge=1)
    explore_max_output: int = Field(256, ge=0)
    # Slots of an interactive llama.cpp backend that other classes leave free for interactive sessions: at
    # least this many, and one per session seen within session_memory_s (a session's next turn needs its slot).
    reserve_interactive_slots: int = Field(1, ge=0)
    session_memory_s: float = Field(120.0, gt=0)
    # Above this KV usage a batch engine admits new requests only as others finish.
    kv_high: float = Field(0.95, gt=0, le=1)
    # An interactive llama.cpp backend whose slot count is unknown is assumed to have this many.
    assumed_slots: int = Field(1, ge=1)
    # Weight of the newest request in the running mean of the sizes routed to each backend (queue waits).
    size_alpha: float = Field(0.1, gt=0, le=1)
