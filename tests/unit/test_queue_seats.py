"""A backend's free seats as the queue sees them, and a request's priority and deadline as its headers give them."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gateway.contracts import LoadSample
from gateway.errors import GatewayError
from gateway.queueing.priority import deadline_of, level_of
from gateway.queueing.seats import room, seat_count, share_basis

NOW = 100.0


@dataclass
class Backend:
    in_flight: int = 0
    load_in_flight: int = 0
    seats: int | None = None
    peak_running: int = 0
    full_at: int = 0
    held: int = 0
    capped: int = 0
    assumed: int = 0
    held_by_share: bool = False
    load: LoadSample | None = field(default=None)

    def fresh_load(self, now: float) -> LoadSample | None:
        return self.load


def sample(running=None, waiting=None, total_slots=None) -> LoadSample:
    return LoadSample(running=running, waiting=waiting, total_slots=total_slots, at=NOW)


@pytest.mark.parametrize("b, free", [
    (Backend(), None),  # nothing says how many: never saturated by seats
    (Backend(in_flight=3, seats=4), 1),  # configured
    (Backend(in_flight=3, seats=4, held=1), 0),  # a seat granted to a queued request counts as taken
    (Backend(in_flight=1, load_in_flight=1, load=sample(1, 0, total_slots=2)), 1),  # llama.cpp's slots
    (Backend(in_flight=1, load_in_flight=1, load=sample(2, 0, total_slots=2)), 0),  # another client holds one
    (Backend(in_flight=2, load_in_flight=2, peak_running=2, load=sample(2, 0)), None),  # never seen queueing: open
    (Backend(in_flight=2, load_in_flight=2, peak_running=2, full_at=2, load=sample(2, 0)), 1),  # learned: one past
    (Backend(in_flight=3, load_in_flight=3, peak_running=2, full_at=2, load=sample(2, 1)), -1),  # ...not while queued
    (Backend(in_flight=4, load_in_flight=4, peak_running=4, full_at=2, load=sample(4, 0)), 1),  # it grew past it
    (Backend(in_flight=2, load_in_flight=2, load=sample(1, 1)), 0),  # no count yet, but the engine queues
    (Backend(in_flight=1, load_in_flight=2, load=sample(1, 1)), None),  # ...and one ended since: its queue is gone
    (Backend(in_flight=3, load_in_flight=1, load=sample(1, 0)), None),  # sent since, none queued then: not made up
    (Backend(in_flight=3, load_in_flight=3, peak_running=5, load=sample(2, 1)), None),  # queued beside fewer than it
    # ran before: a request between two of its steps, not a full engine
])
def test_room(b, free):
    assert room(b, NOW) == free


def test_seat_count_prefers_configuration_then_slots_then_learning():
    assert seat_count(Backend(seats=8, peak_running=3, load=sample(total_slots=2)), NOW) == 8
    assert seat_count(Backend(peak_running=3, load=sample(total_slots=2)), NOW) == 2
    assert seat_count(Backend(peak_running=3, full_at=2), NOW) == 3
    assert seat_count(Backend(peak_running=3), NOW) == 0  # never seen queueing: not known to be full at any count
    assert seat_count(Backend(), NOW) == 0


CLASS_LEVEL = {"interactive": 0, "default": 1, "long_output": 2}


@pytest.mark.parametrize("headers, key_priority, allowed, klass, level", [
    ({}, None, False, "long_output", 2),  # the class's default
    ({}, None, False, "long_prompt", 1),  # a class not named: normal
    ({}, "high", False, "long_output", 0),  # the key's own
    ({"x-shapegate-priority": "high"}, "low", False, "default", 2),  # a header the key may not send: ignored
    ({"x-shapegate-priority": " High "}, "low", True, "default", 0),  # allowed: it wins
])
def test_level_of(headers, key_priority, allowed, klass, level):
    assert level_of(headers, key_priority, allowed, CLASS_LEVEL, klass) == level


def test_a_bad_priority_from_an_allowed_key_is_a_400():
    with pytest.raises(GatewayError) as e:
        level_of({"x-shapegate-priority": "urgent"}, None, True, CLASS_LEVEL, "default")
    assert e.value.status == 400 and e.value.param == "x-shapegate-priority"


@pytest.mark.parametrize("value, seconds", [(None, None), ("1500", 1.5), (" 1 ", 0.001), ("60000", 60.0)])
def test_deadline_of(value, seconds):
    assert deadline_of({} if value is None else {"x-shapegate-deadline-ms": value}, 60_000) == seconds


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "abc", "", "60001", "²", "1" * 11])
def test_a_bad_deadline_is_a_400(value):
    with pytest.raises(GatewayError) as e:
        deadline_of({"x-shapegate-deadline-ms": value}, 60_000)
    assert e.value.status == 400 and e.value.code == "invalid_deadline"


def test_seats_are_learned_from_a_queue_at_the_most_it_ran_two_scrapes_in_a_row():
    from gateway.config import BackendConfig, GatewayConfig
    from gateway.fleet.pool import BackendState

    bc = BackendConfig(id="v", engine="vllm", url="http://127.0.0.1:1", models={"m": "m"})
    b = BackendState(bc, object(), GatewayConfig(auth={"enabled": False}, backends=[bc]))
    for running, waiting, full_at in [(3, 1, 0),  # once: not yet
                                      (5, 0, 0), (2, 1, 0), (2, 1, 0),  # beside fewer than its most (5): steps
                                      (5, 2, 0), (5, 3, 5),  # at its most, twice: full at 5
                                      (6, 0, 5), (6, 1, 5), (6, 4, 6)]:  # it grew
        b.take_load(sample(running, waiting))
        assert b.full_at == full_at, (running, waiting)


def test_a_share_is_taken_of_an_assumed_count_until_the_count_is_known():
    assert share_basis(Backend(seats=8, peak_running=3), NOW) == (8, False)
    assert share_basis(Backend(peak_running=3), NOW) == (0, False)  # no load reported: no share
    assert share_basis(Backend(peak_running=3, load=sample(3, 0)), NOW) == (4, True)  # its most and one more
    assert share_basis(Backend(peak_running=3, assumed=6, load=sample(3, 0)), NOW) == (6, True)  # grown
    assert share_basis(Backend(peak_running=3, full_at=3, assumed=6, load=sample(3, 0)), NOW) == (3, False)


def test_the_assumed_count_grows_only_while_a_share_held_requests_back_and_the_engine_queued_nothing():
    from gateway.config import BackendConfig, GatewayConfig
    from gateway.fleet.pool import BackendState

    bc = BackendConfig(id="v", engine="vllm", url="http://127.0.0.1:1", models={"m": "m"})
    b = BackendState(bc, object(), GatewayConfig(auth={"enabled": False}, backends=[bc]))
    b.take_load(sample(2, 0))
    assert b.assumed == 0  # nothing held back
    grown = []
    for held, waiting in [(True, 0), (True, 0), (False, 0), (True, 1), (True, 0), (True, 0), (True, 0), (True, 0), (True, 0),
                          (True, 0)]:
        b.held_by_share = held
        b.take_load(sample(2, waiting))
        assert not b.held_by_share  # (one sample answers it)
        grown.append(b.assumed)
    # From its most and one more (3): one at a time, then a quarter; not beside a sample that showed it queueing.
    assert grown == [3, 4, 4, 4, 5, 6, 7, 8, 10, 12]
