"""OpenAI Responses API of a simulated engine: create (streamed, background), retrieve, cancel, input_tokens."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from gateway.sim import forced, pump
from gateway.sim import responses_fmt as rf
from gateway.sim.errors import ApiError
from gateway.sim.handlers import error_response, generating, read_json
from gateway.sim.parse import ParseContext, check_model, over_window, sglang_total_error
from gateway.sim.scheduler import SimRequest
from gateway.sim.state import SIM, SimState
from gateway.sim.store import Stored
from gateway.sim.tokens import encode, generate, render_chat

Messages = list[dict[str, Any]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _not_found(rid: str) -> ApiError:
    return ApiError(404, f"Response with id '{rid}' not found.", "invalid_request_error",
                    "response_id")


def _stored(st: SimState, rid: str) -> Stored:
    """The stored response of an id, or the engine's error for it."""
    # SGLang checks the prefix before it looks the id up.
    if st.engine_name == "sglang" and not rid.startswith("resp_"):
        raise ApiError(400, f"Invalid 'response_id': '{rid}'. Expected an ID that begins with 'resp'.",
                       "invalid_request_error", "response_id")
    stored = st.responses.get(rid)
    if stored is None:
        raise _not_found(rid)
    return stored


# -- request -> chat messages -----------------------------------------------------------------
def input_messages(engine: str, value: Any) -> Messages:
    """The chat messages of `input`, refused where the engine refuses them."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ApiError(400, "'input' must be a string or array of objects", param="input")
    out: Messages = []
    for item in value:
        if not isinstance(item, dict):
            raise ApiError(400, "Cannot determine type of 'item'", param="input")
        kind, role = item.get("type"), item.get("role")
        if kind == "function_call":
            text = f"{item.get('name')}({item.get('arguments')})"
            out.append({"role": "assistant", "content": text})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "content": output if isinstance(output, str)
                        else orjson.dumps(output).decode()})
        elif kind == "reasoning":
            continue
        elif role in ("user", "system", "developer", "assistant"):
            if engine == "llamacpp" and role == "assistant" and kind != "message":
                # llama-server recognises an assistant turn only as a typed output message.
                raise ApiError(400, "Cannot determine type of 'item'", param="input")
            out.append({"role": role, "content": _content_text(engine, role, item.get("content"))})
        else:
            raise ApiError(400, "Cannot determine type of 'item'", param="input")
    return out


def _content_text(engine: str, role: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, "'content' must be a string or an array of content parts", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "input_file" and engine == "llamacpp":
            raise ApiError(400, "'input_file' is not supported by llamacpp at this moment")
        elif kind in ("input_image", "input_file", "input_audio", "refusal"):
            parts.append(f"<{kind}>")
        elif engine == "llamacpp":
            allowed = ("'output_text' or 'refusal'" if role == "assistant"
                       else "'input_text', 'input_image', or 'input_file'")
            raise ApiError(400, f"'type' must be one of {allowed}")
        else:
            raise ApiError(400, f"Unsupported content part type: {kind!r}", param="input")
    return "".join(parts)


def _output_message(item: dict[str, Any]) -> dict[str, Any]:
    """A stored output item, as the assistant turn the next request's prompt replays."""
    if item.get("type") == "function_call":
        return {"role": "assistant", "content": f"{item.get('name')}({item.get('arguments')})"}
    return {"role": "assistant",
            "content": "".join(p.get("text", "") for p in item.get("content", []))}


def _context_error(st: SimState, n_in: int, limit: int | None) -> ApiError | None:
    """Each engine's refusal of a prompt (and, on SGLang, of max_output_tokens) its context cannot hold; vLLM and
    llama-server cap the output at the room left instead (tests/e2e/OBSERVED.md)."""
    n = st.profile.slot_ctx() if st.engine_name == "llamacpp" else st.profile.max_model_len
    if n_in < n:
        if st.engine_name == "vllm":
            return over_window(n, limit, "max_output_tokens")
        return sglang_total_error(n, n_in, limit) if st.engine_name == "sglang" else None
    if st.engine_name == "vllm":
        return ApiError(400, f"The engine prompt length {n_in} exceeds the max_model_len {n}. "
                             "Please reduce prompt.", "invalid_request_error", "input")
    if st.engine_name == "llamacpp":
        return ApiError(400, f"request ({n_in} tokens) exceeds the available context size "
                             f"({n} tokens), try increasing it", "exceed_context_size_error",
                        n_prompt_tokens=n_in, n_ctx=n)
    return ApiError(400, f"The input ({n_in} tokens) is longer than the model's context length "
                         f"({n} tokens).")


def _int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ApiError(400, f"'{key}' must be an integer", param=key)
    return value


def prepare(st: SimState, body: dict[str, Any]) -> tuple[rf.RespCall, Messages, list[int]]:
    """Validate a create request; the call, its conversation and its prompt tokens."""
    engine = st.engine_name
    ctx: ParseContext = st.parse_ctx
    if "input" not in body:
        raise ApiError(400, "'input' is required", param="input")
    model = check_model(ctx, body)
    prev_id = body.get("previous_response_id")
    if engine == "llamacpp" and prev_id:
        raise ApiError(400, "llama.cpp does not support 'previous_response_id'.")
    history: Messages = []
    if prev_id is not None:
        stored = _stored(st, str(prev_id))
        history = [m for m in stored.messages if m.get("role") != "system"]
        history += [_output_message(item) for item in stored.response.get("output", [])]
    messages: Messages = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    messages += history + input_messages(engine, body["input"])
    tools = forced.responses_tools(body)
    constraint = forced.responses_constraint(engine, body, tools)
    tokens = encode(render_chat(messages, True, forced.tools_text(tools)))
    limit = _int(body, "max_output_tokens")
    if limit is not None and limit < 1:
        raise ApiError(400, f"max_output_tokens must be at least 1, got {limit}.",
                       param="max_output_tokens")
    error = _context_error(st, len(tokens), limit)
    if error is not None:
        raise error
    room = (st.profile.slot_ctx() if engine == "llamacpp" else st.profile.max_model_len) - len(tokens)
    cap = min(limit, room) if limit is not None else room
    seed = _int(body, "seed") or 0
    output = generate(st.opts.seed, tokens, cap, bool(body.get("ignore_eos", False)), (), seed)
    call = None
    if constraint is not None:
        output, call = forced.realize(constraint, engine, "responses", st.opts.seed, tokens, cap, seed)
    store = bool(body.get("store", True)) and st.stores_responses
    return (rf.RespCall(engine, model, body, len(tokens), output, call, cap, store,
                        str(prev_id) if prev_id is not None else None), messages, tokens)


# -- handlers ---------------------------------------------------------------------------------
@generating()
async def create(request: web.Request, st: SimState) -> web.StreamResponse:
    try:
        body = await read_json(request)
        call, messages, tokens = prepare(st, body)
        background = bool(body.get("background", False))
        if background and st.engine_name == "vllm" and not call.store:
            raise ApiError(400, "This vLLM engine does not support `store=True` and therefore "
                                "does not support the background mode. To enable these features, "
                                "set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` "
                                "when launching the vLLM server.",
                           "invalid_request_error", "background")
    except ApiError as err:
        return error_response(st, err)
    ticket = pump.submit(st, tokens, call.output)

    def final(req: SimRequest) -> dict[str, Any]:
        use = rf.usage(st.engine_name, call.prompt_tokens, req.cached, req.generated)
        obj = rf.response_object(call, rf.final_status(call), rf.output_items(call), use)
        if call.store:
            st.responses.put(call.rid, Stored(obj, messages))
        return obj

    if background and not body.get("stream"):
        return _json(_start_background(st, call, messages, ticket, final))
    try:
        if body.get("stream"):
            return await pump.stream(request, st, ticket, rf.ResponsesStream(call, final))
        return _json(final(await pump.finish(ticket)))
    finally:
        pump.release(st, ticket)


def _start_background(st: SimState, call: rf.RespCall, messages: Messages, ticket: Any,
                      final: Any) -> dict[str, Any]:
    """Answer with the queued response at once; the generation goes on and updates the stored one."""
    queued = rf.response_object(call, "queued", [], None)
    item = Stored(queued, messages)
    st.responses.put(call.rid, item)

    async def run() -> None:
        try:
            item.response = {**queued, "status": "in_progress"}
            req = await pump.finish(ticket)
            if item.response.get("status") != "cancelled":
                item.response = final(req)
        finally:
            pump.release(st, ticket)

    item.task = asyncio.get_running_loop().create_task(run(), name=f"sim-{call.rid}")
    return queued


async def retrieve(request: web.Request) -> web.Response:
    st = request.app[SIM]
    rid = request.match_info["response_id"]
    try:
        stored = _stored(st, rid)
    except ApiError as err:
        return error_response(st, err)
    return _json(stored.response)


async def cancel(request: web.Request) -> web.Response:
    st = request.app[SIM]
    rid = request.match_info["response_id"]
    try:
        stored = _stored(st, rid)
        if stored.response.get("status") not in ("queued", "in_progress"):
            raise ApiError(400, "Cannot cancel a synchronous response.", "invalid_request_error",
                           "response_id" if st.engine_name == "vllm" else None)
    except ApiError as err:
        return error_response(st, err)
    stored.response = {**stored.response, "status": "cancelled"}
    if stored.task is not None:
        stored.task.cancel()  # its finally aborts the request in the scheduler
    return _json(stored.response)


async def input_tokens(request: web.Request) -> web.Response:
    """llama-server's /v1/responses/input_tokens: the prompt a create would run, counted."""
    st = request.app[SIM]
    try:
        body = await read_json(request)
        _, _, tokens = prepare(st, body)
    except ApiError as err:
        return error_response(st, err)
    return _json({"object": "response.input_tokens", "input_tokens": len(tokens)})


def routes(engine: str) -> list[web.RouteDef]:
    if engine == "llamacpp":
        return [web.post("/v1/responses", create), web.post("/responses", create),
                web.post("/v1/responses/input_tokens", input_tokens),
                web.post("/responses/input_tokens", input_tokens)]
    return [web.post("/v1/responses", create), web.get("/v1/responses/{response_id}", retrieve),
            web.post("/v1/responses/{response_id}/cancel", cancel)]
