"""Request body -> RequestShape: cheap token estimates, expected output, session, prefix hashes and class (pure)."""

from __future__ import annotations

from typing import Any, Final, Mapping
from zlib import adler32, crc32

from gateway.apis.api import Api
from gateway.config import ShapeConfig
from gateway.contracts import DEFAULT, INTERACTIVE, LONG_OUTPUT, LONG_PROMPT, RequestShape

# English text averages about four characters per token across the common BPE vocabularies.
CHARS_PER_TOKEN: Final = 4
# Per-message template overhead (role markers, separators) in tokens, as chat templates render it.
MESSAGE_OVERHEAD_TOKENS: Final = 4


def prompt_text(api: Api, body: Mapping[str, Any]) -> tuple[str, int]:
    """The prompt as one canonical string (the API's prompt parts joined), and how many messages it had."""
    parts, n = api.prompt_parts(body)
    return "".join(parts), n


def prompt_size(api: Api, body: Mapping[str, Any]) -> tuple[int, int]:
    """len() of prompt_text's string and its message count, without building the string."""
    parts, n = api.prompt_parts(body)
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


def session_of(api: Api, body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The request's session: the `x-session-id` header, else what the API's body names."""
    sid = headers.get("x-session-id")
    return sid if sid else api.session(body)


def classify(*, api: Api, body: Mapping[str, Any], session: str | None, principal: str,
             cfg: ShapeConfig, learned_output: float | None = None, session_in_flight: int = 0,
             want_prefix: bool = True) -> RequestShape:
    """`session` is the request's session id (session_of), found once by the caller."""
    model = body["model"]
    stream = body.get("stream") is True
    generates = api.generating
    if want_prefix and generates:
        text, n_messages = prompt_text(api, body)
        chars = len(text)
    else:  # only the size matters: the prompt is not copied into one string
        text, (chars, n_messages) = "", prompt_size(api, body)
    prompt_tokens = chars // CHARS_PER_TOKEN + MESSAGE_OVERHEAD_TOKENS * n_messages + 1
    pair = api.fit_parts(body)  # (rerank, score: each pair must fit the window, not all of them together)
    fit_tokens = prompt_tokens if pair is None else \
        sum(map(len, pair[0])) // CHARS_PER_TOKEN + MESSAGE_OVERHEAD_TOKENS * pair[1] + 1
    asked = api.requested_output(body) if generates else None
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
    return RequestShape(model=model, route=api.name, stream=stream, prompt_tokens=prompt_tokens,
                        output_tokens=output, klass=klass, principal=principal,
                        session_id=session, prefix_hashes=hashes, max_output=asked, fit_tokens=fit_tokens)
