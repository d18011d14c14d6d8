"""The record stage runs at the end of the loop turn in which attempts ended, for every one of them."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from gateway.config import parse_config
from gateway.contracts import Outcome, RequestShape
from gateway.runtime import Gateway, build_policy

CONFIG = {"auth": {"enabled": False}, "stats": {"warmup_samples": 0},
          "backends": [{"id": "e", "engine": "openai", "url": "http://127.0.0.1:9", "models": ["m"]},
                       {"id": "f", "engine": "openai", "url": "http://127.0.0.1:9", "models": ["m"]}]}
SHAPE = RequestShape("m", "chat", False, 8, 16, "default")
OUTCOME = Outcome("e", SHAPE, True, 200, e2e=0.03, prompt_tokens=8, completion_tokens=16)


async def _gateway() -> tuple[Gateway, object, object]:
    cfg = parse_config(CONFIG, build_policy)
    async with aiohttp.ClientSession() as session:  # (an engine adapter is made on the client session)
        g = Gateway(cfg, session)
        b, f = (g.make_backend(bc) for bc in cfg.backends)
    g.pool.add(b)  # (nothing here sends a request)
    g.pool.add(f)
    return g, b, f


async def test_attempts_ended_in_one_turn_are_recorded_at_its_end():
    g, b, _ = await _gateway()
    for _ in range(3):
        g.record_soon(b, SHAPE, OUTCOME, 0.0, 0.0001, None)
    assert b.latency.samples == 0  # the turn has not ended
    await asyncio.sleep(0)
    assert b.latency.samples == 3
    assert g.metrics.requests.labels("e", "m", "default", "200", "ok", "chat").value == 3
    g.record_soon(b, SHAPE, OUTCOME, 0.0, 0.0001, None)  # a later turn starts a batch of its own
    await asyncio.sleep(0)
    assert b.latency.samples == 4


async def test_a_record_that_fails_loses_none_of_the_others(caplog):
    g, b, f = await _gateway()
    g.record_soon(b, SHAPE, OUTCOME, 0.0, 0.0001, None)
    # An experiment without arms to look up: record fails on it (an attempt's other fields are typed: compiled,
    # a wrong one is refused when the attempt is made, before it reaches the batch).
    g.record_soon(f, SHAPE, OUTCOME, 0.0, 0.0001, object())  # type: ignore[arg-type]
    g.record_soon(b, SHAPE, OUTCOME, 0.0, 0.0001, None)
    with caplog.at_level(logging.ERROR, logger="shapegate"):
        await asyncio.sleep(0)
    assert g.metrics.requests.labels("e", "m", "default", "200", "ok", "chat").value == 2
    assert [r.getMessage() for r in caplog.records] == ["recording an attempt failed: AttributeError"]
