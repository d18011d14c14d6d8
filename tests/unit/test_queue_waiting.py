"""The queue's waiting, without a network: seats held for a grant and given back, a client that leaves at the worst
moment (its future cancelled before its task runs), and the bounds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from gateway.config_queue import AdmissionConfig, QueueConfig, QueueSettings
from gateway.errors import GatewayError
from gateway.queueing.waiting import WaitQueue


@dataclass
class Backend:
    in_flight: int = 1
    seats: int | None = 1
    load_in_flight: int = 0
    peak_running: int = 0
    full_at: int = 0
    held: int = 0
    capped: int = 0
    interactive: bool = False
    assumed: int = 0
    held_by_share: bool = False

    def usable(self, now: float) -> bool:
        return True

    def fresh_load(self, now: float):
        return None


@dataclass(frozen=True)
class Shape:
    klass: str = "default"
    model: str = "m"
    session_id: str | None = None
    prompt_tokens: int = 10


@dataclass(frozen=True)
class Caller:
    id: str = "k"
    priority: str | None = None
    priority_header: bool = False


def queue(**cfg) -> tuple[WaitQueue, QueueSettings]:
    qs = QueueSettings(QueueConfig(**cfg), AdmissionConfig())
    return WaitQueue(lambda: qs), qs


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_grant_holds_the_seat_until_the_request_goes_out():
    q, qs = queue()
    b = Backend()
    assert q.admit_now({}, Caller(), Shape(), [b], 0.0, qs) is None  # its one seat is taken: it waits
    waiter = asyncio.create_task(q.wait({}, Caller(), Shape(), [b], 0.0, qs))
    await settle()
    assert q.length == 1 and b.held == 0
    b.in_flight = 0  # the request on it ended
    q.wake()
    await asyncio.sleep(0)  # the pass: granted, the seat held for it
    assert b.held == 1 and q.length == 0
    assert await waiter == [b]
    assert b.held == 0  # given back as it goes out (its attempt takes the seat for real)


async def test_a_client_that_leaves_as_its_seat_comes_is_never_granted():
    q, qs = queue()
    b = Backend()
    waiter = asyncio.create_task(q.wait({}, Caller(), Shape(), [b], 0.0, qs))
    await settle()
    b.in_flight = 0
    waiter.cancel()  # its future is cancelled now; its task's own clean-up runs later
    q._pass()  # a pass in between: nothing granted, nothing raised
    assert b.held == 0
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert q.length == 0 and q.by_model == {}
    assert q.report()["priorities"]["normal"]["ended"]["left"]["count"] == 1


async def test_past_its_length_a_request_is_refused_at_once():
    q, qs = queue(max_length=1)
    b = Backend()
    first = asyncio.create_task(q.wait({}, Caller(), Shape(), [b], 0.0, qs))
    await settle()
    with pytest.raises(GatewayError) as e:
        await q.wait({}, Caller(), Shape(), [b], 0.0, qs)
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert q.length == 0


def test_an_interactive_backend_keeps_a_seat_for_sessions_before_any_was_seen():
    q, qs = queue()
    b = Backend(in_flight=0, seats=2, interactive=True)
    assert q.open(b, "long_output", "m", 1.0, qs)  # two free: one may go to another class
    b.in_flight = 1
    assert not q.open(b, "long_output", "m", 1.0, qs)  # the last one is kept for a session's first turn
    assert q.open(b, "interactive", "m", 1.0, qs)
    assert q.open(b, "long_output", "m", 1.0, qs, elsewhere=False)  # nowhere else to go: nothing kept from it
    q0 = WaitQueue(lambda: qs0)
    qs0 = QueueSettings(QueueConfig(), AdmissionConfig(), keep_interactive=0)  # the shape policy keeps none
    assert q0.open(b, "long_output", "m", 1.0, qs0)


def test_a_seat_share_on_an_assumed_count_marks_the_backend_held_back():
    from gateway.contracts import LoadSample

    class Loaded(Backend):
        def fresh_load(self, now: float):
            return LoadSample(running=3, waiting=0, total_slots=None, at=now)

    q, qs = queue()
    q.demand["m"] = 1.0  # another class came in lately: long outputs keep to their share
    b = Loaded(in_flight=0, seats=None, peak_running=3)
    assert q.open(b, "long_output", "m", 1.0, qs) and not b.held_by_share  # share of 4 assumed: 2
    b.capped = b.in_flight = 2
    assert not q.open(b, "long_output", "m", 1.0, qs) and b.held_by_share
