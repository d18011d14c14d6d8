"""The index of engine-kept responses in one process: bounded (least recent out), expiring, deletions forgotten, one
owner's ids invisible to another."""

from __future__ import annotations

import time

from gateway.state.engine_index import StoredResponse, StoredResponses


async def test_bounded_least_recent_first_out():
    idx = StoredResponses(max_entries=16, ttl_s=60)
    for i in range(20):
        idx.remember(f"resp_{i}", "b0", "user", "m")
    assert await idx.find("user", "resp_0") is None and await idx.find("user", "resp_3") is None
    assert (await idx.find("user", "resp_4")).backend == "b0"  # found: now the most recent
    idx.remember("resp_new", "b1", "user", "m")
    assert await idx.find("user", "resp_4") is not None and await idx.find("user", "resp_5") is None


async def test_expired_deleted_and_foreign_ids_are_not_found():
    idx = StoredResponses(max_entries=16, ttl_s=60)
    idx.remember("resp_a", "b0", "user", "m")
    idx.remember("resp_b", "b0", "user", "m")
    idx._local[("user", "resp_a")].at = time.monotonic() - 61
    assert await idx.find("user", "resp_a") is None
    idx.forget("user", "resp_b")
    assert await idx.find("user", "resp_b") is None
    idx.remember("resp_c", "b0", "user", "m")
    assert await idx.find("other", "resp_c") is None  # another owner's id is no id at all


def test_record_round_trip_and_malformed():
    rec = StoredResponse("b0", "m", 0.0)
    back = StoredResponse.decode(rec.encode(), 1.0)
    assert (back.backend, back.model) == ("b0", "m")
    assert StoredResponse.decode(b"only-one-field", 1.0) is None
    assert StoredResponse.decode(b"\nm", 1.0) is None
