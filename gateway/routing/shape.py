"""Request body -> RequestShape: cheap token estimates, expected output, session, prefix hashes and class (pure)."""

from __future__ import annotations

from typing import Any, Final, Mapping
from zlib import adler32, crc32

import orjson

from gateway.apis import bodies
from gateway.apis.table import GENERATING
from gateway.config import ShapeConfig
from gateway.contracts import DEFAULT, INTERACTIVE, LONG_OUTPUT, LONG_PROMPT, RequestShape
from gateway.errors import bad_request

# English text averages about four characters per token across the common BPE vocabularies.
CHARS_PER_TOKEN: Final = 4
CHAT_FAMILY: Final = frozenset({"chat", "completions", "embeddings"})
# Per-message template overhead (role markers, separators) in tokens, as chat templates render it.
MESSAGE_OVERHEAD_TOKENS: Final = 4


def _json_text(value: Any, param: str) -> str:
    """A JSON value as text (sized and hashed like any prompt text); nesting deeper than orjson writes is a 400."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        raise bad_request(f"'{param}' is nested too deeply.", param=param) from None


def _role_text(role: Any) -> str:
    return role if isinstance(role, str) else _json_text(role, "messages")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: only text parts count
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_parts(route: str, body: Mapping[str, Any]) -> tuple[list[str], int]:
    """The prompt as pieces in order (joined, the canonical prompt text that is sized and hashed) and how many
    messages it had (template overhead). The pieces are the body's own strings: nothing is copied."""
    if route == "chat":
        parts: list[str] = []
        tools = body.get("tools")
        n = 0
        if tools:  # templates render tool definitions into the system prefix
            parts += ("<tools>", _json_text(tools, "tools"))
            n += 1
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                parts += ("<", _role_text(m.get("role", "")), ">", _content_text(m.get("content")))
                n += 1
        return parts, n
    other = bodies.prompt_parts(route, body)
    if other is not None:
        return other
    prompt = body.get("prompt") if route == "completions" else body.get("input")
    if isinstance(prompt, list):
        return [p for p in prompt if isinstance(p, str)], 0
    return [prompt if isinstance(prompt, str) else ""], 0


def prompt_text(route: str, body: Mapping[str, Any]) -> tuple[str, int]:
    """The prompt as one canonical string, and how many messages it had."""
    parts, n = prompt_parts(route, body)
    return "".join(parts), n


def prompt_size(route: str, body: Mapping[str, Any]) -> tuple[int, int]:
    """len() of prompt_text's string and its message count, without building the string."""
    parts, n = prompt_parts(route, body)
    return sum(map(len, parts)), n


def prefix_hashes(model: str, salt: str, text: str, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """Chained 63-bit hashes of whole fixed-size character blocks: equal hash i means equal first i+1 blocks.

    Two running checksums (CRC-32 and Adler-32) over the same bytes, side by side: one 32-bit chain alone
    collides too often for an index of ~10^5 prefixes. Both are stable across processes (replicas share
    them through Redis), unlike Python's salted hash().
    """
    n = min(len(text) // block_chars, max_blocks)
    if n == 0:
        return ()
    seed = f"{model}\x00{salt}\x00".encode()
    c, a = crc32(seed), adler32(seed)
    out = []
    data = text[: n * block_chars].encode("utf-8", "surrogatepass")
    # Block boundaries in characters, not bytes, so that the same text always splits the same way.
    ascii_only = len(data) == n * block_chars
    for i in range(n):
        block = data[i * block_chars:(i + 1) * block_chars] if ascii_only else \
            text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass")
        c = crc32(block, c)
        a = adler32(block, a)
        out.append(((c & 0x7FFFFFFF) << 32) | a)
    return tuple(out)


def session_key(model: str, session: str) -> int:
    """A session id as a 63-bit key in the same space as prefix hashes (never equal to one: other seed)."""
    data = f"\x01session\x00{model}\x00{session}".encode("utf-8", "surrogatepass")
    return ((crc32(data) & 0x7FFFFFFF) << 32) | adler32(data)


def requested_output(body: Mapping[str, Any], route: str = "chat") -> int | None:
    asked = bodies.requested_output(route, body)
    if asked is not False:  # (False: a chat-family route, read below)
        return None if asked is True else asked
    for name in ("max_completion_tokens", "max_tokens", "n_predict"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def session_of(body: Mapping[str, Any], headers: Mapping[str, str], route: str = "chat") -> str | None:
    sid = headers.get("x-session-id")
    if sid:
        return sid
    if route not in CHAT_FAMILY:
        return bodies.session(route, body)
    for name in ("prompt_cache_key", "user"):
        v = body.get(name)
        if isinstance(v, str) and v:
            return v
    return None


def classify(*, route: str, body: Mapping[str, Any], session: str | None, principal: str,
             cfg: ShapeConfig, learned_output: float | None = None, session_in_flight: int = 0,
             want_prefix: bool = True) -> RequestShape:
    """`session` is the request's session id (session_of), found once by the caller."""
    model = body["model"]
    stream = body.get("stream") is True
    generates = route in GENERATING
    if want_prefix and generates:
        text, n_messages = prompt_text(route, body)
        chars = len(text)
    else:  # only the size matters: the prompt is not copied into one string
        text, (chars, n_messages) = "", prompt_size(route, body)
    prompt_tokens = chars // CHARS_PER_TOKEN + MESSAGE_OVERHEAD_TOKENS * n_messages + 1
    asked = requested_output(body, route) if generates else None
    if not generates:
        output = 0
    elif asked is not None:
        output = asked
    else:
        output = int(learned_output) if learned_output else cfg.default_output_tokens
    if not generates:
        klass = DEFAULT
    elif stream and session and session_in_flight == 0 and output < cfg.long_output_tokens:
        klass = INTERACTIVE
    elif prompt_tokens >= cfg.long_prompt_tokens and prompt_tokens >= cfg.prefill_ratio * output:
        klass = LONG_PROMPT
    elif output >= cfg.long_output_tokens:
        klass = LONG_OUTPUT
    else:
        klass = DEFAULT
    hashes: tuple[int, ...] = ()
    if want_prefix and generates:
        salt = body.get("cache_salt")
        hashes = prefix_hashes(model, salt if isinstance(salt, str) else "", text,
                               cfg.prefix_block_chars, cfg.max_prefix_blocks)
    return RequestShape(model=model, route=route, stream=stream, prompt_tokens=prompt_tokens,
                        output_tokens=output, klass=klass, principal=principal,
                        session_id=session, prefix_hashes=hashes, max_output=asked)
