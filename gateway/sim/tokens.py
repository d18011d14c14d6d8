"""The simulator's own tokenizer, ChatML-like chat template, deterministic output text and embeddings."""

from __future__ import annotations

import math
import random
import re
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

VOCAB = 151_936
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_IDS = {IM_START: 151_644, IM_END: 151_645}
EOS_ID = SPECIAL_IDS[IM_END]

# Word pieces of at most four letters (with their leading space), digits in threes and single
# punctuation marks: English text comes out near four characters per token, like a real BPE.
_PIECE = re.compile(r"<\|im_(?:start|end)\|>| ?[^\W\d_]{1,4}| ?\d{1,3}| ?[^\w\s]|\s+|.", re.S)

# Output vocabulary: short words, so that re-tokenizing the text gives back one token per word.
_WORDS = (
    "the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "at",
    "by", "this", "from", "or", "data", "node", "fast", "load", "slot", "next", "step", "gate",
    "path", "time", "plan", "each", "one", "two", "more", "less", "then", "when", "so", "we",
    "can", "run", "will", "keep", "best", "part", "rate", "tune", "sum", "back", "line", "turn",
    "map", "key", "page", "test", "work", "safe", "warm", "cold", "long", "wide",
)


def encode(text: str) -> list[int]:
    """Token ids of a text: stable across processes (crc32, not Python's salted hash)."""
    special = SPECIAL_IDS
    out = []
    for piece in _PIECE.findall(text):
        tid = special.get(piece)
        out.append(tid if tid is not None else zlib.crc32(piece.encode()) % 151_643)
    return out


def split_pieces(text: str) -> list[str]:
    """A text cut the way `encode` cuts it: one piece per token."""
    return _PIECE.findall(text)


def fixed_output(text: str, limit: int) -> Output:
    """Output that spells a given text (a tool call's arguments, a JSON answer), cut at `limit` tokens.

    A cut text ends with "length", as a real engine's constrained decoding does when max_tokens runs out.
    """
    pieces = split_pieces(text) or [""]
    reason = "stop"
    if len(pieces) > limit:
        pieces, reason = pieces[:max(limit, 1)], "length"
    ids = tuple(zlib.crc32(p.encode()) % 151_643 for p in pieces)
    return Output(tuple(pieces), ids, reason, None)


def words(rng: random.Random, n: int) -> str:
    """`n` words of the output vocabulary, space separated."""
    return " ".join(_WORDS[rng.randrange(len(_WORDS))] for _ in range(n))


def message_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content list (other parts count as a marker)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict):
                parts.append(f"<{part.get('type', 'part')}>")
        return "".join(parts)
    return str(content)


def render_chat(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                tools: str = "") -> str:
    """The fixed ChatML-like template every simulated engine applies to chat messages (and tools)."""
    out = [f"{IM_START}tools\n{tools}{IM_END}\n"] if tools else []
    for msg in messages:
        role = str(msg.get("role", "user"))
        out.append(f"{IM_START}{role}\n{message_text(msg.get('content'))}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


@dataclass(frozen=True)
class Output:
    """What a request will generate: one text piece per token, and why it stops."""

    pieces: tuple[str, ...]
    ids: tuple[int, ...]
    finish_reason: str  # "stop" or "length"
    stop_string: str | None  # the stop string that ended it, if any

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def prompt_seed(seed: int, prompt: Sequence[int], extra: int = 0) -> int:
    """Seed of a request's output: the simulator seed, the prompt, and the request's own seed."""
    return zlib.crc32(array("I", prompt).tobytes(), (seed * 1_000_003 + extra) & 0xFFFFFFFF)


def natural_length(rng: random.Random) -> int:
    """How many tokens a request writes before its end-of-sequence token."""
    return 12 + rng.randrange(69)


def generate(
    seed: int, prompt: Sequence[int], limit: int, ignore_eos: bool = False,
    stop: Sequence[str] = (), request_seed: int = 0,
) -> Output:
    """Deterministic output for a prompt: the same seed and prompt always give the same text."""
    rng = random.Random(prompt_seed(seed, prompt, request_seed))
    natural = natural_length(rng)
    count = limit if ignore_eos else min(limit, natural)
    reason = "length" if count == limit and (ignore_eos or natural > limit) else "stop"
    words = _WORDS
    pieces = [words[rng.randrange(len(words))].capitalize()]
    pieces += [" " + words[rng.randrange(len(words))] for _ in range(count - 1)]
    stop_string = None
    if stop:
        pieces, stop_string = _cut_at_stop(pieces, stop)
        if stop_string is not None:
            reason = "stop"
    ids = tuple(zlib.crc32(p.encode()) % 151_643 for p in pieces)
    return Output(tuple(pieces), ids, reason, stop_string)


def _cut_at_stop(pieces: list[str], stops: Sequence[str]) -> tuple[list[str], str | None]:
    """Cut the output at the first stop string.

    The token that completes the stop string is still generated (it counts in usage), but the
    stop string itself is not returned, so the last pieces may be empty.
    """
    full = "".join(pieces)
    hits = [(full.find(s), s) for s in stops if s and s in full]
    if not hits:
        return pieces, None
    at, stop = min(hits)
    end = at + len(stop)
    kept: list[str] = []
    pos = 0
    for piece in pieces:
        kept.append(piece[: max(0, at - pos)])
        pos += len(piece)
        if pos >= end:
            break
    return kept, stop


def embed(text: str, dim: int = 16) -> list[float]:
    """A deterministic unit vector for a text (for pass-through tests, not for meaning)."""
    rng = random.Random(zlib.crc32(text.encode()))
    vec = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [round(v / norm, 6) for v in vec]
