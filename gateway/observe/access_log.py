"""The access log: one JSON line per request, batched off the request's path, written without blocking the loop."""

from __future__ import annotations

import logging
import os
import select
import sys
from typing import Callable, Final

import orjson

from gateway.contracts import Outcome, Record, RequestShape

MAX_PENDING_LINES: Final = 50_000  # lines held while stdout does not take them; the oldest go first
log = logging.getLogger("shapegate")


class AccessEntry(Record):
    """What a request's end leaves for its access-log line: made into JSON at the next flush (log_line)."""

    FIELDS = ("ts", "request_id", "principal", "shape", "backend", "reason", "status", "result", "outcome",
              "experiment", "arm", "route")
    __slots__ = FIELDS
    ts: Final[float]  # wall clock, seconds
    request_id: Final[str]
    principal: Final[str | None]  # the API key's id
    shape: Final[RequestShape | None]
    backend: Final[str]  # "" when no backend was tried
    reason: Final[str]  # the routing reason, "" when none
    status: Final[int]  # the status the client got
    result: Final[str]  # one of gateway.contracts.RESULTS
    outcome: Final[Outcome | None]  # the last attempt's
    experiment: Final[str | None]
    arm: Final[str | None]
    route: Final[str]  # the API route's name (gateway/apis/registry.py)

    def __init__(self, ts: float, request_id: str, principal: str | None, shape: RequestShape | None,
                 backend: str, reason: str, status: int, result: str, outcome: Outcome | None,
                 experiment: str | None, arm: str | None, route: str = "chat") -> None:
        self.ts = ts
        self.request_id = request_id
        self.principal = principal
        self.shape = shape
        self.backend = backend
        self.reason = reason
        self.status = status
        self.result = result
        self.outcome = outcome
        self.experiment = experiment
        self.arm = arm
        self.route = route


class AccessLog:
    """One JSON line per request, batched, and written to stdout without ever blocking the loop. A request
    leaves its fields as an AccessEntry; they become JSON at the next flush, off its path."""

    def __init__(self, enabled: bool, stream=None, on_drop: Callable[[int], None] | None = None) -> None:
        self.enabled = enabled
        self._stream = stream or sys.stdout
        self._entries: list[AccessEntry] = []  # one per request, not yet made into lines
        self._lines: list[bytes] = []
        self._rest = b""  # the unwritten tail of a partial write; goes out first
        self._fd: int | None = None
        self._was_blocking = True
        self._on_drop = on_drop

    def add(self, entry: AccessEntry) -> None:
        if self.enabled:
            self._entries.append(entry)
            if len(self._entries) >= 256:
                self.flush()

    def _fileno(self) -> int | None:
        if self._fd is None:
            try:
                self._fd = self._stream.fileno()
            except (AttributeError, OSError, ValueError):
                self._fd = -1  # an in-memory stream (tests)
            else:
                # A full pipe must not stall the loop: lines wait in memory and go out on a later flush.
                self._was_blocking = os.get_blocking(self._fd)
                os.set_blocking(self._fd, False)
        return self._fd if self._fd >= 0 else None

    def flush(self) -> None:
        if self._entries:
            self._lines += [orjson.dumps(log_line(e)) for e in self._entries]
            self._entries.clear()
        if not self._lines and not self._rest:
            return
        fd = self._fileno()
        if fd is None:
            self._stream.write(b"".join(x + b"\n" for x in self._lines).decode())
            self._stream.flush()
            self._lines.clear()
            return
        lines, i = self._lines, 0
        try:
            if self._rest:
                self._rest = self._rest[os.write(fd, self._rest):]
            while i < len(lines) and not self._rest:
                # Writes of up to PIPE_BUF bytes are atomic on a pipe: workers sharing stdout never split a line.
                j, size = i + 1, len(lines[i]) + 1
                while j < len(lines) and size + len(lines[j]) + 1 <= select.PIPE_BUF:
                    size += len(lines[j]) + 1
                    j += 1
                data = b"\n".join(lines[i:j]) + b"\n"
                self._rest = data[os.write(fd, data):]
                i = j
        except BlockingIOError:
            pass  # stdout is full: the rest waits for the next flush
        except OSError as e:
            log.error("access log disabled: stdout refused a write (%s)", e)
            self.enabled, self._rest, i = False, b"", len(lines)
        del lines[:i]
        if len(lines) > MAX_PENDING_LINES:
            dropped = len(lines) - MAX_PENDING_LINES
            del lines[:dropped]
            if self._on_drop is not None:
                self._on_drop(dropped)

    def close(self) -> None:
        """Last flush at shutdown: wait for stdout rather than lose the final lines; leave stdout as it was."""
        if self._entries or self._lines or self._rest:
            fd = self._fileno()
            if fd is not None:
                os.set_blocking(fd, True)
            self.flush()
        if self._fd is not None and self._fd >= 0:
            os.set_blocking(self._fd, self._was_blocking)


def log_line(e: AccessEntry) -> dict:
    """A request's access-log line from the fields its end left (AccessLog.add)."""
    # The values first, then the dict in one go: a literal builds it at its final size, each later store costs.
    shape, o, status = e.shape, e.outcome, e.status
    model = klass = stream = ttft = itl = e2e = n_prompt = n_completion = None
    if shape is not None:
        model, klass, stream = shape.model, shape.klass, shape.stream
    if o is not None:
        if status == 200 and not o.ok:
            status = o.status  # the stream had started (200 sent), then failed
        ttft, itl, e2e = _ms(o.ttft), _ms(o.itl), _ms(o.e2e)
        n_prompt, n_completion = o.prompt_tokens, o.completion_tokens
    return {"ts": _thousandths(e.ts), "request_id": e.request_id, "principal": e.principal, "route": e.route,
            "model": model,
            "class": klass, "backend": e.backend or None, "reason": e.reason or None, "status": status,
            "outcome": e.result, "stream": stream, "ttft_ms": ttft, "itl_ms": itl, "e2e_ms": e2e,
            "prompt_tokens": n_prompt, "completion_tokens": n_completion, "experiment": e.experiment, "arm": e.arm}


def _ms(v: float | None) -> float | None:
    return None if v is None else _thousandths(v * 1000)


def _thousandths(v: float) -> float:
    """v to 3 decimals, as round(v, 3) has it but for a rare last digit at a tie. round() formats the number as
    text and parses it back: each call costs nearly what orjson takes for the whole line (a log's times are
    never negative)."""
    return int(v * 1000 + 0.5) / 1000
