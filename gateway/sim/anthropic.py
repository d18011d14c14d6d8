"""Anthropic Messages API of a simulated engine (vLLM, llama-server): messages, streaming, count_tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from gateway.sim import forced, pump
from gateway.sim.errors import ApiError
from gateway.sim.forced import ToolCall
from gateway.sim.handlers import error_response, generating, read_json
from gateway.sim.parse import check_model, context_error
from gateway.sim.responses_fmt import event
from gateway.sim.scheduler import SimRequest
from gateway.sim.state import SIM, SimState
from gateway.sim.tokens import Output, encode, generate, render_chat

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def anthropic_error(st: SimState, err: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    """vLLM wraps its handler errors in Anthropic's shape (its own type names); llama-server keeps its own."""
    if st.engine_name != "vllm":
        return error_response(st, err, headers)
    body = {"type": "error", "error": {"type": err.type_ or st.fmt.error_type(err.status),
                                       "message": err.message}}
    return web.Response(body=orjson.dumps(body), status=err.status, content_type="application/json",
                        headers=headers)


class _Invalid(ApiError):
    """A body the request model rejects: vLLM answers these before its handler, in its OpenAI shape."""


def _validate(engine: str, body: dict[str, Any], count_only: bool) -> None:
    if engine == "llamacpp":
        if "messages" not in body:
            # A runtime_error in llama-server's converter: its exception wrapper makes it a 500.
            raise ApiError(500, "'messages' is required", "server_error")
        return
    missing = [k for k in ("model", "messages", "max_tokens")
               if k not in body and not (count_only and k == "max_tokens")]
    if missing:
        raise _Invalid(400, "; ".join(f"{{'type': 'missing', 'loc': ('body', '{k}'), 'msg': "
                                      "'Field required'}" for k in missing))
    if not isinstance(body["messages"], list):
        raise _Invalid(400, "messages: Input should be a valid list")
    limit = body.get("max_tokens")
    if not count_only and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise _Invalid(400, "Value error, max_tokens must be positive")


def _block_text(block: Any) -> str:
    if not isinstance(block, dict):
        return ""
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "tool_use":
        return f"{block.get('name')}({orjson.dumps(block.get('input', {})).decode()})"
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, list):
            return "".join(_block_text(c) for c in content)
        return "" if content is None else str(content)
    if kind in ("thinking", "redacted_thinking"):
        return ""
    return f"<{kind}>"


def to_chat(body: dict[str, Any]) -> list[dict[str, Any]]:
    """System prompt and messages as the chat messages both engines convert them to."""
    out = []
    system = body.get("system")
    if isinstance(system, str) and system:
        out.append({"role": "system", "content": system})
    elif isinstance(system, list):
        text = "".join(_block_text(b) for b in system if isinstance(b, dict) and b.get("type") == "text")
        if text:
            out.append({"role": "system", "content": text})
    for msg in body.get("messages") or []:
        if not isinstance(msg, dict):
            raise _Invalid(400, "messages: each message must be an object")
        content = msg.get("content")
        text = content if isinstance(content, str) else "".join(
            _block_text(b) for b in content or [])
        out.append({"role": str(msg.get("role", "user")), "content": text})
    return out


@dataclass
class MsgCall:
    engine: str
    rid: str
    model: str
    prompt_tokens: int
    output: Output
    tool_call: ToolCall | None
    named: bool
    report_cached: bool

    def stop(self) -> tuple[str, str | None]:
        """stop_reason and stop_sequence."""
        reason = self.output.finish_reason
        if self.tool_call is not None and reason == "stop" and not (self.engine == "vllm" and self.named):
            reason = "tool_calls"  # vLLM keeps "stop" (so "end_turn") for a call forced by name
        if self.output.stop_string is not None:
            return "stop_sequence" if self.engine == "vllm" else "end_turn", self.output.stop_string
        return _STOP[reason], None

    def usage(self, cached: int, generated: int) -> dict[str, Any]:
        if self.engine == "vllm" and self.report_cached:
            return {"input_tokens": self.prompt_tokens - cached, "output_tokens": generated,
                    "cache_read_input_tokens": cached}
        return {"input_tokens": self.prompt_tokens, "output_tokens": generated}

    def tool_block(self, final: bool) -> dict[str, Any]:
        tc = self.tool_call
        assert tc is not None
        block: dict[str, Any] = {"type": "tool_use", "id": tc.call_id, "name": tc.name}
        if final:
            try:
                block["input"] = orjson.loads(tc.arguments)
            except orjson.JSONDecodeError:
                block["input"] = {}  # arguments cut by max_tokens
        elif self.engine == "vllm":
            block["input"] = {}
        return block

    def message(self, req: SimRequest) -> dict[str, Any]:
        reason, sequence = self.stop()
        content: list[dict[str, Any]] = []
        if self.tool_call is not None:
            content.append(self.tool_block(final=True))
        elif self.output.text or self.engine == "vllm":
            # vLLM answers an empty completion with one empty text block; llama-server with none.
            content.append({"type": "text", "text": self.output.text})
        out = {"id": self.rid, "type": "message", "role": "assistant", "content": content,
               "model": self.model, "stop_reason": reason, "stop_sequence": sequence,
               "usage": self.usage(req.cached, req.generated)}
        if self.engine == "vllm" and sequence is None:
            del out["stop_sequence"]  # serialised with exclude_none
        return out


class MessagesStream:
    """message_start with the first token, one content_block_delta per token, then the stop events."""

    def __init__(self, call: MsgCall) -> None:
        self.call = call
        self.block_open = False

    def opening(self) -> list[bytes]:
        return []

    def tokens(self, start: int, stop: int) -> list[bytes]:
        c = self.call
        out = []
        if start == 0:
            message: dict[str, Any] = {"id": c.rid, "type": "message", "role": "assistant", "content": [],
                       "model": c.model, "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": c.prompt_tokens, "output_tokens": 0}}
            out.append(event("message_start", {"type": "message_start", "message": message}))
        for piece in c.output.pieces[start:stop]:
            if not piece:
                continue
            if not self.block_open:
                block = c.tool_block(final=False) if c.tool_call else {"type": "text", "text": ""}
                out.append(event("content_block_start", {"type": "content_block_start", "index": 0,
                                                         "content_block": block}))
                self.block_open = True
            delta = ({"type": "input_json_delta", "partial_json": piece} if c.tool_call
                     else {"type": "text_delta", "text": piece})
            out.append(event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                     "delta": delta}))
        return out

    def closing(self, req: SimRequest) -> list[bytes]:
        c = self.call
        out = []
        if self.block_open:
            out.append(event("content_block_stop", {"type": "content_block_stop", "index": 0}))
        reason, sequence = c.stop()
        if c.engine == "vllm":
            delta: dict[str, Any] = {"stop_reason": reason}
            if sequence is not None:
                delta["stop_sequence"] = sequence
            use = c.usage(req.cached, req.generated)
        else:
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            use = {"output_tokens": req.generated}
        out.append(event("message_delta", {"type": "message_delta", "delta": delta, "usage": use}))
        out.append(event("message_stop", {"type": "message_stop"}))
        return out

    def error(self, sent: int) -> bytes:
        message = "Simulated mid-stream engine error"
        if self.call.engine == "vllm":
            return event("error", {"type": "error", "error": {"type": "internal_error", "message": message}})
        return event("error", {"code": 500, "message": message, "type": "server_error"})


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        return await read_json(request)
    except ApiError as err:
        raise _Invalid(err.status, err.message) from err  # JSON errors come from the request model


def _prompt(st: SimState, body: dict[str, Any], count_only: bool) -> tuple[str, list[int], Any, bool]:
    _validate(st.engine_name, body, count_only)
    model = check_model(st.parse_ctx, body)
    tools = forced.anthropic_tools(body)
    constraint = forced.anthropic_constraint(st.engine_name, body, tools)
    tokens = encode(render_chat(to_chat(body), True, forced.tools_text(tools)))
    return model, tokens, constraint, bool(constraint and constraint.named)


@generating(anthropic_error)
async def messages(request: web.Request, st: SimState) -> web.StreamResponse:
    try:
        body = await _body(request)
        model, tokens, constraint, named = _prompt(st, body, count_only=False)
        limit = body.get("max_tokens", 4096)  # llama-server fills in 4096 when it is missing
        # (vLLM turns a Messages request into a chat one: its refusal names max_completion_tokens)
        error = context_error(st.parse_ctx, len(tokens), limit, "max_completion_tokens")
        if error is not None:
            raise error
        room = (st.profile.slot_ctx() if st.engine_name == "llamacpp"
                else st.profile.max_model_len) - len(tokens)
        cap = max(min(int(limit), room), 1)
        stops = body.get("stop_sequences") or ()
        output = generate(st.opts.seed, tokens, cap, False, tuple(stops))
        call = None
        if constraint is not None:
            output, call = forced.realize(constraint, st.engine_name, "chat", st.opts.seed,
                                          tokens, cap)
    except _Invalid as err:
        return error_response(st, err)
    except ApiError as err:
        return anthropic_error(st, err)
    msg = MsgCall(st.engine_name, st.fmt.new_id("chat"), model, len(tokens), output, call, named,
                  st.opts.report_cached_tokens)
    ticket = pump.submit(st, tokens, output)
    try:
        if body.get("stream"):
            return await pump.stream(request, st, ticket, MessagesStream(msg))
        return _json(msg.message(await pump.finish(ticket)))
    finally:
        pump.release(st, ticket)


async def count_tokens(request: web.Request) -> web.Response:
    st = request.app[SIM]
    try:
        _, tokens, _, _ = _prompt(st, await _body(request), count_only=True)
    except _Invalid as err:
        return error_response(st, err)
    except ApiError as err:
        return anthropic_error(st, err)
    n = len(tokens)
    if st.engine_name == "vllm":
        return _json({"input_tokens": n, "context_management": {"original_input_tokens": n}})
    return _json({"input_tokens": n})


def routes(engine: str) -> list[web.RouteDef]:
    if engine == "sglang":
        return []
    return [web.post("/v1/messages", messages),
            web.post("/v1/messages/count_tokens", count_tokens)]
