"""Inference routes of a simulated engine (chat, completions, embeddings) and the entry of every generating route."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from gateway.sim import chat_tools
from gateway.sim.engine import Ticket
from gateway.sim.formats import DONE, Reply, sse
from gateway.sim.parse import ApiError, GenRequest, check_model, parse_generation
from gateway.sim.scheduler import SimRequest
from gateway.sim.state import SIM, SimState
from gateway.sim.tokens import embed, encode


def error_response(st: SimState, err: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    body = st.fmt.error(err.status, err.message, err.type_, err.param, **err.extra)
    return web.Response(body=orjson.dumps(body), status=err.status,
                        content_type="application/json", headers=headers)


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    return body


ErrorRender = Callable[[SimState, ApiError, "dict[str, str] | None"], web.Response]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Generating = Callable[[web.Request, SimState], Awaitable[web.StreamResponse]]  # a handler given its engine's state


async def apply_entry_faults(st: SimState, render: ErrorRender = error_response) -> web.Response | None:
    """Hang before the first byte, then maybe answer with the injected error status (in `render`'s shape)."""
    spec = st.faults.spec
    if spec.hang_s < 0:
        await asyncio.Event().wait()  # until the client gives up and the handler is cancelled
    elif spec.hang_s > 0:
        await asyncio.sleep(spec.hang_s)
    if not st.faults.take_error():
        return None
    status = st.faults.spec.error_status
    headers = {}
    if st.faults.spec.retry_after_s is not None:
        headers["Retry-After"] = str(int(round(st.faults.spec.retry_after_s)))
    return render(st, ApiError(status, "Simulated fault injected by the engine simulator"), headers)


def generating(render: ErrorRender = error_response) -> Callable[[Generating], Handler]:
    """A generating route as the engine takes it: once warm-up is over (SGLang takes requests during warm-up and
    serves them after it), counted in flight, through the injected entry faults (in `render`'s error shape)."""
    def wrap(serve: Generating) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            st = request.app[SIM]
            await st.ready.wait()
            st.inflight += 1
            try:
                injected = await apply_entry_faults(st, render)
                if injected is not None:
                    return injected
                return await serve(request, st)
            finally:
                st.inflight -= 1
        return handler
    return wrap


def make_chat_handler(kind: str) -> Handler:
    @generating()
    async def handler(request: web.Request, st: SimState) -> web.StreamResponse:
        try:
            gen = parse_generation(st.parse_ctx, kind, await read_json(request))
        except ApiError as err:
            return error_response(st, err)
        if gen.inband_error is not None:
            return await _inband_error(request, st, gen.inband_error)
        return await _serve(request, st, gen)

    return handler


async def _inband_error(request: web.Request, st: SimState, err: ApiError) -> web.StreamResponse:
    resp = stream_response(st)
    await resp.prepare(request)
    await resp.write(sse(st.fmt.stream_error(err.status, err.message, err.type_)) + DONE)
    return resp


def stream_response(st: SimState) -> web.StreamResponse:
    # No Nagle delay to fight: aiohttp sets TCP_NODELAY on every accepted socket
    # (BaseProtocol.connection_made), so each step's chunk leaves as soon as it is written.
    headers = {"Content-Type": st.fmt.sse_content_type, "Cache-Control": "no-cache"}
    if st.fmt.closes_after_stream:
        headers["Keep-Alive"] = "timeout=5, max=100"  # announced, then not honoured
    return web.StreamResponse(status=200, headers=headers)


async def _serve(request: web.Request, st: SimState, gen: GenRequest) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    now = loop.time()
    req = SimRequest(prompt=gen.tokens, max_new=len(gen.output.pieces), arrival=now,
                     ready_at=now + st.profile.frontend_s + st.faults.spec.slow_start_s,
                     output_ids=gen.output.ids, slot_hint=gen.slot_hint,
                     cache_prompt=gen.cache_prompt, finish_reason=gen.output.finish_reason)
    reply = Reply(gen.kind, gen.model, gen.output, len(gen.tokens), gen.include_usage,
                  gen.continuous_usage, st.opts.report_cached_tokens, st.fmt.new_id(gen.kind),
                  tool_call=gen.tool_call)
    if gen.tool_call is not None:
        reply.finish = chat_tools.finish_reason(st.engine_name, gen.output.finish_reason,
                                                gen.named_tool)
    ticket = st.engine.submit(req)
    try:
        if gen.stream:
            return await _stream(request, st, ticket, reply)
        while not ticket.done:
            await ticket.wait()
        _finish_reply(st, reply, req)
        return web.Response(body=orjson.dumps(st.fmt.response(reply, req.generated)),
                            content_type="application/json")
    finally:
        if not ticket.done:
            st.engine.abort(ticket)


def _finish_reply(st: SimState, reply: Reply, req: SimRequest) -> None:
    reply.cached_tokens = req.cached
    if st.engine_name == "llamacpp":
        prompt_ms = (req.first_token_at - req.admitted_at) * 1000.0
        predicted_ms = (req.last_token_at - req.first_token_at) * 1000.0
        prompt_n = req.prompt_len - req.cached
        n = req.generated
        reply.timings = {
            "cache_n": req.cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(prompt_n, 1),
            "prompt_per_second": prompt_n / prompt_ms * 1000.0 if prompt_ms > 0 else 0.0,
            "predicted_n": n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(n - 1, 1),
            "predicted_per_second": (n - 1) / predicted_ms * 1000.0 if predicted_ms > 0 else 0.0,
        }


class StreamFaults:
    """Counts SSE events against the drop / mid-stream-error knobs captured at request start."""

    def __init__(self, st: SimState) -> None:
        spec = st.faults.spec
        self.drop_after = spec.drop_after_chunks
        self.error_after = spec.error_after_chunks
        self.sent = 0

    def cut(self, events: list[bytes]) -> tuple[list[bytes], str | None]:
        """The events to send now, and "drop" or "error" if the stream ends after them."""
        limits = [(n, what) for n, what in ((self.drop_after, "drop"), (self.error_after, "error"))
                  if n is not None]
        for n, what in sorted(limits):
            if self.sent + len(events) >= n:
                keep = events[: max(n - self.sent, 0)]
                self.sent += len(keep)
                return keep, what
        self.sent += len(events)
        return events, None


async def _stream(request: web.Request, st: SimState, ticket: Ticket,
                  reply: Reply) -> web.StreamResponse:
    fmt = st.fmt
    req = ticket.req
    total = req.max_new
    resp = stream_response(st)
    faults = StreamFaults(st)
    template = fmt.content_template(reply)
    try:
        if fmt.stream_opens_early:
            await resp.prepare(request)
        sent = 0
        while sent < total:
            produced = await ticket.wait()
            if produced <= sent:
                continue
            last = produced >= total
            if last:
                _finish_reply(st, reply, req)
            events = _events(fmt, reply, template, sent, produced, last)
            if last:
                events += [sse(e) for e in fmt.tail_events(reply, produced)]
            sent = produced
            events, end = faults.cut(events)
            if not resp.prepared:
                await resp.prepare(request)  # llama.cpp commits to a stream on its first result
            if end is not None:
                await _end_with_fault(request, resp, st, events, end)
                return resp
            if events:
                await resp.write(b"".join(events))
        await resp.write(DONE)
        if fmt.closes_after_stream:
            await resp.write_eof()
            request.protocol.force_close()  # after the last chunk, with no `Connection: close` sent
    except ConnectionResetError:
        pass  # the client left; the caller frees the request's slot
    return resp


def _events(fmt, reply: Reply, template, start: int, stop: int, last: bool) -> list[bytes]:
    if template is None or start == 0 or last:
        return [sse(e) for e in fmt.stream_events(reply, start, stop, last)]
    head, tail = template
    return [head + orjson.dumps(p) + tail for p in reply.output.pieces[start:stop] if p]


async def _end_with_fault(request: web.Request, resp: web.StreamResponse, st: SimState,
                          events: list[bytes], end: str) -> None:
    if end == "error":
        error = sse(st.fmt.stream_error(500, "Simulated mid-stream engine error"))
        await resp.write(b"".join(events) + error + (DONE if st.fmt.done_after_error else b""))
        return
    if events:
        await resp.write(b"".join(events))
    # Abrupt end: the chunked body never terminates, the client sees the connection drop.
    if request.transport is not None:
        request.transport.close()


async def embeddings(request: web.Request) -> web.Response:
    st = request.app[SIM]
    await st.ready.wait()
    injected = await apply_entry_faults(st)
    if injected is not None:
        return injected
    try:
        body = await read_json(request)
        model = check_model(st.parse_ctx, body)
        inputs = _embedding_inputs(body.get("input"))
    except ApiError as err:
        return error_response(st, err)
    data, n_tokens = [], 0
    for i, item in enumerate(inputs):
        text = item if isinstance(item, str) else " ".join(map(str, item))
        n_tokens += len(encode(item)) if isinstance(item, str) else len(item)
        data.append({"object": "embedding", "index": i, "embedding": embed(text)})
    body = {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _embedding_inputs(value: Any) -> list[Any]:
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) for t in v)

    if isinstance(value, str):
        return [value]
    if is_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or is_ids(v) for v in value):
        return value
    raise ApiError(400, "'input' must be a string, a list of strings or token id lists",
                   param="input")
