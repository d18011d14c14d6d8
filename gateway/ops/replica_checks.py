"""What another replica's entries in Redis may be: read as a client's input, bounded, held against this replica."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import orjson

from gateway.config import HealthConfig
from gateway.errors import MAX_RETRY_AFTER_S
from gateway.stats.rolling import COLD_SAMPLES, TYPICAL_PROMPT_TOKENS, LatencyModel

if TYPE_CHECKING:
    from gateway.contracts import LatencyEstimate

FIT_LEN, SVC_LEN = 30, 2  # the sums of LatencyModel's fit (5 parameters) and of its service time
# What an entry read from Redis can be that no replica wrote (a bad value, or someone else's): dropped, logged.
MALFORMED = (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, ArithmeticError)
# Another replica's learning that would move this replica's own fit (once it has one) further than this factor,
# either way, is not taken. Replicas measure the same engines, so their fits differ only by what their request
# mixes and moments differ by: a few times under a load swing. Tenfold is no longer that; it is what a bad value
# does, and it would turn routing around. Until this replica's fit stands on COLD_SAMPLES requests (its own and
# those taken from others, as forgetting leaves them) there is only the priors to hold an entry against, which
# real engines may be far from: then only LATENCY_CEILING_S applies.
# The bound holds over a window of the model's half-life, not per entry: several entries each within it (or one
# written again and again) would otherwise walk the fit as far as they like. Each window starts from the fit as it
# stands then (its own learning and what it took), so what another replica can do to it is FAR_FACTOR per
# half-life at most, either way, however many entries it writes.
FAR_FACTOR = 10.0
LATENCY_CEILING_S = 3600.0  # no figure of a fit (a TTFT, an ITL, a request's time on the engine) is above this
MAX_REQUESTS = 2 ** 53  # an entry's request count above this is no count


def max_hold_s(health: HealthConfig) -> float:
    """The longest this gateway holds a breaker open on its own: an engine's Retry-After (capped), a refused
    connection or a failure run ([health] breaker_open_s), an overload without Retry-After (overload_hold_s)."""
    return max(MAX_RETRY_AFTER_S, health.breaker_open_s, health.overload_hold_s)


def _floats(v: object, n: int) -> list[float]:
    if not isinstance(v, list) or len(v) != n:
        raise ValueError(f"expected {n} numbers")
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v):
        raise ValueError("a sum is not a number")
    out = [float(x) for x in v]
    if not all(math.isfinite(x) for x in out):
        raise ValueError("a sum is not finite")
    return out


def read_entry(entry: object) -> tuple[str, int, list[float], list[float]]:
    """One backend's part of another process's latency entry, checked: (epoch, requests, fit sums, service
    sums); ValueError (or TypeError, KeyError) when it is not what a replica writes."""
    if not isinstance(entry, dict):
        raise TypeError("not an object")
    epoch, n = entry["e"], entry["n"]
    if not isinstance(epoch, str) or len(epoch) > 64:
        raise ValueError("no epoch")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_REQUESTS:
        raise ValueError("no request count")
    fit, svc = _floats(entry["f"], FIT_LEN), _floats(entry["s"], SVC_LEN)
    # Each request adds a weight of one to the service sums, which then only decays: more weight than requests
    # (or less than none, beyond rounding) was not learned from them.
    if not -1e-6 <= svc[0] <= n + 1e-6 * (n + 1):
        raise ValueError(f"a weight of {svc[0]:.6g} from {n} requests")
    if svc[1] < -1e-6 * (abs(svc[0]) + 1):
        raise ValueError("a negative latency")
    return epoch, n, fit, svc


def _figures(est: LatencyEstimate) -> tuple[float, float, float]:
    """What routing reads of a fit: a typical prompt's TTFT, one stream's ITL, a request's time on the engine."""
    return est.ttft(TYPICAL_PROMPT_TOKENS), est.itl(1.0), est.service_s


def figures_now(model: LatencyModel, now_mono: float) -> tuple[float, float, float] | None:
    """What routing reads of `model` now, once its fit stands on COLD_SAMPLES requests (None before)."""
    now = model.trial([0.0] * FIT_LEN, [0.0] * SVC_LEN, now_mono)
    return _figures(now) if now.samples >= COLD_SAMPLES else None


def _moved(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    return max(max(x / y, y / x) for x, y in zip(a, b))


def implausible(model: LatencyModel, fit: list[float], svc: list[float], now_mono: float,
                anchor: tuple[float, float, float] | None = None) -> str | None:
    """Why adding these sums to `model` must not happen (None: they may): a figure past LATENCY_CEILING_S, or
    (once its fit stands on COLD_SAMPLES requests) one moved further than FAR_FACTOR either way, from the fit now
    or from `anchor` (the figures at the start of the window: see FAR_FACTOR)."""
    after = _figures(model.trial(fit, svc, now_mono))
    if not all(math.isfinite(v) and 0.0 < v <= LATENCY_CEILING_S for v in after):
        return "it would put a latency past %.0f s" % LATENCY_CEILING_S
    now = figures_now(model, now_mono)
    if now is None:
        return None
    moved = _moved(after, now)
    if moved > FAR_FACTOR:
        return f"it would move this replica's own fit {moved:.3g} times (at most {FAR_FACTOR:g})"
    if anchor is not None:
        moved = _moved(after, anchor)
        if moved > FAR_FACTOR:
            return (f"with what was taken before it, it would move this replica's fit {moved:.3g} times within one "
                    f"half-life (at most {FAR_FACTOR:g})")
    return None
