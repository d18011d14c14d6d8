"""Request validation per engine: model names, token limits, stream options, context length, stop strings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.sim import forced
from gateway.sim.errors import ApiError
from gateway.sim.profiles import Profile
from gateway.sim.tokens import Output, encode, generate, render_chat


@dataclass
class GenRequest:
    """A validated generation request, ready for the scheduler."""

    kind: str
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    tokens: list[int]
    output: Output
    slot_hint: int = -1
    cache_prompt: bool = True
    inband_error: ApiError | None = None  # SGLang: reported inside a 200 stream
    tool_call: forced.ToolCall | None = None  # when the grammar forced a function call
    named_tool: bool = False  # the call was forced by name, not by "required"


@dataclass(frozen=True)
class ParseContext:
    engine: str
    profile: Profile
    names: tuple[str, ...]
    seed: int


def _int_field(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{key}' must be an integer", param=key)
    return value


def check_model(ctx: ParseContext, body: dict[str, Any]) -> str:
    """The model name to echo; vLLM and SGLang refuse names they do not serve, llama.cpp serves any as its alias."""
    model = body.get("model")
    if ctx.engine == "llamacpp":
        return ctx.names[0]  # any name is served, and the reply names the server's own alias
    if model is None:
        return ctx.names[0]
    if model not in ctx.names:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    return model


def _limit(ctx: ParseContext, body: dict[str, Any]) -> int | None:
    """The requested output cap, as each engine reads it."""
    if ctx.engine == "llamacpp":
        # llama.cpp reads max_tokens, then its own n_predict; -1 means no limit.
        value = _int_field(body, "max_tokens")
        value = _int_field(body, "n_predict") if value is None else value
        return None if value is None or value < 0 else max(value, 1)
    value = _int_field(body, "max_completion_tokens")
    value = _int_field(body, "max_tokens") if value is None else value
    if value is not None and value < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {value}.", param="max_tokens")
    return value


def _stream_flags(ctx: ParseContext, body: dict[str, Any]) -> tuple[bool, bool, bool]:
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    if ctx.engine == "vllm":
        if options is not None and not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                           param="stream_options")
        # vLLM 0.32: `stream_options: {}` alone sends no usage, and continuous stats need include_usage too.
        options = options or {}
        include = bool(options.get("include_usage", False))
        continuous = include and bool(options.get("continuous_usage_stats", False))
        return stream, include, continuous
    include = bool(options.get("include_usage", False)) if options else False
    return stream, include, False


def _prompt_tokens(kind: str, body: dict[str, Any], tools: str = "") -> list[int]:
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "'messages' must be a non-empty list of objects", param="messages")
        return encode(render_chat(messages, bool(body.get("add_generation_prompt", True)), tools))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ApiError(400, "'prompt' must be a non-empty string or list of token ids "
                        "(the simulator serves one prompt per request)", param="prompt")


def over_window(n: int, limit: int | None, name: str) -> ApiError | None:
    """vLLM 0.32 refuses an output cap past its whole window (a cap past the room a prompt leaves it takes as the
    room), naming the field the cap came in (seen: max_tokens, max_completion_tokens, max_output_tokens)."""
    if limit is None or limit <= n:
        return None
    return ApiError(400, f"{name}={limit} cannot be greater than max_model_len={n}. Please request fewer output "
                         f"tokens. (parameter={name}, value={limit})", "BadRequestError", param=name)


def context_error(ctx: ParseContext, n_in: int, limit: int | None, limit_name: str = "max_tokens") -> ApiError | None:
    p = ctx.profile
    if ctx.engine == "llamacpp":
        n_ctx = p.slot_ctx()
        if n_in >= n_ctx:
            return ApiError(400, f"request ({n_in} tokens) exceeds the available context size "
                                 f"({n_ctx} tokens), try increasing it",
                            "exceed_context_size_error", n_prompt_tokens=n_in, n_ctx=n_ctx)
        return None
    n = p.max_model_len
    if ctx.engine == "vllm":
        # vLLM 0.32 stops counting at the limit + 1, and caps max_tokens at the room left rather
        # than refusing it; a prompt that fills the context exactly leaves a cap of 0.
        if n_in > n:
            return ApiError(400, f"This model's maximum context length is {n} tokens. However, your "
                                 f"prompt contains at least {n + 1} input tokens, which exceeds this "
                                 "limit even without any output tokens. Please reduce the length of "
                                 f"the input prompt. (parameter=input_tokens, value={n + 1})",
                            param="input_tokens")
        if n_in == n:
            return ApiError(400, "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                            param="max_tokens")
        return over_window(n, limit, limit_name)
    if n_in >= n:
        return ApiError(400, f"The input ({n_in} tokens) is longer than the model's context "
                             f"length ({n} tokens).")
    return sglang_total_error(n, n_in, limit)


def sglang_total_error(n: int, n_in: int, limit: int | None) -> ApiError | None:
    """SGLang refuses a prompt and output cap that together pass its context, on every generating route (its
    tokenizer manager's check): max_tokens, max_completion_tokens, max_output_tokens alike."""
    if limit is not None and n_in + limit > n:
        return ApiError(400, f"Requested token count exceeds the model's maximum context length "
                             f"of {n} tokens. You requested a total of {n_in + limit} tokens: "
                             f"{n_in} tokens from the input messages and {limit} tokens for the "
                             "completion. Please reduce the number of tokens in the input "
                             "messages or the completion to fit within the limit.")
    return None


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")


def parse_generation(ctx: ParseContext, kind: str, body: dict[str, Any]) -> GenRequest:
    """Validate a chat or text completion body the way the engine would; raises ApiError."""
    model = check_model(ctx, body)
    stream, include_usage, continuous = _stream_flags(ctx, body)
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, "the simulator serves n=1 only", param="n")
    limit = _limit(ctx, body)
    tools = forced.chat_tools(body) if kind == "chat" else []
    constraint = forced.chat_constraint(ctx.engine, body, tools) if kind == "chat" else None
    tokens = _prompt_tokens(kind, body, forced.tools_text(tools))
    named = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    error = context_error(ctx, len(tokens), limit, named)
    inband = None
    if error is not None:
        if not (ctx.engine == "sglang" and stream):
            raise error
        inband = error  # SGLang opens the stream before its tokenizer manager validates
    room = (ctx.profile.slot_ctx() if ctx.engine == "llamacpp" else ctx.profile.max_model_len)
    room = max(room - len(tokens), 1)
    cap = min(limit, room) if limit is not None else room
    seed = _int_field(body, "seed") or 0
    output = generate(ctx.seed, tokens, cap, bool(body.get("ignore_eos", False)), _stops(body), seed)
    call = None
    if constraint is not None:
        output, call = forced.realize(constraint, ctx.engine, "chat", ctx.seed, tokens, cap, seed)
    slot = _int_field(body, "id_slot") if ctx.engine == "llamacpp" else None
    return GenRequest(kind, model, stream, include_usage, continuous, tokens, output,
                      slot_hint=slot if slot is not None else -1,
                      cache_prompt=bool(body.get("cache_prompt", True)), inband_error=inband,
                      tool_call=call, named_tool=bool(constraint and constraint.named))
