"""Stored Responses-API responses of one engine: in memory, oldest evicted first past a bound."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

# vLLM and SGLang keep every stored response forever (their own comments call it a leak); the
# simulator runs for hours under benchmarks, so it forgets the oldest past this many.
MAX_STORED = 2048


@dataclass
class Stored:
    """A stored response: its object as GET returns it, and the conversation that led to it."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]  # input messages, for previous_response_id
    task: asyncio.Task[Any] | None = None  # a background generation still running
    extra: dict[str, Any] = field(default_factory=dict)


class ResponseStore:
    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, rid: str) -> Stored | None:
        return self._items.get(rid)

    def put(self, rid: str, item: Stored) -> None:
        self._items[rid] = item
        self._items.move_to_end(rid)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def cancel_all(self) -> None:
        """Stop background generations still running (the engine is shutting down)."""
        for item in self._items.values():
            if item.task is not None and not item.task.done():
                item.task.cancel()

    def __len__(self) -> int:
        return len(self._items)
