"""Relay of a typed event stream (Responses, Anthropic Messages): `event:` lines, its own usage and ending, no [DONE].

The chat relay's framing, bounds and write path (SSERelay) with the API's own rules for what a token is, where the
usage is, how the stream ends and what error event a failure sends. Ordinary token events pass unparsed; only the
few events that carry an id, usage, an ending or an error are parsed."""

from __future__ import annotations

from time import perf_counter
from typing import Any, Callable, Final

import orjson

from gateway.apis import messages, responses
from gateway.errors import GatewayError, error_from_event
from gateway.routing.relay import ModelRewrite, SSERelay, StreamMeter


class TypedRules:
    """One API's stream: the mark of a token event, the marks of events worth parsing, its error event."""

    __slots__ = ("api", "token_mark", "special", "error_event")

    def __init__(self, api: str, token_mark: bytes, special: tuple[bytes, ...],
                 error_event: Callable[[GatewayError, bytes], bytes]) -> None:
        self.api = api
        self.token_mark = token_mark
        self.special = special
        self.error_event = error_event


RULES: Final[dict[str, TypedRules]] = {
    "responses": TypedRules("responses", responses.TOKEN_MARK, responses.SPECIAL, responses.error_event),
    "messages": TypedRules("messages", messages.TOKEN_MARK, messages.SPECIAL, messages.error_event),
}
RULES["response"] = RULES["responses"]  # a stored response's GET with ?stream=true replays its events
FIRST_ERROR_STARTS: Final[tuple[bytes, ...]] = (b"event: error", b"event:error", b'data: {"type":"error"', b'data: {"error"',
                             b'data:{"error"')


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
    return _error_of(payload)


def _error_of(obj: dict[str, Any]) -> GatewayError:
    """An error event of either API (Anthropic's {"error": {type, message}}, the Responses API's flat one)."""
    err = obj.get("error")
    if isinstance(err, dict):
        kind = err.get("type")
        status = 529 if kind == "overloaded_error" else 400 if kind == "invalid_request_error" else 500
        e = error_from_event({"error": {**err, "code": err.get("code", status)}})
        return e
    message = obj.get("message") if isinstance(obj.get("message"), str) else "The engine reported an error."
    code = obj.get("code") if isinstance(obj.get("code"), str) else "server_error"
    return GatewayError(500, str(message), code=code)


class TypedRelay(SSERelay):
    """SSERelay for a typed stream; `on_id` gets the id of the response the stream makes (Responses API)."""

    __slots__ = ("rules", "on_id", "last")

    def __init__(self, resp, meter: StreamMeter, rules: TypedRules, rename: ModelRewrite,
                 max_event: int = 1 << 20, on_id: Callable[[str], None] | None = None) -> None:
        super().__init__(resp, meter, strip_usage=False, rename=rename, max_event=max_event)
        self.rules = rules
        self.on_id = on_id
        self.last = b""  # the last block passed on (a failure's event is numbered after it)

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
        for mark in rules.special:
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
            return self.rename(block)  # token events only: passed as they came
        starts.sort()  # (in stream order: the id before the ending)
        for start in starts:
            end = block.find(b"\n\n", start)
            self._special(block[start:end if end >= 0 else len(block)])
        return self.rename(block)

    def _special(self, ev: bytes) -> None:
        i = ev.find(b"data:")
        if i < 0:
            return
        try:
            obj = orjson.loads(ev[i + 5:])
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        kind = obj.get("type")
        m = self.meter
        if self.rules.api == "responses":
            resp = obj.get("response")
            resp = resp if isinstance(resp, dict) else {}
            if kind == "response.created" and self.on_id is not None:
                rid = responses.id_of(resp)
                if rid is not None:
                    self.on_id(rid)
            elif kind in ("response.completed", "response.incomplete"):
                m.usage = responses.usage(resp) or m.usage
                m.saw_finish = m.saw_done = True
            elif kind == "response.failed":
                err = resp.get("error")
                msg = err.get("message") if isinstance(err, dict) else None
                m.error = GatewayError(502, f"The upstream engine failed: {msg or 'response.failed'}.",
                                       code="upstream_error")
                m.saw_done = True
            elif kind == "error":
                m.error = _error_of(obj)
                m.saw_done = True
            return
        if kind == "message_start":
            msg = obj.get("message")
            u = messages.usage_of_message(msg) if isinstance(msg, dict) else None
            if u:
                m.usage = {**(m.usage or {}), **u}
        elif kind == "message_delta":
            u = messages.usage_of_message(obj)
            if u:
                m.usage = {**(m.usage or {}), **u}
            m.saw_finish = True
        elif kind == "message_stop":
            m.saw_done = True
        elif kind == "error":
            m.error = _error_of(obj)
            m.saw_done = True

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
        await self.resp.write_eof(tail)

    async def fail(self, err: GatewayError) -> None:
        self.meter.error = err
        await self.resp.write_eof(self.rules.error_event(err, self.last))
