"""Per-key usage over the stats window: counts, the window's edge, the cap on distinct keys, merging processes."""

from __future__ import annotations

import logging

from gateway.contracts import ENGINE_ERROR, Outcome, RequestShape
from gateway.stats.key_usage import FIELDS, MAX_COUNT, OTHER, SLOTS, KeyUsage, merge_usage

SHAPE = RequestShape("m", "chat", False, 10, 10, "default", principal="k1")


def served(prompt: int = 10, completion: int = 5, result: str = "ok") -> Outcome:
    return Outcome("b", SHAPE, result == "ok", 200 if result == "ok" else 500, e2e=0.1, prompt_tokens=prompt,
                   completion_tokens=completion, result=result)


def test_attempts_errors_refusals_and_tokens_add_up_per_key():
    u = KeyUsage(60.0)
    u.add("k1", served(10, 5), 100.0)
    u.add("k1", served(0, 0, ENGINE_ERROR), 101.0)
    u.add("k2", served(7, 3), 102.0)
    u.refuse("k1", 103.0)
    assert u.summary(104.0, 60.0) == {"k1": [2, 1, 1, 10, 5], "k2": [1, 0, 0, 7, 3]}


def test_counts_leave_the_window_and_idle_keys_leave_memory():
    u = KeyUsage(60.0)
    u.add("old", served(), 0.0)
    u.add("new", served(), 50.0)
    assert set(u.summary(55.0, 60.0)) == {"old", "new"}
    # One slot (60 s / SLOTS) past the window, the old key's attempt is out, and so is the key.
    later = 60.0 + 60.0 / SLOTS + 0.1
    assert set(u.summary(later, 60.0)) == {"new"}
    assert "old" not in u._rows


def test_a_key_keeps_at_most_a_window_of_slots():
    u = KeyUsage(60.0)
    for t in range(0, 600, 2):
        u.add("k", served(), float(t))
    assert len(u._rows["k"]) <= SLOTS + 1
    assert u.summary(599.0, 60.0)["k"][0] == 30  # one attempt every 2 s over 60 s


def test_keys_beyond_the_cap_are_counted_together_under_other():
    u = KeyUsage(60.0, max_keys=3)
    for i in range(10):
        u.add(f"k{i}", served(1, 1), 10.0)
    s = u.summary(11.0, 60.0)
    assert set(s) == {"k0", "k1", "k2", OTHER} and s[OTHER][0] == 7
    # Once the window has moved on, the first keys leave and others get a line of their own.
    u.add("k9", served(), 200.0)
    assert set(u.summary(201.0, 60.0)) == {"k9"}


def test_a_changed_window_starts_the_counts_again():
    u = KeyUsage(60.0)
    u.add("k", served(), 10.0)
    assert u.summary(11.0, 30.0) == {}
    u.add("k", served(), 12.0)
    assert u.summary(13.0, 30.0) == {"k": [1, 0, 0, 10, 5]}


def test_processes_add_up_and_a_malformed_one_is_left_out(caplog):
    good = {"worker": "1", "keys": {"k": [2, 1, 0, 20, 10]}}
    other = {"worker": "2", "keys": {"k": [1, 0, 1, 5, 5], "j": [1, 0, 0, 1, 1]}}
    old = {"worker": "3"}  # a process that publishes no per-key figures (an older version)
    bad = [{"worker": "4", "keys": {"k": [1, 2]}}, {"worker": "5", "keys": {"k": [1, 0, 0, -1, 0]}},
           {"worker": "6", "keys": {"k": [True, 0, 0, 0, 0]}}, {"worker": "7", "keys": ["k"]},
           {"worker": "8", "keys": {"k": [MAX_COUNT + 1, 0, 0, 0, 0]}}]
    with caplog.at_level(logging.WARNING, logger="shapegate.stats"):
        merged = merge_usage([good, other, old, *bad])
    assert merged == {"k": dict(zip(FIELDS, [3, 1, 1, 25, 15])), "j": dict(zip(FIELDS, [1, 0, 0, 1, 1]))}
    assert sum("per-key figures of worker" in r.getMessage() for r in caplog.records) == len(bad)
