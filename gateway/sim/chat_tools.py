"""Forced tool calls in chat completions: each engine's message, stream deltas and finish_reason."""

from __future__ import annotations

from typing import Any

from gateway.sim.forced import ToolCall


def finish_reason(engine: str, output_reason: str, named: bool) -> str:
    """finish_reason of a forced call.

    vLLM reports "tool_calls" for `tool_choice: "required"` only; a call forced by name keeps "stop"
    (its serving code follows OpenAI there). SGLang and llama-server report "tool_calls" whenever
    the message holds a call. A call cut by max_tokens stays "length" everywhere.
    """
    if output_reason != "stop":
        return output_reason
    if engine == "vllm" and named:
        return "stop"
    return "tool_calls"


def message_fields(engine: str, call: ToolCall) -> dict[str, Any]:
    """The `content` and `tool_calls` of a non-streamed assistant message holding the call."""
    fn = {"name": call.name, "arguments": call.arguments}
    if engine == "vllm":
        return {"content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": fn}]}
    if engine == "sglang":
        return {"content": None, "tool_calls": [{"id": call.call_id, "index": 0, "type": "function",
                                                 "function": fn}]}
    return {"content": None, "tool_calls": [{"type": "function", "function": fn, "id": call.call_id}]}


def delta(call: ToolCall, piece: str, first: bool) -> dict[str, Any]:
    """The stream delta of output token `i`: the first names the call, the rest extend its arguments.

    All three engines stream calls in the OpenAI chunk form; the simulator sends the name with the
    first argument piece, so that every delta still carries exactly one generated token.
    """
    if first:
        entry: dict[str, Any] = {"index": 0, "id": call.call_id, "type": "function",
                                 "function": {"name": call.name, "arguments": piece}}
    else:
        entry = {"index": 0, "function": {"arguments": piece}}
    return {"tool_calls": [entry]}
