"""What replicas read from Redis is checked as client input: bounded breaker holds, latency sums held against
the local fit, stats summaries and experiment state range-checked; a bad value is left out and gone with its entry."""

from __future__ import annotations

import logging
import time

import orjson
import pytest

from gateway.config import BackendConfig, ConfigError, GatewayConfig, HealthConfig, LatencyHints, parse_config
from gateway.contracts import DEFAULT, Outcome, RequestShape
from gateway.experiments.experiment import Experiment
from gateway.experiments.share import VERSION_AHEAD, control_problem, samples_problem, version_ceiling
from gateway.fleet.health import CLOSED, HALF_OPEN, OPEN, Breaker
from gateway.fleet.pool import BackendState, Pool
from gateway.ops.admin_experiments import _weights_problem
from gateway.ops.replica_checks import FAR_FACTOR, implausible, max_hold_s, read_entry
from gateway.ops.breaker_share import BreakerShare
from gateway.ops.replica_sync import LatencyShare
from gateway.runtime import build_policy
from gateway.stats import sketch
from gateway.stats.merge import read_summary, render
from gateway.stats.rolling import BackendStats, LatencyModel
from gateway.stats.share import MAX_AHEAD_S, fresh, wall_time

SHAPE = RequestShape(model="m", route="chat", stream=True, prompt_tokens=100, output_tokens=100, klass=DEFAULT)
CFG = GatewayConfig(auth={"enabled": False}, backends=[
    BackendConfig(id="x", engine="vllm", url="http://127.0.0.1:1", models={"m": "m"}),
    BackendConfig(id="y", engine="vllm", url="http://127.0.0.1:2", models={"m": "m"})])
WALL = 1_700_000_000.0


# -- breakers ---------------------------------------------------------------------------------------------
def pool() -> Pool:
    return Pool([BackendState(bc, None, CFG) for bc in CFG.backends])


def opening(hold_s: object, at: object = WALL, by: str = "a/1") -> dict[str, bytes]:
    return {"x": orjson.dumps({"by": by, "n": 1, "at": at, "hold_s": hold_s})}


def test_the_longest_hold_is_the_gateways_own_longest():
    assert max_hold_s(HealthConfig()) == 120.0  # an engine's Retry-After, capped
    assert max_hold_s(HealthConfig(breaker_open_s=300.0)) == 300.0


def test_a_hold_of_a_billion_seconds_is_cut_to_the_longest_and_ends_when_its_entry_goes():
    p, share = pool(), BreakerShare("b/1")
    x = p.get("x").breaker
    assert share.apply(opening(1e9), p, WALL, 100.0, max_hold=120.0) == 1
    assert x.state(100.0) == OPEN and x.reopens_in(100.0) == pytest.approx(120.0)
    assert share.apply(opening(1e9), p, WALL + 1, 101.0, max_hold=120.0) == 0  # the same entry: once
    assert x.state(101.0) == OPEN
    assert share.apply({}, p, WALL + 1.2, 101.2, max_hold=120.0) == 0  # deleted: the hold ends with it
    assert x.state(101.2) == HALF_OPEN and x.allows(101.2)
    x.on_attempt(101.2)
    x.on_success(101.2)
    assert x.state(101.3) == CLOSED


def test_a_replaced_entry_ends_the_hold_of_the_one_before():
    p, share = pool(), BreakerShare("b/1")
    x = p.get("x").breaker
    share.apply(opening(1e9), p, WALL, 100.0, max_hold=120.0)
    assert share.apply(opening(5.0, at=WALL + 2), p, WALL + 2, 102.0, max_hold=120.0) == 1
    assert x.reopens_in(102.0) == pytest.approx(5.0)


def test_an_own_opening_outlives_the_end_of_a_hold():
    br = Breaker(threshold=1, open_s=30.0)
    br.on_failure(10.0)  # its own: open until 40
    assert br.hold(100.0, now=11.0)
    assert br.end_hold(12.0) and br.state(12.0) == OPEN and br.reopens_in(12.0) == pytest.approx(28.0)
    assert not br.end_hold(12.5)  # nothing held any more
    # A failure here during a hold that opens it longer than the hold is its own: the hold's end leaves it.
    br2 = Breaker(threshold=1, open_s=50.0)
    br2.hold(20.0, now=10.0)
    br2.on_failure(21.0)
    assert not br2.end_hold(22.0) and br2.reopens_in(22.0) == pytest.approx(49.0)


@pytest.mark.parametrize("entry", [
    {"by": "a/1", "n": 1, "at": WALL + 3600, "hold_s": 5.0},  # opened in the future
    {"by": "a/1", "n": 1, "at": "soon", "hold_s": 5.0},
    {"by": "a/1", "n": 1, "at": WALL, "hold_s": "long"},
    {"by": "a/1", "n": 1, "at": WALL, "hold_s": True},
    {"by": ["a/1"], "n": 1, "at": WALL, "hold_s": 5.0},
    {"n": 1, "at": WALL, "hold_s": 5.0},
])
def test_an_opening_that_no_replica_writes_holds_nothing(entry, caplog):
    p = pool()
    with caplog.at_level(logging.WARNING, "shapegate.replicas"):
        assert BreakerShare("b/1").apply({"x": orjson.dumps(entry), "y": b"[1"}, p, WALL, 100.0) == 0
    assert p.get("x").breaker.state(100.0) == CLOSED and p.get("y").breaker.state(100.0) == CLOSED
    assert "ignoring a malformed breaker entry for 'x'" in caplog.text


# -- latency ----------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.mono, self.wall = 1000.0, WALL

    def __call__(self) -> float:
        return self.mono

    def step(self, s: float) -> None:
        self.mono += s
        self.wall += s


class Replica:
    def __init__(self, name: str, clock: Clock) -> None:
        self.clock = clock
        self.backends = {bc.id: BackendState(bc, None, CFG) for bc in CFG.backends}
        for b in self.backends.values():
            b.latency = LatencyModel(LatencyHints(), 120.0, 0, clock)
        self.share = LatencyShare(name)

    def learn(self, backend: str, n: int, ttft: float, itl: float) -> None:
        for i in range(n):
            self.clock.step(0.05)
            o = Outcome(backend=backend, shape=SHAPE, ok=True, status=200, ttft=ttft + 1e-3 * (i % 4), itl=itl,
                        e2e=ttft + 99 * itl, prompt_tokens=100 * (1 + i % 4), completion_tokens=100,
                        cached_tokens=0, running_at_start=i % 3)
            self.backends[backend].latency.learn(o, self.clock.mono, running_end=i % 3)

    def export(self) -> dict:
        return orjson.loads(self.share.export(self.backends.values(), self.clock.wall, self.clock.mono))

    def fold(self, rows: dict[str, dict]) -> int:
        raw = {k: orjson.dumps(v) for k, v in rows.items()}
        return self.share.fold(raw, self.backends, self.clock.wall, self.clock.mono)

    def fit(self, backend: str):
        return self.backends[backend].latency.estimate()


def fits(*pairs: tuple[Replica, str]) -> list:
    """Estimates of several replicas at one instant, past the estimate's cache."""
    pairs[0][0].clock.step(2.0)
    return [r.fit(bid) for r, bid in pairs]


def scaled(entry: dict, backend: str, factor: float, what: str = "b") -> dict:
    """The entry with one backend's sums of latencies (`b`: the right-hand sides), or all its sums, scaled."""
    e = entry["b"][backend]
    f = [v * factor for v in e["f"]] if what == "all" else [*e["f"][:25], *(v * factor for v in e["f"][25:])]
    s = [v * factor for v in e["s"]] if what == "all" else [e["s"][0], e["s"][1] * factor]
    n = int(e["n"] * factor) if what == "all" else e["n"]
    return {**entry, "b": {**entry["b"], backend: {**e, "f": f, "s": s, "n": n}}}


def same(a, b) -> None:
    for f in ("ttft_t0", "prefill_rate", "itl_a", "itl_b", "ttft_per_running", "service_s"):
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-6), f


def test_latencies_scaled_ten_million_times_are_not_taken_by_a_replica_with_a_fit():
    clock = Clock()
    a, b, untouched = Replica("a/1", clock), Replica("b/1", clock), Replica("c/1", clock)
    a.learn("x", 30, ttft=0.05, itl=0.004)
    for r in (b, untouched):
        r.clock.mono -= 30 * 0.05  # (the three learn at the same instants)
        r.clock.wall -= 30 * 0.05
        r.learn("x", 30, ttft=0.05, itl=0.004)
    assert b.fold({"a/1": scaled(a.export(), "x", 1e7)}) == 0
    same(*fits((b, "x"), (untouched, "x")))
    assert b.backends["x"].latency.imported == 0
    # The same entry unscaled is taken.
    assert b.fold({"a/1": a.export()}) == 30


def test_a_cold_replica_takes_nothing_past_an_hour():
    clock = Clock()
    a, b = Replica("a/1", clock), Replica("b/1", clock)
    a.learn("x", 30, ttft=0.05, itl=0.004)
    assert b.fold({"a/1": scaled(a.export(), "x", 1e7)}) == 0
    assert b.backends["x"].latency.imported == 0


def test_what_an_entry_gave_goes_when_the_entry_goes():
    clock = Clock()
    a, b, untouched = Replica("a/1", clock), Replica("b/1", clock), Replica("c/1", clock)
    for r in (b, untouched):
        r.learn("x", 30, ttft=0.05, itl=0.004)
        r.clock.mono -= 30 * 0.05
        r.clock.wall -= 30 * 0.05
    clock.step(30 * 0.05)
    a.learn("x", 30, ttft=0.06, itl=0.005)
    # Every sum ten million times (its requests too): the same figures, so it is taken, with a huge weight...
    assert b.fold({"a/1": scaled(a.export(), "x", 1e7, what="all")}) == 300_000_000
    assert fits((b, "x"))[0].samples > 1e6
    # ...and gone with the entry, in the next round: b routes on what it had before.
    assert b.fold({}) == 0
    after, before = fits((b, "x"), (untouched, "x"))
    same(after, before)
    assert after.samples == before.samples and b.backends["x"].latency.imported == 0


def test_the_far_factor_is_measured_on_what_routing_reads():
    clock = Clock()
    b = Replica("b/1", clock)
    b.learn("x", 30, ttft=0.05, itl=0.004)
    model = b.backends["x"].latency
    fit, svc = model.own_moments(clock.mono)
    # As much learning again, latencies 5 times: the fit moves less than FAR_FACTOR.
    assert implausible(model, fit[:25] + [v * 5 for v in fit[25:]], [svc[0], svc[1] * 5], clock.mono) is None
    # 50 times the weight at 50 times the latencies moves it about 50 times.
    why = implausible(model, [v * 50 for v in fit[:25]] + [v * 2500 for v in fit[25:]],
                      [svc[0] * 50, svc[1] * 2500], clock.mono)
    assert why is not None and f"at most {FAR_FACTOR:g}" in why


def weighted(entry: dict, backend: str, weight: float, factor: float) -> dict:
    """The entry with one backend's requests and weights times `weight`, its latencies times `factor`."""
    e = entry["b"][backend]
    f = [v * weight for v in e["f"][:25]] + [v * weight * factor for v in e["f"][25:]]
    s = [e["s"][0] * weight, e["s"][1] * weight * factor]
    return {**entry, "b": {**entry["b"], backend: {**e, "f": f, "s": s, "n": int(e["n"] * weight)}}}


def test_entries_each_within_the_far_factor_move_the_fit_at_most_that_far_within_a_half_life():
    clock = Clock()
    a, b = Replica("a/1", clock), Replica("b/1", clock)
    a.learn("x", 30, ttft=0.05, itl=0.004)
    b.learn("x", 30, ttft=0.05, itl=0.004)
    before = fits((b, "x"))[0]
    entry = a.export()
    # Each forged entry outweighs everything before it at 8 times the last one's latencies: each moves the fit
    # about 8 times from where it stands, 8, 64, 512 times in all.
    rows: dict[str, dict] = {}
    for i, (weight, factor) in enumerate(((100, 8), (10_000, 64), (1_000_000, 512))):
        rows[f"forged/{i}"] = {**weighted(entry, "x", weight, factor), "t": clock.wall}
        b.fold(rows)
        clock.step(2.0)
    after = fits((b, "x"))[0]
    moved = max(after.service_s / before.service_s, after.itl(1.0) / before.itl(1.0))
    assert 5 < moved <= FAR_FACTOR  # the first was taken, the others not
    # A half-life later the window starts again from where the fit stands.
    clock.step(b.backends["x"].latency.half_life)
    rows = {"forged/0": {**weighted(entry, "x", 100, 8), "t": clock.wall}}
    b.fold(rows)
    assert b.share._refused == {}


@pytest.mark.parametrize("change", [
    {"n": -1}, {"n": True}, {"n": 2 ** 60}, {"e": 5}, {"f": [0.0] * 29}, {"s": [1.0, "x"]},
    {"s": [1e6, 1.0]},  # a weight of a million from 30 requests
    {"s": [1.0, -5.0]},
])
def test_read_entry_refuses_what_no_replica_writes(change):
    clock = Clock()
    a = Replica("a/1", clock)
    a.learn("x", 30, ttft=0.05, itl=0.004)
    entry = a.export()["b"]["x"]
    read_entry(entry)
    with pytest.raises((ValueError, TypeError)):
        read_entry({**entry, **change})


def test_an_entry_taken_in_the_future_is_left_out_and_logged_once(caplog):
    clock = Clock()
    a, b = Replica("a/1", clock), Replica("b/1", clock)
    a.learn("x", 30, ttft=0.05, itl=0.004)
    future = {**a.export(), "t": clock.wall + 3600}
    with caplog.at_level(logging.WARNING, "shapegate.replicas"):
        assert b.fold({"a/1": future}) == 0
        assert b.fold({"a/1": future}) == 0
        assert b.fold({"a/1": {**future, "t": "soon"}}) == 0
    assert caplog.text.count("ignoring a malformed latency entry of 'a/1'") == 1
    assert b.backends["x"].latency.imported == 0
    assert b.fold({"a/1": a.export()}) == 30


# -- stats summaries --------------------------------------------------------------------------------------
def summary(taken_at: float, **backend_over) -> dict:
    stats = BackendStats(max_samples=16, now=0.0)
    for i in range(3):
        stats.add(Outcome("a", SHAPE, ok=True, status=200, ttft=0.01, itl=0.002, e2e=0.3, prompt_tokens=10,
                          completion_tokens=5), 50.0 + i)
    s = stats.summary(60.0, 60.0)
    b = {"engine": "vllm", "health": "ready", "breaker": "closed", "in_flight": 0, "load": None,
         "fit": {"ttft_t0": 0.01, "prefill_rate": 1e4, "itl_a": 0.005, "itl_b": 0.0, "samples": 3,
                 "ttft_per_running": 0.0, "service_s": 1.0},
         "failovers": 0, "breaker_openings": 0, "unsupported": {}, "span_s": s["span_s"], "classes": s["classes"],
         **backend_over}
    return {"v": 1, "worker": "1", "replica": "r", "taken_at": taken_at, "window_s": 60.0, "enabled": True,
            "backends": {"a": b}, "rejected": {}, "reasons": {}}


def test_a_sketch_bucket_past_any_value_is_refused():
    assert sketch.decode({"i": [10, 20], "n": [1, 2]}) == {10: 1.0, 20: 2.0}
    for bad in ({"i": [1_000_000], "n": [1]}, {"i": [-1_000_000], "n": [1]}, {"i": [10], "n": [1e308], "w": 1e10}):
        with pytest.raises(ValueError):
            sketch.decode(bad)


@pytest.mark.parametrize("poison", [
    {"classes": {"default": {"n": [1, 0, 0, 0], "tokens": 1, "samples": 1, "ttft": {"i": [1_000_000], "n": [1]}}}},
    {"fit": {"ttft_t0": 0.01, "prefill_rate": 0, "itl_a": 0.005, "itl_b": 0.0, "samples": 3,
             "ttft_per_running": 0.0, "service_s": 1.0}},
    {"in_flight": -5}, {"failovers": 2 ** 70},
    {"load": {"running": 1, "waiting": 0, "kv_usage": 0.1, "idle_slots": None, "age_s": -1e300}},
    {"load": {"running": "many", "age_s": 0.1}},
])
def test_a_summary_with_a_bad_value_is_left_out_and_the_rest_renders(poison):
    good, bad = summary(0.0), summary(0.0, **poison)
    bad["worker"] = "2"
    with pytest.raises((ValueError, TypeError, ArithmeticError)):
        read_summary(bad)
    rep = render([good, bad], 0.0)
    assert rep["workers"]["count"] == 1 and rep["totals"]["requests"] == 3
    orjson.dumps(rep)


def test_a_summary_time_must_be_a_time_of_the_last_while():
    now = time.time()
    assert wall_time(now - 1, now) == now - 1 and wall_time(now + MAX_AHEAD_S / 2, now) is not None
    for bad in (now + 3600, "soon", True, None, float("nan"), float("inf")):
        assert wall_time(bad, now) is None
    assert fresh({"taken_at": now - 1}, now) and not fresh({"taken_at": now + 3600}, now)
    assert not fresh({"taken_at": now - 3600}, now) and fresh({"taken_at": now - 3600}, now, 7200)


# -- experiments ------------------------------------------------------------------------------------------
def experiment() -> Experiment:
    x = {"name": "ab", "model": "m", "arms": [{"name": "a", "backends": ["e0"], "weight": 90},
                                              {"name": "b", "backends": ["e1"], "weight": 10}]}
    backends = [{"id": f"e{i}", "engine": "vllm", "url": f"http://127.0.0.1:{9000 + i}", "models": ["m"]}
                for i in range(2)]
    cfg = parse_config({"auth": {"enabled": False}, "backends": backends, "experiments": [x]}, build_policy)
    return Experiment(cfg.experiments[0])


@pytest.mark.parametrize("control,why", [
    ({"version": 5, "enabled": True, "weights": {"a": 1, "b": 1}, "changed_at": "soon"}, "changed at 'soon'"),
    ({"version": 5, "weights": {"a": 1}, "changed_at": WALL + 3600}, "changed at"),
    ({"version": "5", "weights": {"a": 1}}, "a version"),
    ({"version": True, "weights": {"a": 1}}, "a version"),
    ({"version": 2 ** 60, "weights": {"a": 1}}, "a version"),
    ({"version": int(WALL * 1000) + VERSION_AHEAD + 1, "weights": {"a": 1}}, "a version"),  # ahead of its range
    ({"version": 5, "weights": {"a": 1e308, "b": 1e308}}, "from 0 to 1e+06"),
    ({"version": 5, "weights": {"a": 0, "b": 0}}, "at least one arm"),
    ({"version": 5, "weights": {"zzz": 1}}, "unknown arm"),
    ({"version": 5, "enabled": "yes"}, "enabled"),
    ([1, 2], "not an object"),
])
def test_a_control_no_process_writes_is_refused_before_anything_applies(control, why):
    x = experiment()
    got = control_problem(x, control, WALL)
    assert got is not None and why in got
    assert x.version == 0 and [a.weight for a in x.arms] == [90, 10]


def test_a_good_control_passes_and_adopts():
    x = experiment()
    control = {"version": 5, "enabled": True, "fraction": None, "weights": {"a": 1, "b": 3}, "changed_at": WALL - 1}
    assert control_problem(x, control, WALL) is None
    assert x.adopt(control) and [a.weight for a in x.arms] == [1.0, 3.0] and x.version == 5


def test_the_top_of_the_version_range_moves_with_the_clock():
    x = experiment()
    top = version_ceiling(WALL)
    control = {"version": top, "weights": {"a": 1, "b": 3}, "changed_at": WALL - 1}
    assert control_problem(x, control, WALL) is None and x.adopt(control)
    # A change at the top leaves room for the next one a moment later.
    assert control_problem(x, {**control, "version": top + 1}, WALL) is not None
    assert control_problem(x, {**control, "version": top + 1}, WALL + 0.001) is None


def test_samples_no_process_writes_are_refused():
    x = experiment()
    x.record("a", DEFAULT, Outcome("e0", SHAPE, ok=True, status=200, ttft=0.01, itl=0.002, e2e=0.3,
                                   prompt_tokens=10, completion_tokens=5))
    good = {"taken_at": WALL, "experiments": {"ab": x.shared_samples(400)}}
    assert samples_problem(good) is None
    cls = good["experiments"]["ab"]["classes"]["a|default"]
    for bad in ({"classes": {"a|default": {**cls, "requests": -1}}},
                {"classes": {"nopipe": cls}},
                {"classes": {"a|default": {**cls, "samples": {"e2e": ["x"]}}}},
                {"classes": {"a|default": {**cls, "samples": {"e2e": [0.1] * 401}}}},
                {"shadow": {"a|ok": "many"}},
                {"agreement": {"a": {"compared": 1, "exact": 1, "prefix_share": [-1.0], "prefix_tokens": []}}}):
        assert samples_problem({**good, "experiments": {"ab": {**good["experiments"]["ab"], **bad}}}) is not None
    assert samples_problem({"experiments": []}) is not None


def test_weights_are_bounded_in_the_file_and_in_a_run_time_change():
    with pytest.raises(ConfigError):
        x = {"name": "ab", "model": "m", "arms": [{"name": "a", "backends": ["e0"], "weight": 1e308},
                                                  {"name": "b", "backends": ["e1"], "weight": 1e308}]}
        parse_config({"auth": {"enabled": False}, "experiments": [x], "backends": [
            {"id": f"e{i}", "engine": "vllm", "url": f"http://127.0.0.1:{9000 + i}", "models": ["m"]}
            for i in range(2)]}, build_policy)
    assert _weights_problem({"a": 1e308, "b": 1}) is not None
    assert _weights_problem({"a": 1e6, "b": 0}) is None and _weights_problem(None) is None
