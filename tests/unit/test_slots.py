"""The upstream connection gate: slots taken at once while free, waiters served in order, none lost to a timeout
or a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from backends.slots import Slots


def later(s: float) -> float:
    return asyncio.get_running_loop().time() + s


async def test_free_slots_are_taken_without_waiting_then_waiters_queue_in_order():
    g = Slots(2)
    assert g.try_take() and g.try_take() and not g.try_take()
    order: list[int] = []

    async def one(i: int) -> None:
        await g.take(later(5))
        order.append(i)

    tasks = [asyncio.create_task(one(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert order == [] and g.free == 0
    for _ in range(3):
        g.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    g.release()
    g.release()
    assert g.free == 2


async def test_a_free_slot_is_not_taken_past_those_already_waiting():
    g = Slots(1)
    assert g.try_take()
    waiter = asyncio.create_task(g.take(later(5)))
    await asyncio.sleep(0)
    g.release()  # handed to the waiter, not to the free count
    assert g.free == 0 and not g.try_take()
    await waiter
    g.release()
    assert g.try_take()


async def test_a_wait_past_its_deadline_raises_and_leaves_no_trace():
    g = Slots(1)
    assert g.try_take()
    with pytest.raises(TimeoutError):
        await g.take(later(0.05))
    g.release()
    assert g.free == 1 and g.try_take()


async def test_a_waiter_cancelled_after_being_handed_a_slot_passes_it_on():
    g = Slots(1)
    assert g.try_take()
    first = asyncio.create_task(g.take(later(5)))
    second = asyncio.create_task(g.take(later(5)))
    await asyncio.sleep(0)
    g.release()  # to `first`, which is cancelled before it runs
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)  # the slot went on to the next in line
    g.release()
    assert g.free == 1


async def test_a_waiter_cancelled_while_waiting_leaves_the_line():
    g = Slots(1)
    assert g.try_take()
    w = asyncio.create_task(g.take(later(5)))
    await asyncio.sleep(0)
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    g.release()
    assert g.free == 1 and g.try_take()  # no stale waiter keeps the fast path shut
