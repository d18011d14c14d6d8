"""A backend's seats (the requests its engine runs at once) and whether it can take one more request now.

A seat count comes from the configuration (`seats`), else from llama.cpp's slots, else it is learned: once the engine
was seen queueing requests at the most it ever ran, in two load scrapes in a row, the most it was seen running. A count only learned is probed one past while the engine
queues nothing, so that it grows to the engine's real limit and the engine's own queue stays at most one deep; an
engine never seen queueing is never held back by the gateway (nothing says it is full)."""

from __future__ import annotations

from typing import Protocol

from gateway.contracts import LoadSample


class Seated(Protocol):
    """What the queue reads of a backend (gateway/fleet/pool.py's BackendState)."""

    in_flight: int
    load_in_flight: int
    seats: int | None  # configured
    peak_running: int  # the most the engine was seen running
    full_at: int  # the most it was seen running while it queued requests (0: never seen queueing)
    held: int  # seats granted to queued requests that have not gone out yet
    interactive: bool  # marked for single interactive sessions
    capped: int  # requests in flight (or granted) of a class with a seat share
    assumed: int  # while the seat count is not known: the count the shares assume (0: none yet)
    held_by_share: bool  # a share held a request back on the assumed count since the last load sample

    def fresh_load(self, now: float) -> LoadSample | None: ...


def room(b: Seated, now: float) -> int | None:
    """Seats free on `b` now (0 or less: none), or None when nothing says how many it has."""
    load = b.fresh_load(now)
    occupied = b.in_flight + b.held
    queued_there = False
    if load is not None:
        # What the engine runs and queues beyond the gateway's own requests (other clients): seats taken too.
        seen = (load.running or 0.0) + (load.waiting or 0.0)
        others = int(seen) - b.load_in_flight
        if others > 0:
            occupied += others
        # Full now: it queued at the most it ever ran (fewer running: a request between two of its steps), and its
        # queue is not gone with what the gateway saw end since (one it did not report is not made up from the
        # requests sent since: those may well have found seats).
        waiting = load.waiting or 0.0
        queued_there = waiting > 0 and (load.running or 0.0) >= b.peak_running and \
            waiting + b.in_flight - b.load_in_flight > 0
    seats = b.seats or (load.total_slots if load is not None else None)
    if not seats:
        if b.full_at <= 0:
            return 0 if queued_there else None
        # Learned: one more while the engine queues nothing, so the count can grow to what the engine runs.
        seats = max(b.full_at, b.peak_running) + (0 if queued_there else 1)
    return seats - occupied


def seat_count(b: Seated, now: float) -> int:
    """The seats `b` is known to have (0: unknown)."""
    load = b.fresh_load(now)
    return b.seats or (load.total_slots if load is not None and load.total_slots else 0) or \
        (max(b.full_at, b.peak_running) if b.full_at else 0)


def share_basis(b: Seated, now: float) -> tuple[int, bool]:
    """The seat count a class's seat share is taken of, and whether it is only assumed. Not known yet (a fresh
    gateway) but the engine reports its load: the most it was seen running and one more, or more as the count grows
    (gateway/fleet/pool.py: at each load sample where the engine queued nothing while a share held requests back),
    so a burst of long outputs cannot take every seat before the count is learned. No load reported: 0 (no share)."""
    n = seat_count(b, now)
    if n or b.fresh_load(now) is None:
        return n, False
    return max(b.assumed, b.peak_running + 1), True

