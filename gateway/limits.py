"""Per-key rate limits: token buckets (requests and tokens per minute), OpenAI's x-ratelimit headers, the limiter."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.config import LimitsConfig, RateLimit
from gateway.contracts import CLIENT_LEFT, OK, Outcome
from gateway.errors import GatewayError, rate_limited

if TYPE_CHECKING:
    from gateway.auth import Principal
    from gateway.limits_redis import SharedBuckets
    from gateway.metrics import Metrics
    from gateway.request import RequestState

# Why token buckets: a bucket holds up to the per-minute limit and refills continuously at limit/60 per second,
# so a key may burst up to its limit and then gets a steady rate, with no burst of twice the limit at a window
# edge as fixed windows allow. OpenAI's "reset" is then the time until the bucket is full again. State is two
# numbers per bucket (level and when it was taken), small enough for one atomic Redis script per request. A
# request draws from every bucket it needs or from none; costs and a full bucket are whole numbers, so the
# check holds exactly at the boundary (rpm = 60: sixty requests at once pass, the sixty-first does not).
REQUESTS, TOKENS = "requests", "tokens"
KINDS = (REQUESTS, TOKENS)
MAX_PLANS = 4096  # (key, model) plans cached; models are the configuration's, so this is never reached in use
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Need:
    """One bucket a request draws from: its identity (kind, key id and model; never the key), and limit."""

    name: str
    kind: str
    limit: int  # per minute
    model: str | None = None


def bucket_name(kind: str, principal: str, model: str | None) -> str:
    # The id's length first, so that no key id and model pair can spell another pair's name.
    return f"{kind}:{len(principal)}:{principal}" + (f":{model}" if model is not None else "")


class Plan:
    """The buckets one key's requests for one model draw from: the key's own, then the model's on top (a request
    needs room in each), with what every check of them needs worked out once."""

    __slots__ = ("caps", "limit_texts", "needs", "one_per_kind", "token_caps", "token_needs", "tokens_at")

    def __init__(self, needs: tuple[Need, ...]) -> None:
        self.needs = needs
        self.caps = tuple(float(n.limit) for n in needs)
        self.tokens_at = tuple(n.kind == TOKENS for n in needs)
        self.token_needs = tuple(n for n in needs if n.kind == TOKENS)
        self.token_caps = tuple(float(n.limit) for n in self.token_needs)
        # Without per-model limits each kind has one bucket: its headers need no search for the tightest.
        self.one_per_kind = len({n.kind for n in needs}) == len(needs)
        self.limit_texts = tuple(str(n.limit) for n in needs)

    def costs(self, tokens: int) -> tuple[int, ...]:
        return tuple([tokens if t else 1 for t in self.tokens_at])


def build_plan(principal: str, limits: RateLimit, model: str | None, per_model: RateLimit | None) -> Plan:
    needs = []
    for scope, m in ((limits, None), (per_model, model)):
        if scope is None:
            continue
        if scope.rpm is not None:
            needs.append(Need(bucket_name(REQUESTS, principal, m), REQUESTS, scope.rpm, m))
        if scope.tpm is not None:
            needs.append(Need(bucket_name(TOKENS, principal, m), TOKENS, scope.tpm, m))
    return Plan(tuple(needs))


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it (Go's notation, to the millisecond): 20ms, 1s, 1.5s, 6m0s."""
    ms = int(seconds * 1000 + 0.5)
    if ms < 1000:
        return f"{ms}ms" if ms > 0 else "0s"
    s, frac = divmod(ms, 1000)
    text = f"{s % 60}.{frac:03d}".rstrip("0") + "s" if frac else f"{s % 60}s"
    if s < 60:
        return text
    h, m = divmod(s // 60, 60)
    return f"{h}h{m}m{text}" if h else f"{m}m{text}"


HEADER_NAMES = {kind: (f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}")
                for kind in KINDS}


def headers(needs: tuple[Need, ...], caps: tuple[float, ...], levels: list[float]) -> dict[str, str]:
    """The x-ratelimit triple of each kind the key is limited in, from that kind's tightest bucket: the least
    remaining, then the longest until full."""
    tightest: dict[str, int] = {}
    for i, n in enumerate(needs):
        j = tightest.get(n.kind)
        if j is None or (levels[i] // 1, (levels[i] - caps[i]) / caps[i]) < (levels[j] // 1,
                                                                             (levels[j] - caps[j]) / caps[j]):
            tightest[n.kind] = i
    out: dict[str, str] = {}
    for kind, i in tightest.items():
        _add(out, HEADER_NAMES[kind], str(int(caps[i])), caps[i], levels[i])
    return out


def plan_headers(plan: Plan, caps: tuple[float, ...], levels: list[float]) -> dict[str, str]:
    """headers() for a plan's buckets, the common plan (one bucket per kind) without any search."""
    if not plan.one_per_kind:
        return headers(plan.needs, caps, levels)
    out: dict[str, str] = {}
    exact = caps is plan.caps  # whole limits (not this process's share): their text is ready
    for i, n in enumerate(plan.needs):
        limit_name, remaining_name, reset_name = HEADER_NAMES[n.kind]
        cap, level = caps[i], levels[i]
        out[limit_name] = plan.limit_texts[i] if exact else str(int(cap))
        out[remaining_name] = str(int(level)) if level > 0 else "0"
        out[reset_name] = duration((cap - level) * 60.0 / cap)
    return out


def _add(out: dict[str, str], names: tuple[str, str, str], limit: str, cap: float, level: float) -> None:
    out[names[0]] = limit
    out[names[1]] = str(int(level)) if level > 0 else "0"
    out[names[2]] = duration((cap - level) * 60.0 / cap)


class Buckets:
    """Token buckets of one process: [level, taken at] by bucket name. Used for every decision with memory state,
    and while the shared store does not answer with Redis state."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._state: dict[str, list[float]] = {}  # name -> [level, taken at] (a monotonic clock)

    def take(self, needs: tuple[Need, ...], caps: tuple[float, ...],
             costs: tuple[int, ...]) -> tuple[int, list[float]]:
        """(index of the first bucket without room, or -1 when all had room and were charged; levels after)."""
        now = self.clock()
        get = self._state.get
        found = []
        levels = []
        short = -1
        for i, n in enumerate(needs):  # one pass: the per-request path
            s = get(n.name)
            cap = caps[i]
            level = cap if s is None else s[0] + (now - s[1]) * cap / 60.0
            if level > cap:
                level = cap
            if short < 0 and level < costs[i]:
                short = i
            found.append(s)
            levels.append(level)
        if short >= 0:
            return short, levels
        state = self._state
        for i, s in enumerate(found):
            level = levels[i] = levels[i] - costs[i]
            if s is None:
                state[needs[i].name] = [level, now]
            else:
                s[0] = level
                s[1] = now
        return -1, levels

    def adjust(self, needs: tuple[Need, ...], caps: tuple[float, ...], delta: int) -> None:
        """Charge `delta` more tokens (a refund when negative) once a request's usage is known."""
        now = self.clock()
        state = self._state
        for n, cap in zip(needs, caps):
            s = state.get(n.name)
            level = cap if s is None else s[0] + (now - s[1]) * cap / 60.0
            level = (cap if level > cap else level) - delta
            if level >= cap:
                state.pop(n.name, None)  # full: the same as never used
            elif s is None:
                state[n.name] = [level, now]
            else:
                s[0] = level
                s[1] = now

    def clear(self) -> None:
        self._state.clear()


class Reservation:
    """What a request took: the headers its replies carry, and the tokens to settle once usage is known."""

    __slots__ = ("headers", "plan", "shared", "token_caps", "tokens")

    def __init__(self, headers: dict[str, str], tokens: int, plan: Plan, token_caps: tuple[float, ...],
                 shared: bool) -> None:
        self.headers = headers
        self.tokens = tokens
        self.plan = plan
        self.token_caps = token_caps
        self.shared = shared  # taken from the shared store (settled there), else from this process's buckets


def used_tokens(o: Outcome | None) -> int:
    """Tokens a request is charged: the usage of a reply that was served (or cut short by its client); nothing
    for a request no engine served (refused, engine failed, rejected by the engine as invalid)."""
    if o is None or o.result not in (OK, CLIENT_LEFT):
        return 0
    return o.prompt_tokens + o.completion_tokens


def refusal(principal: str, needs: tuple[Need, ...], caps: tuple[float, ...], levels: list[float],
            costs: tuple[int, ...], hdrs: dict[str, str]) -> GatewayError:
    """OpenAI's 429: `type` says which kind ran out, Retry-After when the buckets have room again. A request
    larger than a whole tokens-per-minute limit can never pass: it says so and asks SDKs not to retry."""
    for n, cap, cost in zip(needs, caps, costs):
        if n.kind == TOKENS and cost > cap:
            where = f" for model `{n.model}`" if n.model else ""
            return rate_limited(f"Request too large for key `{principal}`{where}: it needs about {cost} tokens, "
                                f"more than the limit of {math.floor(cap)} tokens per minute. Shorten the prompt "
                                f"or lower max_tokens.", TOKENS, None, hdrs)
    short = [(n, cap, level, cost) for n, cap, level, cost in zip(needs, caps, levels, costs) if level < cost]
    wait = max((cost - level) * 60.0 / cap for _, cap, level, cost in short)
    n, cap, level, cost = short[0]
    unit = "requests per min (RPM)" if n.kind == REQUESTS else "tokens per min (TPM)"
    where = f" for model `{n.model}`" if n.model else ""
    used = math.ceil(cap - level)
    return rate_limited(f"Rate limit reached for key `{principal}`{where} on {unit}: Limit {math.floor(cap)}, "
                        f"Used {used}, Requested {cost}. Please try again in {duration(wait)}.", n.kind, wait, hdrs)


class Limiter:
    """Checks each request of a limited key against its buckets, shared through Redis when the state is, and
    remembers what it took until the request ends (its replies' headers, then settlement from its usage)."""

    def __init__(self, metrics: Metrics, local_share: Callable[[], int], shared: SharedBuckets | None = None,
                 clock: Clock = time.monotonic) -> None:
        self.metrics = metrics
        self.local = Buckets(clock)
        self.shared = shared
        if shared is not None:
            shared.on_recover = self.local.clear  # each outage starts from full local buckets
        self.local_share = local_share  # how many processes split a limit when this one enforces it alone
        self._plans: dict[tuple[str, str], tuple[RateLimit, Plan | None]] = {}
        self.unsettled = 0  # requests that took from a bucket and have not ended yet

    def plan(self, principal: Principal, model: str, defaults: LimitsConfig) -> Plan | None:
        """The buckets a request of this key for this model draws from; None (at once) for a key without limits."""
        limits = principal.limits if principal.limits is not None else defaults
        if limits.rpm is None and limits.tpm is None and not limits.models:
            return None
        per_model = limits.models.get(model)
        key = (principal.id, model if per_model is not None else "")
        hit = self._plans.get(key)
        if hit is not None and hit[0] is limits:  # a reload or another key set makes new objects
            return hit[1]
        plan = build_plan(principal.id, limits, model, per_model)
        if not plan.needs:
            plan = None
        if len(self._plans) < MAX_PLANS:
            self._plans[key] = (limits, plan)
        return plan

    async def reserve(self, st: RequestState, plan: Plan, tokens: int, cfg: LimitsConfig) -> None:
        """Take one request and `tokens` from every bucket, or raise the 429 of the first without room."""
        needs, costs = plan.needs, plan.costs(tokens)
        shared = self.shared
        result = await shared.take(needs, costs, cfg.redis_timeout_s) if shared is not None else None
        if result is not None:
            caps, token_caps = plan.caps, plan.token_caps
            refused, levels = result
        else:
            share = self.local_share()
            if share == 1:
                caps, token_caps = plan.caps, plan.token_caps
            else:  # this process's share, never below one request or the tokens of this one
                caps = tuple([max(c / share, min(c, float(cost))) for c, cost in zip(plan.caps, costs)])
                token_caps = tuple([c for c, t in zip(caps, plan.tokens_at) if t])
            refused, levels = self.local.take(needs, caps, costs)
        hdrs = plan_headers(plan, caps, levels)
        if refused >= 0:
            self.metrics.limit_refused(needs[refused].kind)
            assert st.principal is not None  # checked before the pipeline runs
            raise refusal(st.principal.id, needs, caps, levels, costs, hdrs)
        st.limit = Reservation(hdrs, tokens, plan, token_caps, result is not None)
        self.unsettled += 1

    def settle(self, st: RequestState, r: Reservation) -> None:
        """At the end of a request that took `r`: its tokens are charged from usage instead of the estimate."""
        st.limit = None
        self.unsettled -= 1
        if not r.token_caps:
            return
        delta = used_tokens(st.outcome) - r.tokens
        if delta == 0:
            return
        if r.shared and self.shared is not None:
            self.shared.settle(r.plan.token_needs, delta)
        else:
            self.local.adjust(r.plan.token_needs, r.token_caps, delta)
