"""Grammars of the header values the gateway forwards or reflects: request ids, W3C trace context, engine headers."""

from __future__ import annotations

import re
from typing import Final, Mapping

# A request id the gateway accepts from a client: a conservative character set (ids, UUIDs, base64) and length,
# so it can be reflected in a reply head, forwarded to an engine and logged without quoting.
REQUEST_ID_MAX: Final = 200
_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9._:/+=@-]{1,%d}" % REQUEST_ID_MAX)

# W3C Trace Context (https://www.w3.org/TR/trace-context/): version 00 is exactly 55 characters; a later version
# may append fields after a dash, which a version-00 reader ignores but still forwards.
_TRACEPARENT: Final = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[\x21-\x7e]*)?")
_TRACESTATE_KEY: Final = r"(?:[a-z][a-z0-9_*/-]{0,255}|[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13})"
_TRACESTATE_VALUE: Final = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_TRACESTATE_MEMBER: Final = re.compile(f"{_TRACESTATE_KEY}={_TRACESTATE_VALUE}")
TRACESTATE_MAX_MEMBERS: Final = 32
TRACESTATE_MAX_LEN: Final = 512

_TOKEN: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def valid_request_id(value: str | None) -> str | None:
    """The client's request id if it keeps to the safe grammar, else None (the gateway makes its own)."""
    if value and _REQUEST_ID.fullmatch(value):
        return value
    return None


def valid_traceparent(value: str) -> bool:
    m = _TRACEPARENT.fullmatch(value)
    if m is None:
        return False
    version, trace_id, parent_id, _, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return False
    return trace_id != "0" * 32 and parent_id != "0" * 16


def valid_tracestate(value: str) -> bool:
    if len(value) > TRACESTATE_MAX_LEN:
        return False
    members = [m.strip(" \t") for m in value.split(",")]
    keys = [m.partition("=")[0] for m in members if m]
    if len(keys) > TRACESTATE_MAX_MEMBERS or len(keys) != len(set(keys)):
        return False
    return all(_TRACESTATE_MEMBER.fullmatch(m) for m in members if m)


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's trace context, forwarded only when valid; tracestate only beside a valid traceparent."""
    parent = headers.get("traceparent")
    if parent is None or not valid_traceparent(parent):
        return {}
    out = {"traceparent": parent}
    state = headers.get("tracestate")
    if state is not None and valid_tracestate(state):
        out["tracestate"] = state
    return out


PASSED_VALUE_LIMIT = 1024  # a client header passed on by name (an API version, a form's content type)


def forwarded_headers(headers: Mapping[str, str], names: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """The client's headers that go on to the engine: a valid trace context, and the named ones (lower-case name,
    name sent) whose values are printable and short; any other value is dropped, never passed on."""
    out = trace_headers(headers)
    for name, sent in names:
        v = headers.get(name)
        if v is not None and len(v) <= PASSED_VALUE_LIMIT and safe_value(v):
            out[sent] = v
    return out


def safe_value(value: str) -> bool:
    """A header value that can be written into a head as it is: no CR, LF, NUL or other control character
    (nor a tab: legal, but no engine header the gateway passes on needs one)."""
    return value.isprintable()


def safe_name(name: str) -> bool:
    return _TOKEN.fullmatch(name) is not None
