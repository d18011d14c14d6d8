"""What the support probe's checks share: a verdict cell, the refusals that end a check, and one model on one engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import aiohttp
import orjson

from backends.openai_http import printable
from gateway.contracts import UpstreamCall, UpstreamError

# yes; no (the engine answered, and not with it); error (no answer, a timeout, a 5xx, garbage); unknown (a context
# window nobody reports); partial (stored responses: GET served, DELETE not); gateway (the gateway serves the API
# itself, whatever the engine).
YES, NO, ERROR, UNKNOWN, PARTIAL, GATEWAY = "yes", "no", "error", "unknown", "partial", "gateway"
# Verdicts a required check may have: the API or feature works for clients of this backend.
PASSING = frozenset({YES, GATEWAY})

CHAT = "/v1/chat/completions"
# What the probe reads of an engine: a reply to a tiny request larger than this is garbage, not an answer.
REPLY_LIMIT = 1 << 20
ERROR_LIMIT = 64 << 10
REASON_CHARS = 120


@dataclass(frozen=True)
class Cell:
    """One check's verdict, why, and the HTTP status behind a refusal (None when there was none)."""

    verdict: str
    reason: str = ""
    window: int | None = None  # context only: the window the probe verified
    status: int | None = None

    def describe(self) -> str:
        return f"{self.verdict} ({self.reason})" if self.reason else self.verdict

    def short(self) -> str:
        """The verdict and the refusal's status, as the matrix and docs/apis.md show a cell: `no (404)`."""
        return f"{self.verdict} ({self.status})" if self.status is not None else self.verdict

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"verdict": self.verdict, "reason": self.reason}
        if self.window is not None:
            out["window"] = self.window
        if self.status is not None:
            out["status"] = self.status
        return out


class Verdict(Exception):
    """A check ends here with this cell: the engine refused, failed or answered something unusable."""

    def __init__(self, verdict: str, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.cell = Cell(verdict, reason, status=status)


class TimedOut(Verdict):
    """No whole reply in time: the checks after it are not tried (a stuck engine would hold each one as long)."""


def clip(text: str) -> str:
    """Engine text fit to print: whitespace runs made one space, control characters replaced, 120 characters."""
    return printable(" ".join(text.split()), REASON_CHARS)


def engine_message(body: bytes) -> str:
    """The message of an engine's error body, whichever of the engines' shapes it has, else its text."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return clip(body.decode("utf-8", "replace"))
    for holder in ((data.get("error"), data) if isinstance(data, dict) else ()):
        if isinstance(holder, str):
            return clip(holder)
        if isinstance(holder, dict):
            for key in ("message", "detail"):
                if isinstance(holder.get(key), str):
                    return clip(holder[key])
    return clip(body.decode("utf-8", "replace"))


def refusal(status: int, body: bytes, prefix: str = "") -> Verdict:
    """A non-200 answer as a verdict: a 5xx is an error (the engine failed) but a 501 (it says it does not
    implement this), anything else a no; its reason the status and the engine's message."""
    message = engine_message(body)
    reason = f"{prefix}HTTP {status}: {message}" if message else f"{prefix}HTTP {status}"
    return Verdict(ERROR if status >= 500 and status != 501 else NO, reason, status)


def sse_data(block: bytes) -> bytes | None:
    """The data of one server-sent event (its `data:` lines joined), None for a comment or an empty event."""
    lines = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def event_object(data: bytes) -> dict[str, Any]:
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise Verdict(ERROR, "an event of the stream is not JSON") from None
    if not isinstance(event, dict):
        raise Verdict(ERROR, "an event of the stream is not a JSON object")
    error = event.get("error")
    if error is not None:  # an in-band error (SGLang opens the stream before it validates)
        code = error.get("code") if isinstance(error, dict) else None
        raise refusal(code if isinstance(code, int) and 400 <= code < 600 else 400, orjson.dumps(event))
    return event


@dataclass
class Stream:
    events: list[dict[str, Any]]
    done: bool  # `data: [DONE]` came


class Target:
    """One model on one engine, through the engine's adapter (its routes, key and connection limits). Nothing
    sent here passes the request pipeline: no stats, metrics, limits or access-log line count it."""

    def __init__(self, adapter, native: str, max_context: int | None, timeout: float) -> None:
        self.adapter = adapter
        self.model = native
        self.max_context = max_context
        self.timeout = timeout

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The JSON object of a 200 reply; Verdict for anything else."""
        data = await self.post_json(path, body)
        if not isinstance(data, dict):
            raise Verdict(ERROR, "the reply is not a JSON object")
        return data

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        """The JSON value of a 200 reply, whatever its type (SGLang's rerank answers with a list)."""
        return await self._exchange(UpstreamCall(path, orjson.dumps(body), {}, False), self._json)

    async def post_form(self, path: str, form: bytes, content_type: str) -> dict[str, Any]:
        data = await self._exchange(UpstreamCall(path, form, {"Content-Type": content_type}, False), self._json)
        if not isinstance(data, dict):
            raise Verdict(ERROR, "the reply is not a JSON object")
        return data

    async def stream(self, body: dict[str, Any]) -> Stream:
        return await self._exchange(UpstreamCall(CHAT, orjson.dumps({**body, "stream": True}), {}, True),
                                    self._events)

    async def ask(self, method: str, path: str) -> tuple[int, bytes]:
        """A body-less request (GET, DELETE): its status and body, whatever the status."""
        async def whole(reply) -> tuple[int, bytes]:
            return reply.status, await reply.read(REPLY_LIMIT if reply.status == 200 else ERROR_LIMIT,
                                                  truncate=reply.status != 200)
        return await self._exchange(UpstreamCall(path, b"", {}, False, method), whole, any_status=True)

    async def _exchange(self, call: UpstreamCall, read: Callable[[Any], Awaitable[Any]],
                        any_status: bool = False) -> Any:
        try:
            async with asyncio.timeout(self.timeout):  # the head, and the whole body after it
                reply = await self.adapter.forward(call, self.timeout)
                try:
                    if reply.status != 200 and not any_status:
                        raise refusal(reply.status, await reply.read(ERROR_LIMIT, truncate=True))
                    return await read(reply)
                finally:
                    reply.close()
        except TimeoutError:
            raise TimedOut(ERROR, f"no whole reply within {self.timeout:.3g} s") from None
        except UpstreamError as e:  # refused, reset, malformed, too large
            raise Verdict(ERROR, clip(str(e))) from None

    @staticmethod
    async def _json(reply) -> Any:
        try:
            return orjson.loads(await reply.read(REPLY_LIMIT))
        except orjson.JSONDecodeError:
            raise Verdict(ERROR, "the reply is not JSON") from None

    @staticmethod
    async def _events(reply) -> Stream:
        ctype = reply.headers.get("content-type", "")
        if not ctype.startswith("text/event-stream"):
            raise Verdict(NO, f"not an event stream (content type {clip(ctype) or 'none'})")
        events: list[dict[str, Any]] = []
        pending, total = b"", 0
        async for chunk in reply.iter_chunks():
            total += len(chunk)
            if total > REPLY_LIMIT:
                raise Verdict(ERROR, f"a stream of more than {REPLY_LIMIT} bytes")
            # A CR at the end of one chunk meets its LF in the next: normalise only what is joined.
            *blocks, pending = (pending + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
            for block in blocks:
                data = sse_data(block)
                if data == b"[DONE]":
                    return Stream(events, True)
                if data is not None:
                    events.append(event_object(data))
        data = sse_data(pending)
        if data == b"[DONE]":
            return Stream(events, True)
        if data is not None:
            events.append(event_object(data))
        return Stream(events, False)

    async def window(self) -> tuple[int | None, str]:
        """The context window the engine reports for this model, else the configured max_context, and which."""
        ask = getattr(self.adapter, "context_window", None)
        if ask is not None:
            try:
                n = await ask(self.model, self.timeout)
            except TimeoutError:
                raise TimedOut(ERROR, f"no window from the engine within {self.timeout:.3g} s") from None
            except (aiohttp.ClientError, OSError, ValueError) as e:
                raise Verdict(ERROR, f"reading the window failed: {type(e).__name__}") from None
            if n is not None:
                return n, "engine"
        return self.max_context, "max_context"


CheckFn = Callable[[Target], Awaitable[Cell]]
CheckTable = Mapping[str, CheckFn]
