"""Relay of a typed event stream (Responses, Anthropic Messages): `event:` lines, its own usage and ending, no [DONE].

The chat relay's framing, bounds and write path (SSERelay) with the API's own rules (gateway/apis/api.py's
StreamRules) for what a token is, which events say something, and what error event a failure sends. Ordinary token
events pass unparsed; only the few events that carry an id, usage, an ending or an error are parsed, and shown to
the stream's Watcher (a stream whose state the gateway keeps has its Response object rewritten in the events that
carry it, and is recorded before its final event goes out)."""

from __future__ import annotations

from time import perf_counter
from typing import Any, Final, Protocol

import orjson

from gateway.apis.api import StreamRules
from gateway.apis.messages import error_of
from gateway.errors import GatewayError
from gateway.routing.relay import ModelRewrite, SSERelay, StreamMeter

FIRST_ERROR_STARTS: Final[tuple[bytes, ...]] = (b"event: error", b"event:error", b'data: {"type":"error"',
                                                b'data: {"error"', b'data:{"error"')


class Watcher(Protocol):
    """What follows a stream's special events beyond the meter: the id of a response an engine keeps
    (gateway/state/engine_index.py's IdSink), or the state the gateway keeps (gateway/state/turns.py's Turn)."""

    @property
    def marks(self) -> tuple[bytes, ...]:
        """Marks of more events to parse than the API's own special ones."""

    @property
    def holds(self) -> tuple[bytes, ...]:
        """Marks of events that wait for end() before they go out."""

    @property
    def renamed(self) -> tuple[bytes, bytes] | None:
        """(the engine's id, the gateway's): replaced wherever it appears."""

    def on_event(self, obj: dict[str, Any]) -> bool:
        """A parsed special event; True when it changed obj (the event then goes out as obj)."""

    async def end(self) -> None:
        """The stream's last event is about to go out."""


def first_event_error(first: bytes) -> GatewayError | None:
    """The error a typed stream opens with (an engine that validated after opening it), or None when none."""
    if not first.startswith(FIRST_ERROR_STARTS):
        return None
    ev = first.split(b"\n\n", 1)[0]
    i = ev.find(b"data:")
    try:
        payload = orjson.loads(ev[i + 5:]) if i >= 0 else None
    except orjson.JSONDecodeError:
        payload = None
    if not isinstance(payload, dict):
        return GatewayError(502, "The upstream engine began its stream with a malformed error event.",
                            code="upstream_error")
    return error_of(payload)


class TypedRelay(SSERelay):
    """SSERelay for a typed stream, with a Watcher of its special events when one is given."""

    __slots__ = ("rules", "last", "watcher", "marks", "holds")

    def __init__(self, resp, meter: StreamMeter, rules: StreamRules, rename: ModelRewrite,
                 max_event: int = 1 << 20, watcher: Watcher | None = None) -> None:
        super().__init__(resp, meter, strip_usage=False, rename=rename, max_event=max_event)
        self.rules = rules
        self.last = b""  # the last block passed on (a failure's event is numbered after it)
        self.watcher = watcher
        self.marks = rules.special if watcher is None else tuple(dict.fromkeys((*rules.special, *watcher.marks)))
        self.holds = () if watcher is None else watcher.holds

    def take(self, chunk: bytes) -> bool:
        for mark in self.holds:
            if chunk.find(mark) >= 0:
                return False  # an event that waits for the watcher's end(): feed() takes it
        return super().take(chunk)

    async def before_end(self) -> None:
        if self.watcher is not None:
            await self.watcher.end()

    def _renamed(self, block: bytes) -> bytes:
        pair = self.watcher.renamed if self.watcher is not None else None
        if pair is not None and block.find(pair[0]) >= 0:
            block = block.replace(pair[0], pair[1])
        return self.rename(block)

    def _events(self, block: bytes) -> bytes:
        m = self.meter
        now = perf_counter()
        if m.saw_done:
            return b""
        self.last = block
        rules = self.rules
        tokens = block.count(rules.token_mark)
        if tokens:
            if m.t_first is None:
                m.t_first = now
            m.t_last = now
            m.token_events += tokens
        starts: list[int] | None = None
        for mark in self.marks:
            i = block.find(mark)
            while i >= 0:  # the event holding it: from after the blank line before it (few per stream)
                before = block.rfind(b"\n\n", 0, i)
                start = before + 2 if before >= 0 else 0
                if starts is None:
                    starts = [start]
                elif start not in starts:
                    starts.append(start)
                i = block.find(mark, i + len(mark))
        if starts is None:
            return self._renamed(block)  # token events only: passed as they came
        starts.sort()  # (in stream order: the id before the ending)
        out: list[bytes] = []
        at = 0
        for start in starts:
            end = block.find(b"\n\n", start)
            end = end if end >= 0 else len(block)
            new = self._special(block[start:end])
            if new is not None:
                out += (block[at:start], new)
                at = end
        if out:
            out.append(block[at:])
            block = b"".join(out)
        return self._renamed(block)

    def _special(self, ev: bytes) -> bytes | None:
        """Note what an event says; its new bytes when the event was rewritten (else None: it goes as it came)."""
        i = ev.find(b"data:")
        if i < 0:
            return None
        try:
            obj = orjson.loads(ev[i + 5:])
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        self.rules.note(obj, self.meter)
        if self.watcher is None or not self.watcher.on_event(obj):
            return None
        return ev[:i] + b"data: " + orjson.dumps(obj)

    async def finish(self) -> None:
        """End of the engine's body: a trailing event flushed, and a stream that did not end properly gets the
        API's error event (the client's SDK raises it rather than waiting)."""
        m = self.meter
        rest = b"".join(self._parts)
        self._parts.clear()
        tail = self._events(rest + b"\n\n") if rest.strip() and not m.saw_done else b""
        if not m.saw_done and m.error is None:
            m.error = GatewayError(502, "The upstream engine ended the stream early.", code="upstream_truncated")
            tail += self.rules.error_event(m.error, self.last)
        await self.before_end()
        await self.resp.write_eof(tail)

    async def fail(self, err: GatewayError) -> None:
        self.meter.error = err
        await self.resp.write_eof(self.rules.error_event(err, self.last))
