"""Relay of an engine's reply to the client: SSE event by event as it arrives, with the gateway's own timing."""

from __future__ import annotations

import re
from time import perf_counter
from typing import Any, Final

import orjson

from gateway.errors import GatewayError, error_from_event

DONE: Final = b"data: [DONE]\n\n"
_TOKEN_MARKERS: Final = (b'"content":"', b'"content": "', b'"text":"', b'"text": "', b'"reasoning":"', b'"reasoning": "')


def is_token_event(ev: bytes) -> bool:
    """True when an SSE event carries generated output (not the role-only first chunk or a usage chunk)."""
    for m in _TOKEN_MARKERS:
        i = ev.find(m)
        if i >= 0 and ev[i + len(m):i + len(m) + 1] != b'"':
            return True
    return ev.find(b'"tool_calls":[{') >= 0 or ev.find(b'"tool_calls": [{') >= 0


# A "usage" key whose value is null: SGLang (like OpenAI) puts one in every chunk of a stream; it needs no parsing.
_NULL_USAGE: Final = (b'"usage":null', b'"usage": null')


def _usage_after(block: bytes, i: int) -> int:
    """Where in block the first "usage" key from i on with a value other than null is, or -1."""
    while i >= 0 and block.startswith(_NULL_USAGE, i):
        i = block.find(b'"usage"', i + 7)
    return i


FIRST_WRITE_AFTER: Final = 2048  # a first block larger than this is split after its first token event


def _first_token_end(block: bytes, look: int = 16) -> int:
    """The end of the first of `look` events that carries output (0: none of them)."""
    start = 0
    for _ in range(look):
        end = block.find(b"\n\n", start)
        if end < 0:
            return 0
        if is_token_event(block[start:end]):
            return end + 2
        start = end + 2
    return 0


# Whitespace as a bytes regex's \s has it (JSON allows fewer; an engine's odd spacing still matches).
_SPACE: Final = frozenset(b" \t\n\r\f\v")


def _skip_space(data: bytes, i: int) -> int:
    n = len(data)
    while i < n and data[i] in _SPACE:
        i += 1
    return i


def _string_end(data: bytes, i: int) -> int:
    """Past the closing quote of the JSON string that opens at data[i], or -1 when it does not close."""
    j = data.find(b'"', i + 1)
    while j >= 0:
        k = j - 1
        while data[k] == 92:  # a quote after an odd run of backslashes is escaped
            k -= 1
        if (j - k) % 2 == 1:
            return j + 1
        j = data.find(b'"', j + 1)
    return -1


def model_value(data: bytes) -> bytes | None:
    """The first "model" key's string value, quotes and escapes as sent; scanned with find (a regex search
    costs several instructions per byte of a reply)."""
    i = data.find(b'"model":')
    while i >= 0:
        j = _skip_space(data, i + 8)
        if j < len(data) and data[j] == 34:  # a string value (a null or a number is passed over)
            end = _string_end(data, j)
            if end > 0:
                return data[j:end]
        i = data.find(b'"model":', i + 1)
    return None


class ModelRewrite:
    """Puts the public model name back into an engine's JSON, whatever name the engine answered with
    (llama.cpp answers with its own alias). The name is found once; later blocks are plain replaces."""

    __slots__ = ("public", "pairs", "known")

    def __init__(self, public: str) -> None:
        self.public = orjson.dumps(public)
        self.pairs: tuple[tuple[bytes, bytes], ...] = ()
        self.known = False

    def __call__(self, data: bytes) -> bytes:
        if not self.known:
            name = model_value(data)
            if name is None:
                return data
            self.known = True
            if name != self.public:
                self.pairs = ((b'"model":' + name, b'"model":' + self.public),
                              (b'"model": ' + name, b'"model": ' + self.public))
        if not self.pairs:
            return data
        for old, new in self.pairs:
            data = data.replace(old, new)
        return data


_SCALAR_END: Final = frozenset(b",}] \t\n\r")  # what ends a number, true, false or null


def _value_end(data: bytes, j: int) -> int:
    """Past the JSON value that starts at data[j] (an object, array, string or scalar), or -1 if it does not end."""
    n = len(data)
    if j >= n:
        return -1
    c = data[j]
    if c == 34:  # '"'
        return _string_end(data, j)
    if c != 123 and c != 91:  # neither '{' nor '[': a number, true, false or null
        k = j
        while k < n and data[k] not in _SCALAR_END:
            k += 1
        return k
    close = data.find(b"}" if c == 123 else b"]", j)
    if close > 0 and data.find(b"{", j + 1, close) < 0 and data.find(b"[", j + 1, close) < 0 \
            and data.find(b'"', j, close) < 0:
        return close + 1  # flat and without strings (llama.cpp's timings: numbers only): no walk needed
    depth, k = 0, j
    while k < n:
        c = data[k]
        if c == 34:
            k = _string_end(data, k)
            if k < 0:
                return -1
            continue
        if c == 123 or c == 91:
            depth += 1
        elif c == 125 or c == 93:
            depth -= 1
            if depth == 0:
                return k + 1
        k += 1
    return -1


def drop_member(data: bytes, key: bytes) -> bytes:
    """data without each object member whose quoted key is `key` (e.g. b'"timings"'), its comma included; the
    JSON of a reply or of a block of SSE events. A member that does not end in data is left as it is."""
    out: list[bytes] = []
    start = 0
    i = data.find(key)
    while i >= 0:
        before = i - 1
        while before >= 0 and data[before] in _SPACE:
            before -= 1
        colon = _skip_space(data, i + len(key))
        # A key follows '{' or ',' and is followed by ':' (the same quoted text elsewhere is a value).
        if before >= 0 and (data[before] == 123 or data[before] == 44) and colon < len(data) and data[colon] == 58:
            end = _value_end(data, _skip_space(data, colon + 1))
            if end > 0:
                if data[before] == 44:  # a member after another: its comma goes with it
                    out.append(data[start:before])
                    start = end
                else:  # the first member: the comma after it goes, if another member follows
                    after = _skip_space(data, end)
                    out.append(data[start:i])
                    start = after + 1 if after < len(data) and data[after] == 44 else end
                i = data.find(key, start)
                continue
        i = data.find(key, i + 1)
    if not out:
        return data
    out.append(data[start:])
    return b"".join(out)


class DroppingModelRewrite(ModelRewrite):
    """ModelRewrite for an engine with fields of its own in its replies (llama.cpp's `timings`): those are
    dropped too. Chosen per request, so that every other engine's blocks cost what they did."""

    __slots__ = ("drop",)

    def __init__(self, public: str, drop: tuple[bytes, ...]) -> None:
        super().__init__(public)
        self.drop = drop

    def __call__(self, data: bytes) -> bytes:
        data = super().__call__(data)
        for key in self.drop:
            if data.find(key) >= 0:  # (a token's block: one search, nothing copied)
                data = drop_member(data, key)
        return data


class StreamMeter:
    """What the gateway measured on one stream: first/last token times, token events, usage, the ending."""

    __slots__ = ("t_first", "t_last", "token_events", "usage", "saw_done", "saw_finish", "error")

    def __init__(self) -> None:
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.token_events = 0
        self.usage: dict[str, Any] | None = None
        self.saw_done = False
        self.saw_finish = False
        self.error: GatewayError | None = None


class EventTooLarge(Exception):
    """One server-sent event grew past the gateway's limit without ending."""


class SSERelay:
    """Splits the upstream byte stream into events, inspects only what stats need, forwards the rest unchanged.

    A partial event waits for its end, up to `max_event` bytes: past that EventTooLarge ends the relay.
    """

    __slots__ = ("resp", "meter", "strip_usage", "rename", "max_event", "_parts", "_size", "_busy")

    def __init__(self, resp, meter: StreamMeter, strip_usage: bool, rename: ModelRewrite,
                 max_event: int = 1 << 20) -> None:
        self.resp = resp
        self.meter = meter
        self.strip_usage = strip_usage
        self.rename = rename
        self.max_event = max_event
        self._parts: list[bytes] = []  # the start of an event not yet ended
        self._size = 0
        self._busy = False  # feed() is under way (it may wait for the client between two writes)

    def take(self, chunk: bytes) -> bool:
        """Relay a chunk at once, from the engine connection's read callback (Response.hand_to): when it ends on an
        event's end, nothing of an earlier one waits, the first token has gone out and the client keeps up. A
        token then costs no wake-up of the stream's task. False leaves the chunk to feed()."""
        if self._busy or self._parts or self.meter.t_first is None or chunk[-2:] != b"\n\n":
            return False
        resp = self.resp
        if not resp.writable:
            return False
        out = self._events(chunk)
        resp.write_now(out, self.meter.saw_done)
        return True

    async def feed(self, chunk: bytes) -> None:
        self._busy = True  # take() waits until this chunk is out
        try:
            cut = chunk.rfind(b"\n\n")
            parts = self._parts
            if cut < 0 and parts and parts[-1][-1:] == b"\n" and chunk[:1] == b"\n":
                cut = -1  # the blank line straddles two reads
            elif cut < 0:
                # A partial event: kept in pieces (joined once it ends, so a long one costs linear time), bounded.
                parts.append(chunk)
                self._size += len(chunk)
                if self._size > self.max_event:
                    raise EventTooLarge(f"the engine sent an event larger than {self.max_event} bytes")
                return
            if len(chunk) - cut - 2 > self.max_event:
                raise EventTooLarge(f"the engine sent an event larger than {self.max_event} bytes")
            if parts:
                data = b"".join(parts) + chunk[:cut + 2]
                parts.clear()
            else:
                data = chunk[:cut + 2] if cut + 2 < len(chunk) else chunk
            rest = chunk[cut + 2:]
            if rest:
                parts.append(rest)
            self._size = len(rest)
            if self.meter.t_first is None and len(data) > FIRST_WRITE_AFTER:
                # A fast engine's whole reply can come in one read: its first token goes out before the gateway
                # looks at the rest, so the client's first token never waits for a scan of the whole burst.
                end = _first_token_end(data)
                if 0 < end < len(data):
                    out = self._events(data[:end])
                    if out:
                        await self.resp.write(out)
                    data = data[end:]
            out = self._events(data)
            if self.meter.saw_done:
                # The client's stream is complete: the last bytes and the end of the body go in one write.
                await self.before_end()
                await self.resp.write_eof(out)
            elif out:
                await self.resp.write(out)
        finally:
            self._busy = False

    async def before_end(self) -> None:
        """The stream's last bytes are about to go out (a subclass may have something to do first)."""

    async def finish(self) -> None:
        """End of the upstream body: flush a trailing event, make sure the client gets a clean ending."""
        m = self.meter
        rest = b"".join(self._parts)
        self._parts.clear()
        if m.saw_done and not rest.strip():
            return
        tail = self._events(rest + b"\n\n") if rest.strip() else b""
        if not m.saw_done:
            if m.error is None and not m.saw_finish:
                m.error = GatewayError(502, "The upstream engine ended the stream early.", code="upstream_truncated")
                tail += m.error.sse_event()
            tail += DONE
        await self.resp.write_eof(tail)

    async def fail(self, err: GatewayError) -> None:
        """The upstream broke mid-stream: an OpenAI-shaped error event and [DONE], never a silent cut."""
        self.meter.error = err
        await self.resp.write_eof(err.sse_event() + DONE)

    def _events(self, block: bytes) -> bytes:
        m = self.meter
        # perf_counter, not the loop's clock: uvloop's loop.time() is cached per iteration at 1 ms resolution.
        now = perf_counter()
        if m.saw_done:
            return b""
        # Ordinary token events are forwarded as they came; only the events from the first one that may
        # carry usage, an error or [DONE] onwards are parsed.
        done, usage, error = block.find(b"[DONE]"), block.find(b'"usage"'), block.find(b'"error"')
        if usage >= 0 and block.startswith(_NULL_USAGE, usage):
            usage = _usage_after(block, usage)  # (parsed, they were a quarter of an SGLang stream's instructions)
        if done < 0 and usage < 0 and error < 0:  # (every token: no generator or min() on this path)
            self._ordinary(block, now)
            return self.rename(block)
        special = min(i for i in (done, usage, error) if i >= 0)
        cut = block.rfind(b"\n\n", 0, special)
        start = cut + 2 if cut >= 0 else 0
        head, tail = block[:start], block[start:]
        out = [head] if head else []
        if head:
            self._ordinary(head, now)
        for ev in tail.split(b"\n\n"):
            if not ev.strip():
                continue
            kept = self._one(ev, now)
            if kept is not None:
                out.append(kept + b"\n\n")
        data = b"".join(out)
        return self.rename(data)

    def _ordinary(self, block: bytes, now: float) -> None:
        """Timing and finish detection for events that need no parsing."""
        m = self.meter
        if block.find(b"\n\n") >= len(block) - 2:  # one event (the block ends with its blank line)
            tokens = 1 if is_token_event(block) else 0
        else:  # several events arrived together: look at each (a role-only chunk may come first)
            tokens = 0
            for ev in block.split(b"\n\n"):
                # The usual token event decided inline, as is_token_event's first marker would; the rest by it.
                i = ev.find(b'"content":"')
                if (i >= 0 and ev[i + 11:i + 12] != b'"') or (ev and is_token_event(ev)):
                    tokens += 1
        if tokens:
            if m.t_first is None:
                m.t_first = now
            m.t_last = now
            m.token_events += tokens
        # find() rather than `in`: bytes' `in` first tries its operand as an integer, raising and formatting a
        # TypeError before it searches (~10x the cost of a find on an event), and this runs for every token.
        if not m.saw_finish and (block.find(b'"finish_reason":"') >= 0 or block.find(b'"finish_reason": "') >= 0):
            m.saw_finish = True

    def _one(self, ev: bytes, now: float) -> bytes | None:
        m = self.meter
        payload = ev[5:].strip() if ev.startswith(b"data:") else None
        if payload is None:
            return ev  # comments and other SSE fields pass through
        if payload == b"[DONE]":
            m.saw_done = True
            return ev
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return ev
        if not isinstance(obj, dict):
            return ev
        if obj.get("error"):
            m.error = error_from_event(obj)
            return m.error.sse_event()[:-2]
        if isinstance(obj.get("usage"), dict):
            m.usage = obj["usage"]
        if is_token_event(ev):
            if m.t_first is None:
                m.t_first = now
            m.t_last = now
            m.token_events += 1
        if any(isinstance(c, dict) and c.get("finish_reason") for c in obj.get("choices") or ()):
            m.saw_finish = True
        if self.strip_usage and obj.get("choices") == [] and "usage" in obj:
            return None  # the usage chunk the gateway asked for on its own account
        if self.strip_usage and obj.get("usage") is not None:
            obj["usage"] = None  # continuous usage the client did not ask for
            return b"data: " + orjson.dumps(obj)
        return ev


# One regex pass from the "usage" key on: it costs less than a find per count name, compiled or not.
_USAGE_FIELDS: Final = re.compile(rb'"(prompt_tokens|completion_tokens|cached_tokens|input_tokens|output_tokens|'
                                  rb'cache_read_input_tokens)"\s*:\s*(\d+)')
# The Responses and Messages APIs' names for the same counts.
_USAGE_NAMES: Final = {"input_tokens": "prompt_tokens", "output_tokens": "completion_tokens",
                       "cache_read_input_tokens": "cached_tokens"}


def usage_of(data: bytes) -> dict | None:
    """Token counts from a non-streamed reply without parsing the whole body (it may be large), in chat's names."""
    i = data.rfind(b'"usage"')
    if i < 0:
        return None
    found: dict[str, Any] = {}
    for k, v in _USAGE_FIELDS.findall(data, i):
        name = k.decode()
        found[_USAGE_NAMES.get(name, name)] = int(v)  # the last of a repeated name, as a JSON parser takes it
    if not found:
        return None
    if "cached_tokens" in found:
        found["prompt_tokens_details"] = {"cached_tokens": found.pop("cached_tokens")}
    return found
