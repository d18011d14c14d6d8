"""Prefix caches: chained block hashes (vLLM blocks, SGLang one-token pages) and llama.cpp's per-slot prompt."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockCache:
    """Longest cached prefix in whole blocks, LRU-evicted, keyed by a hash chained over blocks.

    With 16-token blocks this is vLLM's automatic prefix cache (only full blocks count). With
    one-token blocks it matches exactly what SGLang's radix tree (page_size 1) would match: the
    chain makes each entry stand for its whole prefix, so the longest hit is the longest shared
    token prefix still resident.
    """

    def __init__(self, block_tokens: int, capacity_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.block_tokens = block_tokens
        self.capacity_blocks = max(capacity_tokens // block_tokens, 1)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks) * self.block_tokens

    def _chain(self, tokens: Sequence[int]):
        size = self.block_tokens
        parent = 0
        if size == 1:
            for tok in tokens:
                parent = hash((parent, tok))
                yield parent
            return
        for start in range(0, len(tokens) - size + 1, size):
            parent = hash((parent, tuple(tokens[start:start + size])))
            yield parent

    def match(self, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` already cached, refreshing the matched blocks' LRU position.

        At least one prompt token is always computed (its logits start the output), so the
        hit never covers the whole prompt.
        """
        usable = tokens[: max(len(tokens) - 1, 0)]
        hit = 0
        blocks = self._blocks
        for key in self._chain(usable):
            if key not in blocks:
                break
            blocks.move_to_end(key)
            hit += 1
        return hit * self.block_tokens

    def insert(self, tokens: Sequence[int]) -> None:
        """Cache every full block of `tokens` (most recent last), evicting the oldest beyond capacity."""
        blocks = self._blocks
        for key in self._chain(tokens):
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    # Compare in strides first: prompts that share a prefix usually share a long one.
    step = 64
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotCache:
    """llama.cpp's prompt cache: each slot keeps the tokens of its last request.

    A new request goes to the idle slot whose cached tokens share the largest fraction of its
    prompt, if that fraction reaches the similarity threshold (-sps); otherwise to the least
    recently used idle slot. The common prefix is reused; at least one token is recomputed.
    """

    def __init__(self, slots: int, similarity: float = 0.1) -> None:
        self.tokens: list[Sequence[int]] = [() for _ in range(slots)]
        self.last_used: list[int] = [0] * slots
        self.similarity = similarity
        self._tick = 0

    def choose(self, prompt: Sequence[int], idle: Sequence[int]) -> tuple[int, int]:
        """(slot, reusable tokens) for a prompt among the idle slots."""
        best, best_lcp = -1, 0
        if prompt:
            for slot in idle:
                lcp = common_prefix(prompt, self.tokens[slot])
                if lcp > best_lcp:
                    best, best_lcp = slot, lcp
        if best < 0 or best_lcp / max(len(prompt), 1) < self.similarity:
            best = min(idle, key=lambda s: self.last_used[s])
            best_lcp = common_prefix(prompt, self.tokens[best])
        return best, self.reusable(prompt, best, best_lcp)

    def reusable(self, prompt: Sequence[int], slot: int, lcp: int | None = None) -> int:
        if lcp is None:
            lcp = common_prefix(prompt, self.tokens[slot])
        return min(lcp, max(len(prompt) - 1, 0))

    def store(self, slot: int, tokens: Sequence[int]) -> None:
        self._tick += 1
        self.tokens[slot] = tokens
        self.last_used[slot] = self._tick
