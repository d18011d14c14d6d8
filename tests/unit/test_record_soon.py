"""The record stage runs at the end of the loop turn in which attempts ended, for every one of them."""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp

from gateway.config import parse_config
from gateway.contracts import Outcome, RequestShape
from gateway.runtime import Gateway, build_policy

CONFIG = {"auth": {"enabled": False}, "stats": {"warmup_samples": 0},
          "backends": [{"id": "e", "engine": "openai", "url": "http://127.0.0.1:9", "models": ["m"]}]}
SHAPE = RequestShape("m", "chat", False, 8, 16, "default")
OUTCOME = Outcome("e", SHAPE, True, 200, e2e=0.03, prompt_tokens=8, completion_tokens=16)


async def _gateway() -> tuple[Gateway, object]:
    cfg = parse_config(CONFIG, build_policy)
    async with aiohttp.ClientSession() as session:  # (an engine adapter is made on the client session)
        g = Gateway(cfg, session)
        b = g.make_backend(cfg.backends[0])
    g.pool.add(b)  # (nothing here sends a request)
    return g, b


async def test_attempts_ended_in_one_turn_are_recorded_at_its_end():
    g, b = await _gateway()
    for _ in range(3):
        g.record_soon((b, SHAPE, OUTCOME, 0.0, 0.0001, None))
    assert b.latency.samples == 0  # the turn has not ended
    await asyncio.sleep(0)
    assert b.latency.samples == 3
    assert g.metrics.requests.labels("e", "m", "default", "200", "ok").value == 3
    g.record_soon((b, SHAPE, OUTCOME, 0.0, 0.0001, None))  # a later turn starts a batch of its own
    await asyncio.sleep(0)
    assert b.latency.samples == 4


async def test_a_record_that_fails_loses_none_of_the_others(caplog):
    g, b = await _gateway()
    g.record_soon((b, SHAPE, OUTCOME, 0.0, 0.0001, None))
    g.record_soon((b, None, OUTCOME, 0.0, 0.0001, None))  # no shape: record fails on it
    g.record_soon((b, SHAPE, OUTCOME, 0.0, 0.0001, None))
    with caplog.at_level(logging.ERROR, logger="shapegate"):
        await asyncio.sleep(0)
    assert g.metrics.requests.labels("e", "m", "default", "200", "ok").value == 2
    # (the compiled build checks the shape's declared type before any attribute of it is read)
    error = "TypeError" if os.environ.get("SHAPEGATE_COMPILED") == "1" else "AttributeError"
    assert [r.getMessage() for r in caplog.records] == [f"recording an attempt failed: {error}"]
