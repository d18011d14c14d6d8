"""Generation for the non-chat APIs: scheduler submission, waiting, and SSE streams with mid-stream faults."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from aiohttp import web

from gateway.sim.engine import Ticket
from gateway.sim.handlers import StreamFaults, stream_response
from gateway.sim.scheduler import SimRequest
from gateway.sim.state import SimState
from gateway.sim.tokens import Output


class Renderer(Protocol):
    """One API's stream: the events around and between the generated tokens."""

    def opening(self) -> list[bytes]:
        """Events that open the stream (created / message_start ...)."""

    def tokens(self, start: int, stop: int) -> list[bytes]:
        """Events of output tokens [start, stop)."""

    def closing(self, req: SimRequest) -> list[bytes]:
        """Events after the last token (done / completed / stop), with the final usage."""

    def error(self, sent: int) -> bytes:
        """The engine's mid-stream error event after `sent` events, as the error fault sends it."""


def submit(st: SimState, tokens: Sequence[int], output: Output) -> Ticket:
    """Hand one generation to the scheduler: it is timed and batched like any chat request."""
    now = asyncio.get_running_loop().time()
    req = SimRequest(prompt=tokens, max_new=len(output.pieces), arrival=now,
                     ready_at=now + st.profile.frontend_s + st.faults.spec.slow_start_s,
                     output_ids=output.ids, finish_reason=output.finish_reason)
    return st.engine.submit(req)


async def finish(ticket: Ticket) -> SimRequest:
    """Wait until every token of the request is generated."""
    while not ticket.done:
        await ticket.wait()
    return ticket.req


def release(st: SimState, ticket: Ticket) -> None:
    """Free the request's batch entry or slot when its client left before the end."""
    if not ticket.done:
        st.engine.abort(ticket)


async def stream(request: web.Request, st: SimState, ticket: Ticket, renderer: Renderer,
                 opens_early: bool | None = None) -> web.StreamResponse:
    """Send the request's events as its tokens come out of the scheduler.

    `opens_early`: headers and opening events go out before the first token (vLLM, SGLang); llama-server
    answers nothing until its first result. The drop / error knobs count these events like chat chunks.
    """
    fmt = st.fmt
    early = fmt.stream_opens_early if opens_early is None else opens_early
    resp = stream_response(st)
    faults = StreamFaults(st)
    total = ticket.req.max_new
    try:
        if early:
            await resp.prepare(request)
            events, end = faults.cut(renderer.opening())
            if await _send(request, resp, renderer, events, end, faults.sent):
                return resp
        sent = 0
        while sent < total:
            produced = await ticket.wait()
            if produced <= sent:
                continue
            events = [] if early or sent else renderer.opening()
            events += renderer.tokens(sent, produced)
            if produced >= total:
                events += renderer.closing(ticket.req)
            sent = produced
            if not resp.prepared:
                await resp.prepare(request)
            events, end = faults.cut(events)
            if await _send(request, resp, renderer, events, end, faults.sent):
                return resp
        if fmt.closes_after_stream:
            await resp.write_eof()
            request.protocol.force_close()  # llama-server drops the connection after a stream
    except ConnectionResetError:
        pass  # the client left; the caller frees the request's slot
    return resp


async def _send(request: web.Request, resp: web.StreamResponse, renderer: Renderer,
                events: list[bytes], end: str | None, sent: int) -> bool:
    """Write events; True when a fault ended the stream with them."""
    if end == "error":
        await resp.write(b"".join(events) + renderer.error(sent))
        return True
    if events:
        await resp.write(b"".join(events))
    if end == "drop" and request.transport is not None:
        request.transport.close()  # the chunked body never terminates: the client sees a drop
    return end is not None
