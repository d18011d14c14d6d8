"""The index of stored responses in one process: bounded (least recent out), expiring, deletions forgotten."""

from __future__ import annotations

import time

from gateway.routing.stored import StoredResponse, StoredResponses


async def test_bounded_least_recent_first_out():
    idx = StoredResponses(max_entries=16, ttl_s=60)
    for i in range(20):
        idx.remember(f"resp_{i}", "b0", "user", "m")
    assert await idx.find("resp_0") is None and await idx.find("resp_3") is None
    assert (await idx.find("resp_4")).backend == "b0"  # found: now the most recent
    idx.remember("resp_new", "b1", "user", "m")
    assert await idx.find("resp_4") is not None and await idx.find("resp_5") is None


async def test_expired_and_deleted_ids_are_not_found():
    idx = StoredResponses(max_entries=16, ttl_s=60)
    idx.remember("resp_a", "b0", "user", "m")
    idx.remember("resp_b", "b0", "user", "m")
    idx._local["resp_a"].at = time.monotonic() - 61
    assert await idx.find("resp_a") is None
    idx.forget("resp_b")
    assert await idx.find("resp_b") is None


def test_record_round_trip_and_malformed():
    rec = StoredResponse("b0", "user", "m", 0.0)
    back = StoredResponse.decode(rec.encode(), 1.0)
    assert (back.backend, back.owner, back.model) == ("b0", "user", "m")
    assert StoredResponse.decode(b"only-one-field", 1.0) is None
