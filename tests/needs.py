"""Skips CI never takes: a test that cannot run says why, and under CI=true a missing dependency fails it."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest
import redis.asyncio as redis_asyncio

REDIS_URL = "redis://127.0.0.1:6379/0"  # the machine's shared Redis (CI starts one if none answers)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_or_fail(reason: str) -> NoReturn:
    """Skip with the reason on a workstation; fail under CI, where everything the tests need is installed."""
    if in_ci():
        pytest.fail(f"CI is set but {reason}")
    pytest.skip(reason)


async def redis_up(url: str = REDIS_URL) -> bool:
    """Whether a Redis answers at `url` (within half a second)."""
    client = redis_asyncio.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        return bool(await client.ping())
    except (OSError, redis_asyncio.RedisError):
        return False
    finally:
        await client.aclose()
