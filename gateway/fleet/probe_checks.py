"""The support probe's chat checks: streams, usage, n, tools, JSON schema, logprobs and the context window."""

from __future__ import annotations

import math
from typing import Any

import orjson

from backends.openai_http import count
from gateway.errors import TOO_LONG_HINT
from gateway.fleet.probe_target import (
    CHAT,
    ERROR,
    NO,
    UNKNOWN,
    YES,
    Cell,
    CheckTable,
    Target,
    Verdict,
    clip,
)

COMPLETIONS = "/v1/completions"
PROMPT = "Say hi."
# Output tokens of a probe's request: enough to see a reply (and two stream chunks), little to compute.
MAX_TOKENS = 2
# A forced tool call or a schema-bound reply is a whole JSON object: it needs more room to close.
STRUCTURED_MAX_TOKENS = 64

TOOL = {"type": "function", "function": {
    "name": "pick_city", "description": "Pick a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}
# An enum leaves a constrained decoder little to choose but whitespace, so the object closes in few tokens.
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
JSON_TYPES = {"string": str}  # the types SCHEMA uses

# Plain words whose tokens repeat with the text, so prompt tokens grow in step with its characters.
FILLER = "the quick brown fox jumps over a lazy dog while seven wizards hum "
# The calibration prompt of the context check: at most half the window in characters (a tokenizer makes at
# most about one token of a plain ASCII character, so it fits), and no more than this, to keep its prefill cheap.
CALIBRATION_CHARS = 16_384


def chat_body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}


def first_choice(body: dict[str, Any]) -> dict[str, Any]:
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise Verdict(NO, "no choices in the reply")
    if not isinstance(choices[0], dict):
        raise Verdict(NO, "a choice is not an object")
    return choices[0]


def message_of(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The first choice's message, and " (cut at max_tokens)" when the engine stopped it at the cap."""
    choice = first_choice(body)
    message = choice.get("message")
    if not isinstance(message, dict):
        raise Verdict(NO, "no message in the choice")
    return message, " (cut at max_tokens)" if choice.get("finish_reason") == "length" else ""


def violation(value: Any, schema: dict[str, Any]) -> str:
    """Why `value` does not satisfy a flat object schema (required keys, property types, enums), or ""."""
    if not isinstance(value, dict):
        return "not a JSON object"
    properties = schema["properties"]
    for key in schema["required"]:
        if key not in value:
            return f"no {key!r} key"
    for key, v in value.items():
        prop = properties.get(key)
        if prop is None:
            if schema.get("additionalProperties") is False:
                return f"a key the schema does not allow: {clip(key)!r}"
            continue
        if not isinstance(v, JSON_TYPES[prop["type"]]):
            return f"{key!r} is not a {prop['type']}"
        if "enum" in prop and v not in prop["enum"]:
            return f"{key!r} is not one of {', '.join(map(str, prop['enum']))}"
    return ""


def parsed(text: Any, what: str, cut: str) -> Any:
    if not isinstance(text, str):
        raise Verdict(NO, f"no {what} string in the reply")
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        raise Verdict(NO, f"{what} is not JSON{cut}: {clip(text)}") from None


async def check_chat(t: Target) -> Cell:
    message_of(await t.post(CHAT, chat_body(t.model)))
    return Cell(YES)


async def check_completions(t: Target) -> Cell:
    body = {"model": t.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not isinstance(first_choice(await t.post(COMPLETIONS, body)).get("text"), str):
        raise Verdict(NO, "no text in the choice")
    return Cell(YES)


async def check_stream(t: Target) -> Cell:
    s = await t.stream(chat_body(t.model))
    if not any(isinstance(e.get("choices"), list) and e["choices"] for e in s.events):
        return Cell(NO, "no chunk with choices in the stream")
    return Cell(YES) if s.done else Cell(NO, "the stream ended without [DONE]")


async def check_stream_usage(t: Target) -> Cell:
    s = await t.stream(chat_body(t.model, stream_options={"include_usage": True}))
    if not any(isinstance(e.get("usage"), dict) for e in s.events):
        return Cell(NO, "no usage in the stream")
    return Cell(YES)


async def check_n(t: Target) -> Cell:
    # Sampled, not greedy: two greedy choices would be one answer twice, and vLLM refuses n > 1 at temperature 0.
    choices = (await t.post(CHAT, chat_body(t.model, n=2, temperature=1.0, seed=0))).get("choices")
    got = len(choices) if isinstance(choices, list) else 0
    return Cell(YES) if got == 2 else Cell(NO, f"{got} choices for n=2")


async def check_tools(t: Target) -> Cell:
    body = chat_body(t.model, max_tokens=STRUCTURED_MAX_TOKENS, tools=[TOOL],
                     tool_choice={"type": "function", "function": {"name": TOOL["function"]["name"]}})
    message, cut = message_of(await t.post(CHAT, body))
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return Cell(NO, f"no tool_calls in reply{cut}")
    function = calls[0].get("function") if isinstance(calls[0], dict) else None
    if not isinstance(function, dict):
        return Cell(NO, "a tool call without a function")
    if function.get("name") != TOOL["function"]["name"]:
        return Cell(NO, f"the call names {clip(str(function.get('name')))!r}, not the forced tool")
    arguments = parsed(function.get("arguments"), "arguments", cut)
    if not isinstance(arguments, dict):
        return Cell(NO, "arguments are not a JSON object")
    return Cell(YES)


async def check_json_schema(t: Target) -> Cell:
    body = chat_body(t.model, max_tokens=STRUCTURED_MAX_TOKENS, response_format={
        "type": "json_schema", "json_schema": {"name": "probe", "schema": SCHEMA, "strict": True}})
    message, cut = message_of(await t.post(CHAT, body))
    why = violation(parsed(message.get("content"), "content", cut), SCHEMA)
    return Cell(NO, f"content does not fit the schema: {why}") if why else Cell(YES)


async def check_logprobs(t: Target) -> Cell:
    choice = first_choice(await t.post(CHAT, chat_body(t.model, logprobs=True, top_logprobs=2)))
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        return Cell(NO, "no logprobs content in the reply")
    if not isinstance(content[0].get("logprob"), (int, float)):
        return Cell(NO, "a logprobs entry without a logprob")
    return Cell(YES)


def filler(chars: int) -> str:
    return (FILLER * (chars // len(FILLER) + 1))[:chars]


def prompt_tokens(body: dict[str, Any]) -> int | None:
    usage = body.get("usage")
    return count(usage.get("prompt_tokens")) if isinstance(usage, dict) else None


async def check_context(t: Target) -> Cell:
    """The window verified with at most three requests: one to learn the engine's tokens per character, one
    just under the window (must be served), one past it (must be refused as too long)."""
    window, source = await t.window()
    if window is None:
        return Cell(UNKNOWN, "the engine reports no window and max_context is not set")

    def body(chars: int) -> dict[str, Any]:
        return {"model": t.model, "messages": [{"role": "user", "content": filler(chars)}], "max_tokens": 1,
                "temperature": 0}

    c1 = max(min(window // 2, CALIBRATION_CHARS), 1)
    p1 = prompt_tokens(await t.post(CHAT, body(c1)))
    if p1 is None:
        return Cell(UNKNOWN, f"{window} ({source}) not verified: the engine reports no prompt_tokens", window)
    # Counting the chat template's tokens as the filler's overestimates tokens per character: the prompt
    # sized from it falls a little under its aim, and the margin covers the rest.
    per_char = p1 / c1
    top = window - 1 - max(32, window // 50)
    c2 = max(int(top / per_char), 1)
    try:
        p2 = prompt_tokens(await t.post(CHAT, body(c2)))
    except Verdict as v:
        if v.cell.verdict != NO:
            raise
        return Cell(NO, f"~{top} tokens refused under the window of {window} ({source}): {v.cell.reason}", window)
    fixed = 0.0
    if p2 is not None and c2 > c1 and p2 > p1:  # two points: the template's fixed tokens and the filler's rate
        per_char = (p2 - p1) / (c2 - c1)
        fixed = p1 - per_char * c1
    over = window + max(64, window // 20)
    c3 = max(math.ceil((over - fixed) / per_char), 1)
    accepted = f"{p2} tokens" if p2 is not None else f"~{top} tokens"
    try:
        await t.post(CHAT, body(c3))
    except Verdict as v:
        if v.cell.verdict == NO and TOO_LONG_HINT.search(v.cell.reason):  # the engines' wordings
            return Cell(YES, f"{window} ({source}): {accepted} served, ~{over} refused as too long", window)
        if v.cell.verdict != NO:
            raise
        return Cell(NO, f"~{over} tokens refused, not as too long: {v.cell.reason}", window)
    if source == "max_context":
        return Cell(YES, f"{window} (max_context) holds; the engine also served ~{over} tokens", window)
    return Cell(NO, f"~{over} tokens served, past the window of {window} the engine reports", window)


async def check_answers(adapter, timeout: float) -> tuple[Cell, bool]:
    """The engine's own health route (a model list for a plain OpenAI server); and whether it answered at all."""
    r = await adapter.probe(timeout, deep=True)
    if r.status == 200:
        return Cell(YES), True
    if r.status == 0:
        why = f"no answer within {timeout:g} s" if r.detail == "TimeoutError" else clip(r.detail) or "no answer"
        return Cell(ERROR, why), False
    detail = clip(r.detail)
    reason = detail if detail.startswith("HTTP ") else f"HTTP {r.status}: {detail}"
    return Cell(ERROR if r.status >= 500 else NO, reason, status=r.status), True


CHAT_CHECKS: CheckTable = {
    "chat": check_chat, "completions": check_completions, "stream": check_stream,
    "stream_usage": check_stream_usage, "n": check_n, "tools": check_tools, "json_schema": check_json_schema,
    "logprobs": check_logprobs, "context": check_context,
}
