"""The queue's ordering core: priority first, a weighted fair share across keys within a priority, the soonest due
time within a key; a waiter taken out leaves no trace, and an idle key banks no credit."""

from __future__ import annotations

import pytest

from gateway.queueing.order import FairOrder


def drain(order: FairOrder) -> list:
    """Serve every waiter, first first, as the queue's pass does (the order is read again after each grant)."""
    out = []
    while order.length:
        w = next(order.in_order())
        order.grant(w)
        out.append(w.item)
    return out


def fair(weights: dict[str, float] | None = None, levels: int = 3) -> FairOrder:
    return FairOrder(levels, lambda key: (weights or {}).get(key, 1.0))


def test_a_higher_priority_goes_first_whatever_its_arrival():
    o = fair()
    o.add(2, "k", 0.0, "low")
    o.add(1, "k", 0.0, "normal")
    o.add(0, "k", 0.0, "high")
    assert drain(o) == ["high", "normal", "low"]


def test_a_flooding_key_waits_behind_a_key_that_sends_few():
    o = fair()
    for i in range(6):
        o.add(1, "flood", 0.0, f"f{i}")
    o.add(1, "polite", 0.0, "p0")
    o.add(1, "polite", 0.0, "p1")
    order = drain(o)
    assert order[:4] == ["f0", "p0", "f1", "p1"]  # taking turns, not p0 behind all six
    assert order[4:] == ["f2", "f3", "f4", "f5"]


def test_weights_give_a_key_its_share():
    o = fair({"big": 3.0})
    for i in range(8):
        o.add(1, "big", 0.0, f"b{i}")
        o.add(1, "small", 0.0, f"s{i}")
    first_eight = drain(o)[:8]
    assert sum(x.startswith("b") for x in first_eight) == 6  # three to one


def test_within_a_key_the_soonest_due_goes_first_then_arrival():
    o = fair()
    o.add(1, "k", 5.0, "bulk")
    o.add(1, "k", 1.0, "agent")
    o.add(1, "k", 1.0, "agent-later")
    assert drain(o) == ["agent", "agent-later", "bulk"]


def test_an_idle_key_banks_no_credit():
    o = fair()
    for i in range(4):  # busy alone for a while: its virtual time moves on
        o.add(1, "a", 0.0, f"a{i}")
    assert drain(o) == ["a0", "a1", "a2", "a3"]
    for i in range(3):
        o.add(1, "a", 0.0, f"a{i + 4}")
    for i in range(3):  # b never sent before: it starts at the level's time, not at zero...
        o.add(1, "b", 0.0, f"b{i}")
    # ...so the two take turns from now on, rather than b going first for everything it did not send before.
    assert drain(o) == ["b0", "a4", "b1", "a5", "b2", "a6"]


def test_a_removed_waiter_is_gone_and_its_key_not_charged():
    o = fair()
    gone = o.add(1, "a", 0.0, "a0")
    o.add(1, "a", 0.0, "a1")
    o.add(1, "b", 0.0, "b0")
    o.remove(gone)
    o.remove(gone)  # twice is once
    assert o.length == 2
    assert o.level_lengths() == [0, 2, 0] and o.key_lengths() == {"a": 1, "b": 1}
    assert drain(o) == ["a1", "b0"]
    assert o.length == 0 and o.key_lengths() == {}


@pytest.mark.parametrize("n", [1, 50])
def test_lengths_follow_adds_grants_and_removals(n):
    o = fair()
    ws = [o.add(i % 3, f"k{i % 4}", float(i), i) for i in range(n)]
    assert o.length == n and sum(o.level_lengths()) == n
    o.remove(ws[0])
    assert sorted(drain(o)) == list(range(1, n))
    assert o.level_lengths() == [0, 0, 0]
