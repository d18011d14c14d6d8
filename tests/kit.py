"""Waiting in a test: poll a condition until it holds, never sleep a guessed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def until(check: Callable[[], Any | Awaitable[Any]], what: str = "the condition", *, timeout: float = 5.0,
                every: float = 0.02) -> Any:
    """Poll `check` (a plain function, or one returning an awaitable) until it returns something true, and
    return that; fail naming `what` once `timeout` seconds have passed without it."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(every)
