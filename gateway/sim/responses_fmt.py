"""Responses-API wire format per engine: the Response object, its output items and its SSE events."""

from __future__ import annotations

import secrets
import string
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.sim.forced import ToolCall
from gateway.sim.scheduler import SimRequest
from gateway.sim.tokens import Output

_ALNUM = string.ascii_letters + string.digits


def _rand(n: int = 32) -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(n))


@dataclass
class RespCall:
    """One /v1/responses request, as the formatter needs it."""

    engine: str
    model: str
    body: dict[str, Any]
    prompt_tokens: int
    output: Output
    tool_call: ToolCall | None
    max_output_tokens: int
    store: bool
    previous_response_id: str | None = None
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    item_id: str = ""  # the message or function-call item id while streaming
    final_item_id: str = ""  # the id the finished item carries (vLLM mints a new one)

    def __post_init__(self) -> None:
        llama = self.engine == "llamacpp"
        self.rid = self.rid or "resp_" + (_rand() if llama else uuid.uuid4().hex)
        if self.tool_call is not None:
            self.item_id = "fc_" + (_rand() if llama else uuid.uuid4().hex)
            self.final_item_id = self.item_id
        elif self.engine == "vllm":
            # vLLM streams its item under a bare uuid and rebuilds the finished item as msg_<uuid>.
            self.item_id, self.final_item_id = uuid.uuid4().hex, "msg_" + uuid.uuid4().hex
        else:
            self.item_id = "msg_" + (_rand() if llama else uuid.uuid4().hex)
            self.final_item_id = self.item_id


def output_items(call: RespCall, status: str = "completed", final: bool = True) -> list[dict[str, Any]]:
    """The response's `output`: one message, or one function call."""
    item_id = call.final_item_id if final else call.item_id
    tc = call.tool_call
    if tc is not None:
        return [{"type": "function_call", "id": item_id, "call_id": tc.call_id, "name": tc.name,
                 "arguments": tc.arguments if status == "completed" else "", "status": status}]
    return [message_item(call.engine, item_id, call.output.text if status == "completed" else "",
                         status)]


def message_item(engine: str, item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [text_part(engine, text, done=True)] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "content": content, "status": status}


def text_part(engine: str, text: str, done: bool) -> dict[str, Any]:
    if engine == "llamacpp":
        if not done:
            return {"type": "output_text", "text": text}
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None if done else []}


def usage(engine: str, prompt: int, cached: int, generated: int) -> dict[str, Any]:
    out = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
           "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": prompt + generated}
    if engine == "vllm":
        out["input_tokens_details"] = {"cached_tokens": cached, "input_tokens_per_turn": [prompt],
                                       "cached_tokens_per_turn": [cached]}
        out["output_tokens_details"] = {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                        "output_tokens_per_turn": [generated],
                                        "tool_output_tokens_per_turn": [0]}
    return out


def response_object(call: RespCall, status: str, output: list[dict[str, Any]],
                    use: dict[str, Any] | None) -> dict[str, Any]:
    """The Response object: vLLM's and SGLang's echo the request; llama-server's is fixed."""
    body = call.body
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    if call.engine == "llamacpp":
        text = "".join(p["text"] for item in output if item["type"] == "message"
                       for p in item["content"])
        return {
            "completed_at": int(time.time()) if status == "completed" else None,
            "created_at": call.created, "id": call.rid, "model": call.model, "object": "response",
            "output": output, "output_text": text, "status": status,
            "usage": use or usage("llamacpp", 0, 0, 0), "incomplete_details": incomplete,
            "previous_response_id": None, "instructions": None, "error": None, "tools": [],
            "tool_choice": "auto", "truncation": "disabled", "parallel_tool_calls": False,
            "text": {"format": {"type": "text"}}, "top_p": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "top_logprobs": 0, "temperature": 1.0, "reasoning": None,
            "max_output_tokens": None, "max_tool_calls": None, "store": False, "background": False,
            "service_tier": "default", "safety_identifier": None, "prompt_cache_key": None,
            "metadata": {},
        }
    tools = body.get("tools") or []
    choice = body.get("tool_choice", "auto")
    if not tools and choice in ("auto", "none"):
        choice = "none"  # the request validator rewrites it so when no tool is given
    obj: dict[str, Any] = {
        "id": call.rid, "created_at": call.created, "incomplete_details": incomplete,
        "instructions": body.get("instructions"), "metadata": body.get("metadata"),
        "model": call.model, "object": "response", "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0), "tool_choice": choice, "tools": tools,
        "top_p": body.get("top_p", 1.0), "background": bool(body.get("background", False)),
        "max_output_tokens": call.max_output_tokens, "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": call.previous_response_id, "prompt": None,
        "reasoning": body.get("reasoning"), "service_tier": body.get("service_tier", "auto"),
        "status": status, "text": body.get("text"), "top_logprobs": None,
        "truncation": body.get("truncation", "disabled"), "usage": use, "user": body.get("user"),
        "presence_penalty": body.get("presence_penalty", 0.0),
        "frequency_penalty": body.get("frequency_penalty", 0.0),
    }
    if call.engine == "vllm":
        obj.update({"kv_transfer_params": None, "ec_transfer_params": None,
                    "input_messages": None, "output_messages": None})
    else:
        obj["store"] = call.store
    return obj


def final_status(call: RespCall) -> str:
    """vLLM marks a reply cut by max_output_tokens incomplete; SGLang and llama-server (with text) do not."""
    return "incomplete" if call.engine == "vllm" and call.output.finish_reason == "length" else "completed"


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class ResponsesStream:
    """The SSE events of a streamed response; `final` builds (and stores) the finished object."""

    def __init__(self, call: RespCall, final: Callable[[SimRequest], dict[str, Any]]) -> None:
        self.call = call
        self.final = final
        self.seq = 0

    def _ev(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event(kind, data)

    def opening(self) -> list[bytes]:
        c = self.call
        use = usage("llamacpp", 0, 0, 0) if c.engine == "llamacpp" else None
        obj = response_object(c, "in_progress", [], use)
        return [self._ev("response.created", response=obj),
                self._ev("response.in_progress", response=obj)]

    def tokens(self, start: int, stop: int) -> list[bytes]:
        c = self.call
        out = []
        if start == 0:
            item = output_items(c, "in_progress", final=False)[0]
            out.append(self._ev("response.output_item.added", output_index=0, item=item))
            if c.tool_call is None:
                out.append(self._ev("response.content_part.added", output_index=0, content_index=0,
                                    item_id=c.item_id, part=text_part(c.engine, "", done=False)))
        for piece in c.output.pieces[start:stop]:
            if not piece:
                continue
            if c.tool_call is not None:
                out.append(self._ev("response.function_call_arguments.delta", output_index=0,
                                    item_id=c.item_id, delta=piece))
            elif c.engine == "llamacpp":
                out.append(self._ev("response.output_text.delta", output_index=0, content_index=0,
                                    item_id=c.item_id, delta=piece))
            else:
                out.append(self._ev("response.output_text.delta", output_index=0, content_index=0,
                                    item_id=c.item_id, delta=piece, logprobs=[]))
        return out

    def closing(self, req: SimRequest) -> list[bytes]:
        c = self.call
        item = output_items(c, "completed", final=False)[0]
        tc = c.tool_call
        if tc is not None:
            out = [self._ev("response.function_call_arguments.done", output_index=0,
                            item_id=c.item_id, arguments=tc.arguments, name=tc.name)]
        else:
            text = c.output.text
            out = [self._ev("response.output_text.done", output_index=0, content_index=0,
                            item_id=c.item_id, text=text, logprobs=[]),
                   self._ev("response.content_part.done", output_index=0, content_index=0,
                            item_id=c.item_id, part=text_part(c.engine, text, done=True))]
        out.append(self._ev("response.output_item.done", output_index=0, item=item))
        out.append(self._ev("response.completed", response=self.final(req)))
        return out

    def error(self, sent: int) -> bytes:
        message = "Simulated mid-stream engine error"
        if self.call.engine == "llamacpp":
            # llama-server reports a failure inside a Responses stream as a bare `data:` error line.
            return b"data: " + orjson.dumps({"error": {"code": 500, "message": message,
                                                       "type": "server_error"}}) + b"\n\n"
        self.seq = sent  # numbered after the events that went out, not the ones the fault cut
        return self._ev("error", code="InternalServerError", message=message, param=None)
