"""What replicas exchange, without Redis: latency sums folded once each, own learning never sent back, openings once."""

from __future__ import annotations

import orjson
import pytest

from gateway.config import BackendConfig, GatewayConfig, LatencyHints
from gateway.contracts import DEFAULT, Outcome, RequestShape
from gateway.fleet.health import CLOSED, HALF_OPEN, OPEN, Breaker
from gateway.fleet.pool import BackendState, Pool
from gateway.ops.breaker_share import BreakerShare
from gateway.ops.replica_sync import LatencyShare
from gateway.stats.rolling import LatencyModel

SHAPE = RequestShape(model="m", route="chat", stream=True, prompt_tokens=100, output_tokens=100, klass=DEFAULT)
CFG = GatewayConfig(auth={"enabled": False}, backends=[
    BackendConfig(id="x", engine="vllm", url="http://127.0.0.1:1", models={"m": "m"}),
    BackendConfig(id="y", engine="vllm", url="http://127.0.0.1:2", models={"m": "m"})])
HALF_LIFE = 120.0


class Clock:
    def __init__(self) -> None:
        self.mono, self.wall = 1000.0, 1_700_000_000.0

    def __call__(self) -> float:
        return self.mono

    def step(self, s: float) -> None:
        self.mono += s
        self.wall += s


class Replica:
    """One process's backends and its end of the latency exchange, on the shared fake clock."""

    def __init__(self, name: str, clock: Clock) -> None:
        self.clock = clock
        self.backends = {bc.id: BackendState(bc, None, CFG) for bc in CFG.backends}
        for b in self.backends.values():
            b.latency = LatencyModel(LatencyHints(), HALF_LIFE, 0, clock)
        self.share = LatencyShare(name)

    def learn(self, backend: str, n: int, ttft: float, itl: float, prompt: int = 100) -> None:
        for i in range(n):
            self.clock.step(0.05)
            o = Outcome(backend=backend, shape=SHAPE, ok=True, status=200, ttft=ttft + prompt * 1e-5 * (i % 4),
                        itl=itl, e2e=ttft + 99 * itl, prompt_tokens=prompt * (1 + i % 4), completion_tokens=100,
                        cached_tokens=0, running_at_start=i % 3)
            self.backends[backend].latency.learn(o, self.clock.mono, running_end=i % 3)

    def export(self) -> bytes | None:
        return self.share.export(self.backends.values(), self.clock.wall, self.clock.mono)

    def fold(self, entries: dict[str, bytes | None]) -> int:
        rows = {k: v for k, v in entries.items() if v is not None}
        return self.share.fold(rows, self.backends, self.clock.wall, self.clock.mono)

    def fit(self, backend: str):
        return self.backends[backend].latency.estimate()


def fits(*pairs: tuple[Replica, str]) -> list:
    """Estimates of several replicas at one instant, past the estimate's cache."""
    pairs[0][0].clock.step(2.0)
    return [r.fit(bid) for r, bid in pairs]


def same_fit(a, b) -> None:
    for f in ("ttft_t0", "prefill_rate", "itl_a", "itl_b", "ttft_per_running", "service_s"):
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-6), f
    assert a.samples == b.samples


def test_a_new_replica_takes_what_another_learned_and_each_entry_counts_once():
    clock = Clock()
    a, b = Replica("a/1", clock), Replica("b/1", clock)
    a.learn("x", 30, ttft=0.2, itl=0.03)
    a.learn("y", 30, ttft=0.05, itl=0.004)
    entry = a.export()
    clock.step(10.0)  # b reads it a while after it was written: it has decayed meanwhile
    assert b.fold({"a/1": entry}) == 60
    assert b.fold({"a/1": entry}) == 0  # read again: nothing new
    for bid in ("x", "y"):
        same_fit(*fits((b, bid), (a, bid)))
    assert b.backends["x"].latency.imported == 30 and b.backends["x"].latency.samples == 0
    fast, slow = fits((b, "y"), (b, "x"))
    assert slow.itl_a > 5 * fast.itl_a and fast.samples >= 25
    # a learns more, later: the next entry adds only that, decayed from its time as the model decays, so b
    # holds what a holds, which is what one model holds that saw every request itself.
    clock.step(30.0)
    a.learn("x", 10, ttft=0.4, itl=0.05)
    clock.step(3.0)
    assert b.fold({"a/1": a.export()}) == 10
    same_fit(*fits((b, "x"), (a, "x")))


def test_what_a_replica_took_from_others_never_goes_back_to_them():
    clock = Clock()
    a, b = Replica("a/1", clock), Replica("b/1", clock)
    a.learn("x", 20, ttft=0.2, itl=0.03)
    b.learn("x", 20, ttft=0.1, itl=0.01)
    b.fold({"a/1": a.export(), "b/1": b.export()})  # its own field is skipped
    assert b.backends["x"].latency.imported == 20
    (before,) = fits((a, "x"))
    # b's entry holds b's own 20 requests only: folding it into a adds b's learning, not a's once more.
    assert a.fold({"a/1": a.export(), "b/1": b.export()}) == 20
    both, other = fits((a, "x"), (b, "x"))
    same_fit(both, other)
    assert both.samples == pytest.approx(before.samples * 2, abs=1)
    # What b publishes is what a replica holds that learned b's requests alone, at the same instants.
    fit_b, svc_b = b.backends["x"].latency.own_moments(clock.mono)
    alone = Replica("r/1", Clock())
    alone.clock.step(0.05 * 20)  # a's requests came first
    alone.learn("x", 20, ttft=0.1, itl=0.01)
    ref_fit, ref_svc = alone.backends["x"].latency.own_moments(clock.mono)
    assert svc_b == pytest.approx(ref_svc, rel=1e-9)
    assert fit_b == pytest.approx(ref_fit, rel=1e-6, abs=1e-9)


def test_an_entry_that_comes_back_after_redis_lost_it_is_not_counted_again():
    clock = Clock()
    a, b = Replica("a/1", clock), Replica("b/1", clock)
    a.learn("x", 20, ttft=0.2, itl=0.03)
    entry = a.export()
    b.fold({"a/1": entry})
    clock.step(5.0)
    assert b.fold({}) == 0  # Redis restarted empty: a's field is missing from one read
    assert b.fold({"a/1": a.export()}) == 0  # a writes the same sums again
    same_fit(*fits((b, "x"), (a, "x")))
    # A publisher whose model was replaced (a reload) starts a new epoch: its entry is taken whole.
    a.backends["x"].latency = LatencyModel(LatencyHints(), HALF_LIFE, 0, clock)
    a.learn("x", 5, ttft=0.2, itl=0.03)
    assert b.fold({"a/1": a.export()}) == 5
    # Entries not updated for long are forgotten (their process is gone): one that came back would count whole.
    b.share.forget_before(clock.wall + 1)
    assert b.fold({"a/1": a.export()}) == 5


def test_malformed_entries_and_unknown_backends_change_nothing():
    clock = Clock()
    a, b = Replica("a/1", clock), Replica("b/1", clock)
    a.learn("x", 10, ttft=0.2, itl=0.03)
    good = orjson.loads(a.export())
    bad_len = {**good, "b": {"x": {**good["b"]["x"], "f": [1.0, 2.0]}}}
    infinite = {**good, "b": {"x": {**good["b"]["x"], "s": ["inf", 1.0]}}}
    rows = {"c/1": b"{not json", "d/1": orjson.dumps(bad_len), "e/1": orjson.dumps(infinite),
            "f/1": orjson.dumps({**good, "b": {"gone": good["b"]["x"]}}), "g/1": b"[]"}
    assert b.fold(rows) == 0
    assert b.backends["x"].latency.imported == 0 and b.fit("x").samples == 0
    assert b.export() is None  # nothing of its own learned: nothing to publish


def backend_pool() -> Pool:
    return Pool([BackendState(bc, None, CFG) for bc in CFG.backends])


def test_an_opening_is_applied_once_on_the_other_replica_and_never_counted_there():
    pool_a, pool_b = backend_pool(), backend_pool()
    a, b = BreakerShare("a/1"), BreakerShare("b/1")
    told: list[tuple[str, float]] = []

    def listener(bid: str, until: float) -> None:  # (returns None, as declared: the compiled build checks it)
        told.append((bid, until))
        a.opened(bid, until)

    pool_a.watch_breakers(listener)
    x_a = pool_a.get("x").breaker
    x_a.on_failure(100.0, hold_s=5.0)  # a refused connection on replica a
    assert told == [("x", 105.0)] and a.wake.is_set()
    rows = a.outgoing(now_wall=5000.0, now_mono=100.2)
    a.sent(rows, {"x": 105.0})
    assert a.pending == {}
    assert a.apply(rows, pool_a, 5000.0, 100.2) == 0  # its own opening does not come back
    # b reads it 0.3 s later by its wall clock: open for the rest of a's hold, from its own monotonic clock.
    x_b = pool_b.get("x").breaker
    assert b.apply(rows, pool_b, 5000.3, 50.0) == 1
    assert x_b.state(50.0) == OPEN and x_b.reopens_in(50.0) == pytest.approx(4.5)
    assert x_b.openings == 0 and pool_b.get("y").breaker.state(50.0) == CLOSED
    # b's probe proves the engine back (closing is never shared); the same entry read again changes nothing.
    x_b.on_success()
    assert b.apply(rows, pool_b, 5000.5, 50.2) == 0 and x_b.state(50.2) == CLOSED
    # The hold ended: a half-open trial, as for an opening of its own.
    fresh = backend_pool()
    assert BreakerShare("c/1").apply(rows, fresh, 5000.3, 10.0) == 1
    assert fresh.get("x").breaker.state(14.6) == HALF_OPEN
    # An opening read after its hold is over is not applied.
    assert BreakerShare("d/1").apply(rows, backend_pool(), 5006.0, 10.0) == 0


def test_a_held_breaker_is_not_closed_by_requests_that_started_before_the_news():
    br = Breaker(threshold=3, open_s=5.0)
    opened: list[float] = []
    br.on_open = opened.append
    assert br.hold(20.0, now=10.0)
    assert not br.hold(15.0, now=10.5)  # already held longer
    br.on_success(started=9.0)  # a stream that began before it was held
    assert br.state(11.0) == OPEN
    assert opened == [] and br.openings == 0  # a remote opening is never passed on
    br.on_attempt(21.0)
    br.on_failure(21.0)  # the trial fails here: this breaker's own opening, told to the others
    assert br.openings == 1 and opened == [26.0]


def test_openings_written_while_redis_is_away_go_out_when_it_answers():
    share = BreakerShare("a/1")
    share.opened("x", 130.0)
    first = share.outgoing(now_wall=10.0, now_mono=100.0)  # the write fails: pending stays
    later = share.outgoing(now_wall=20.0, now_mono=110.0)
    assert orjson.loads(first["x"])["hold_s"] == 30.0 and orjson.loads(later["x"])["hold_s"] == 20.0
    share.sent(later, {"x": 130.0})
    assert share.outgoing(now_wall=21.0, now_mono=111.0) == {}
    share.opened("y", 105.0)
    assert share.outgoing(now_wall=30.0, now_mono=120.0) == {} and share.pending == {}  # over before it went out
