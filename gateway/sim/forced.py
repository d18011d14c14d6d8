"""Constrained decoding: forced tool calls and JSON answers, read from chat, Responses and Messages bodies."""

from __future__ import annotations

import random
import secrets
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.sim.errors import ApiError
from gateway.sim.instances import instance
from gateway.sim.tokens import Output, fixed_output, prompt_seed

_ALNUM = string.ascii_letters + string.digits
# `json_object` asks for any JSON object: the simulated model writes a one-key answer.
_ANY_OBJECT = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@dataclass(frozen=True)
class Constraint:
    """What the grammar forces: a call of one tool, or a JSON value (schema None: any object)."""

    kind: str  # "tool" or "json"
    name: str = ""
    schema: Any = None
    named: bool = False  # the request named the function (vLLM then keeps finish_reason "stop")


@dataclass(frozen=True)
class ToolCall:
    name: str
    call_id: str
    arguments: str


@dataclass(frozen=True)
class Tool:
    name: str
    schema: Any


def call_id(engine: str, api: str) -> str:
    """A tool call id the way each engine spells it."""
    if engine == "llamacpp":
        return "".join(secrets.choice(_ALNUM) for _ in range(32))
    if engine == "sglang" or api == "responses":
        return "call_" + uuid.uuid4().hex[:24]
    return "chatcmpl-tool-" + uuid.uuid4().hex


def realize(c: Constraint, engine: str, api: str, seed: int, prompt: Sequence[int], cap: int,
            request_seed: int = 0) -> tuple[Output, ToolCall | None]:
    """The output constrained decoding writes for this prompt: the same prompt gives the same value."""
    rng = random.Random(prompt_seed(seed, prompt, request_seed) ^ 0x70015)
    schema = c.schema if c.schema is not None else _ANY_OBJECT
    text = orjson.dumps(instance(schema, rng)).decode()
    output = fixed_output(text, cap)
    if c.kind == "json":
        return output, None
    return output, ToolCall(c.name, call_id(engine, api), output.text)


def tools_text(tools: Sequence[Tool]) -> str:
    """Tool definitions as the chat template renders them into the prompt (they cost input tokens)."""
    if not tools:
        return ""
    return orjson.dumps([{"name": t.name, "parameters": t.schema} for t in tools]).decode()


# -- OpenAI chat ------------------------------------------------------------------------------
def chat_tools(body: dict[str, Any]) -> list[Tool]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of function tools", param="tools")
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, "each tool needs a 'function' with a 'name'", param="tools")
        out.append(Tool(fn["name"], fn.get("parameters") or {"type": "object", "properties": {}}))
    return out


def chat_constraint(engine: str, body: dict[str, Any], tools: list[Tool]) -> Constraint | None:
    choice = body.get("tool_choice")
    named = _named(choice, nested=True)
    if choice == "required" or named is not None:
        if not tools:
            raise ApiError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return _forced_tool(tools, named, "chat")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            spec = {}
        return Constraint("json", schema=spec.get("schema", spec.get("schema_")))
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return Constraint("json")
    return None


# -- OpenAI Responses -------------------------------------------------------------------------
def responses_tools(body: dict[str, Any]) -> list[Tool]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be an array of objects", param="tools")
    # Non-function tools (web search, file search) have no local equivalent: they are skipped.
    return [Tool(t["name"], t.get("parameters") or {"type": "object", "properties": {}})
            for t in tools if isinstance(t, dict) and t.get("type") == "function"
            and isinstance(t.get("name"), str)]


def responses_constraint(engine: str, body: dict[str, Any], tools: list[Tool]) -> Constraint | None:
    choice = body.get("tool_choice", "auto")
    named = _named(choice, nested=False)
    if (choice == "required" or named is not None) and (tools or engine != "llamacpp"):
        names = {t.name for t in tools}
        if choice == "required" and not tools:
            raise ApiError(400, "Tool choice 'required' must be specified with 'tools' parameter.",
                           param="tool_choice")
        if named is not None and named not in names and engine != "llamacpp":
            raise ApiError(400, "Tool choice 'function' not found in 'tools' parameter.",
                           param="tool_choice")
        return _forced_tool(tools, named, "responses")
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return Constraint("json", schema=fmt.get("schema"))
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return Constraint("json")
    return None


# -- Anthropic Messages -----------------------------------------------------------------------
def anthropic_tools(body: dict[str, Any]) -> list[Tool]:
    tools = body.get("tools")
    if not isinstance(tools, list):
        return []
    return [Tool(t["name"], t.get("input_schema") or {"type": "object"})
            for t in tools if isinstance(t, dict) and isinstance(t.get("name"), str)]


def anthropic_constraint(engine: str, body: dict[str, Any], tools: list[Tool]) -> Constraint | None:
    choice = body.get("tool_choice")
    if not isinstance(choice, dict) or choice.get("type") not in ("any", "tool") or not tools:
        return None
    kind = choice["type"]
    if kind == "tool" and engine != "llamacpp":
        # vLLM maps {"type": "tool"} onto a named function choice; llama-server maps both "any" and
        # "tool" onto "required", so the name is not honoured there.
        return _forced_tool(tools, str(choice.get("name")), "chat")
    return _forced_tool(tools, None, "chat")


def _named(choice: Any, nested: bool) -> str | None:
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    name = (choice.get("function") or {}).get("name") if nested else choice.get("name")
    return name if isinstance(name, str) else None


def _forced_tool(tools: list[Tool], named: str | None, api: str) -> Constraint:
    if named is None:
        # "required": the grammar lets the model pick; the simulated model picks the first tool.
        return Constraint("tool", tools[0].name, tools[0].schema)
    for tool in tools:
        if tool.name == named:
            return Constraint("tool", tool.name, tool.schema, named=True)
    if api == "chat":
        raise ApiError(400, f"Tool '{named}' has not been passed in `tools`.", param="tool_choice")
    return Constraint("tool", tools[0].name, tools[0].schema, named=True)
