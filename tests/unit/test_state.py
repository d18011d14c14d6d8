"""The affinity index on a fake clock: longest prefix, sessions, expiry, LRU bound, memory, local sharing."""

from __future__ import annotations

import tracemalloc

import pytest

from gateway.config import ShapeConfig
from gateway.contracts import RequestShape
from gateway.routing.affinity import AffinityIndex, MemoryStore, StoreError
from gateway.apis.chat import CHAT
from gateway.routing.shape import classify

CFG = ShapeConfig()  # 256-character blocks: 64 tokens each


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def shape(text: str, model: str = "m", session: str | None = None) -> RequestShape:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True, "max_tokens": 10}
    return classify(api=CHAT, body=body, session=session, principal="p",
                    cfg=CFG)


def index(clock=None, **kw) -> AffinityIndex:
    kw.setdefault("max_entries", 10_000)
    kw.setdefault("ttl_s", 600.0)
    return AffinityIndex(block_chars=CFG.prefix_block_chars, clock=clock or FakeClock(), **kw)


SYSTEM = "s" * 2560  # ten blocks


@pytest.mark.parametrize("case,recorded,query,expected", [
    ("nothing known", [], SYSTEM, (None, 0)),
    ("same prompt", [(SYSTEM, "a")], SYSTEM, ("a", 10 * 64)),
    ("longer prompt sharing the whole prefix", [(SYSTEM, "a")], SYSTEM + "u" * 600, ("a", 10 * 64)),
    ("shorter prompt inside a longer one", [(SYSTEM + "u" * 600, "a")], SYSTEM, ("a", 10 * 64)),
    ("longest match wins over a later shorter one", [(SYSTEM, "b"), (SYSTEM[:1024], "a")], SYSTEM + "x" * 512,
     ("b", 10 * 64)),
    ("the later record of the same prefix wins", [(SYSTEM, "a"), (SYSTEM, "b")], SYSTEM, ("b", 10 * 64)),
    ("diverges after three blocks", [("q" * 768 + "r" * 768, "a")], "q" * 768 + "z" * 768, ("a", 3 * 64)),
    ("shorter than a block", [("tiny", "a")], "tiny", (None, 0)),
])
def test_lookup_longest_prefix(case, recorded, query, expected):
    ix = index()
    for text, backend in recorded:
        ix.record(shape(text), backend)
    assert ix.lookup(shape(query)) == expected, case


def test_prefixes_are_per_model():
    ix = index()
    ix.record(shape(SYSTEM, model="m1"), "a")
    assert ix.lookup(shape(SYSTEM, model="m2")) == (None, 0)


def test_session_pin_wins_and_counts_its_prefix_only_on_its_own_backend():
    ix = index()
    ix.record(shape(SYSTEM + "turn one", session="s1"), "a")
    ix.record(shape(SYSTEM + "another user", session="s2"), "b")  # same system prompt, now last on b
    assert ix.lookup(shape(SYSTEM + "turn two", session="s1")) == ("a", 0)
    assert ix.lookup(shape(SYSTEM + "turn two", session="s2")) == ("b", 10 * 64)
    assert ix.lookup(shape("short", session="s1")) == ("a", 0)
    assert ix.lookup(shape("short", session="s3")) == (None, 0)


def test_entries_expire():
    clock = FakeClock()
    ix = index(clock, ttl_s=10.0)
    ix.record(shape(SYSTEM, session="s"), "a")
    clock.t = 9.9
    assert ix.lookup(shape(SYSTEM, session="s"))[0] == "a"
    clock.t = 10.1
    assert ix.lookup(shape(SYSTEM, session="s")) == (None, 0)


def test_bounded_least_recent_first():
    ix = index(max_entries=16)
    old = "o" * 2560  # ten keys
    ix.record(shape(old), "a")
    for i in range(5):
        ix.record(shape(f"{i}" * 512), "b")  # two keys each
    assert len(ix) == 16
    # The four oldest keys (the prefix's first blocks) went first; the chained last block still matches it all.
    assert ix.lookup(shape(old)) == ("a", 10 * 64)
    for i in range(10):
        ix.record(shape(f"n{i}" * 256), "c")
    assert len(ix) == 16 and ix.lookup(shape(old)) == (None, 0)


def test_removed_backend_stops_matching():
    ix = index()
    ix.record(shape(SYSTEM), "a")
    ix.forget_backend("a")
    assert ix.lookup(shape(SYSTEM)) == (None, 0)
    ix.record(shape(SYSTEM), "a")  # the id comes back (config reload): it matches again
    assert ix.lookup(shape(SYSTEM))[0] == "a"


def test_memory_per_entry_is_bounded():
    n = 50_000
    shapes = [shape(f"{i:08d}" * 32) for i in range(n // 1)]  # one block each
    ix = index(max_entries=n)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for s in shapes:
        ix.record(s, "backend-a")
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(ix) == n
    per_entry = used / n
    assert per_entry < 160, per_entry  # report: about 100-130 bytes an entry on CPython 3.11


async def test_replicas_share_through_a_store_and_skip_their_own_batches():
    clock, wall = FakeClock(), FakeClock(1_700_000_000.0)
    store = MemoryStore(clock=wall)
    a = index(clock, shared=True)
    b = index(clock, shared=True)
    a.record(shape(SYSTEM, session="s"), "x")
    await a.sync(store, wall_clock=wall)
    await b.sync(store, wall_clock=wall)
    assert b.lookup(shape(SYSTEM + "more", session="s")) == ("x", 10 * 64)
    # a reads its own batch back and ignores it; nothing pending afterwards.
    await a.sync(store, wall_clock=wall)
    assert a.take_pending() is None


async def test_batches_older_than_the_ttl_are_not_applied():
    clock, wall = FakeClock(), FakeClock(1_700_000_000.0)
    store = MemoryStore(clock=wall)
    a = index(clock, shared=True, ttl_s=30.0)
    a.record(shape(SYSTEM), "x")
    await a.sync(store, wall_clock=wall)
    wall.t += 31
    b = index(clock, shared=True, ttl_s=30.0)
    await b.sync(store, wall_clock=wall)
    assert b.lookup(shape(SYSTEM)) == (None, 0)


async def test_a_store_error_keeps_local_state_and_never_raises():
    store = MemoryStore()
    await store.close()
    ix = index(shared=True)
    ix.record(shape(SYSTEM), "x")
    await ix.sync(store)  # logged, not raised
    assert ix.store_errors == 1
    assert ix.lookup(shape(SYSTEM))[0] == "x"
    with pytest.raises(StoreError):
        await store.append("c", b"p")


def test_pending_writes_are_bounded():
    ix = index(shared=True, max_pending=20)
    for i in range(10):
        ix.record(shape(f"{i}" * 2560), "x")  # ten keys each
    assert ix.dropped == 8 and ix.lookup(shape("9" * 2560))[0] == "x"  # local state is complete regardless


def test_not_shared_keeps_nothing_pending():
    ix = index()
    ix.record(shape(SYSTEM), "x")
    assert ix.take_pending() is None
