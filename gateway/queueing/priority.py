"""A request's place in the queue: its priority (an allowed header, else its key's, else its class's default) and its
client's deadline, both read from its headers and checked (a bad value is a 400 in the API's shape)."""

from __future__ import annotations

from typing import Final, Mapping

from gateway.config_queue import LEVEL, PRIORITIES
from gateway.errors import GatewayError, bad_request

PRIORITY_HEADER: Final = "x-shapegate-priority"
DEADLINE_HEADER: Final = "x-shapegate-deadline-ms"
NORMAL: Final = LEVEL["normal"]


def level_of(headers: Mapping[str, str], key_priority: str | None, header_allowed: bool,
             class_level: Mapping[str, int], klass: str) -> int:
    """The priority level a request waits at. The header counts only for keys an admin allowed it (for others it
    is ignored: a client cannot put itself first)."""
    if header_allowed:
        value = headers.get(PRIORITY_HEADER)
        if value is not None:
            level = LEVEL.get(value.strip().lower())
            if level is None:
                raise bad_request(f"Invalid {PRIORITY_HEADER} header: expected one of {', '.join(PRIORITIES)}.",
                                  param=PRIORITY_HEADER, code="invalid_priority")
            return level
    if key_priority is not None:
        return LEVEL[key_priority]
    return class_level.get(klass, NORMAL)


def deadline_of(headers: Mapping[str, str], max_ms: int) -> float | None:
    """The client's deadline for its first byte, in seconds from its arrival; None when it sent none."""
    value = headers.get(DEADLINE_HEADER)
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 10 or not 1 <= int(text) <= max_ms:
        raise bad_request(f"Invalid {DEADLINE_HEADER} header: expected whole milliseconds from 1 to {max_ms}.",
                          param=DEADLINE_HEADER, code="invalid_deadline")
    return int(text) / 1000.0


def deadline_missed(model: str, deadline_s: float, waited_s: float) -> GatewayError:
    """A request whose client's deadline can no longer be met: refused rather than sent to be served too late."""
    return GatewayError(504, f"The request's deadline ({DEADLINE_HEADER}: {deadline_s * 1000:.0f}) cannot be met: "
                        f"every backend for `{model}` is saturated and it waited {waited_s:.2f} s; it was not sent "
                        f"to an engine.", code="deadline_exceeded")
