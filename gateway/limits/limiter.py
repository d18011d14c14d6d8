"""Per-key rate limits: token buckets (requests and tokens per minute), OpenAI's x-ratelimit headers, the limiter."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import floor
from typing import TYPE_CHECKING, Final, NoReturn

from gateway.config import LimitsConfig, RateLimit
from gateway.contracts import CLIENT_LEFT, OK, Outcome
from gateway.errors import GatewayError, rate_limited

if TYPE_CHECKING:
    from gateway.keys.auth import Principal
    from gateway.limits.redis_buckets import SharedBuckets
    from gateway.observe.metrics import Metrics
    from gateway.routing.request import RequestState

# Why token buckets: a bucket holds up to the per-minute limit and refills continuously at limit/60 per second,
# so a key may burst up to its limit and then gets a steady rate, with no burst of twice the limit at a window
# edge as fixed windows allow. OpenAI's "reset" is then the time until the bucket is full again. State is two
# numbers per bucket (level and when it was taken), small enough for one atomic Redis script per request. A
# request draws from every bucket it needs or from none; costs and a full bucket are whole numbers, so the
# check holds exactly at the boundary (rpm = 60: sixty requests at once pass, the sixty-first does not).
REQUESTS: Final = "requests"
TOKENS: Final = "tokens"
KINDS: Final = (REQUESTS, TOKENS)
MAX_PLANS: Final = 4096  # plans cached, by key or by key and model (past this, a plan is built per request)
Clock = Callable[[], float]
CHARGED: Final = (OK, CLIENT_LEFT)  # results whose usage a key is charged: served, or cut short by its client


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

    __slots__ = ("caps", "common", "common_heads", "line_parts", "limit_texts", "needs", "one_per_kind", "rates",
                 "slots", "token_caps", "token_needs", "token_slots", "tokens_at")

    def __init__(self, needs: tuple[Need, ...]) -> None:
        self.needs = needs
        self.caps = tuple(float(n.limit) for n in needs)
        self.tokens_at = tuple(n.kind == TOKENS for n in needs)
        self.token_needs = tuple(n for n in needs if n.kind == TOKENS)
        self.token_caps = tuple(float(n.limit) for n in self.token_needs)
        # Without per-model limits each kind has one bucket: its headers need no search for the tightest.
        self.one_per_kind = len({n.kind for n in needs}) == len(needs)
        self.limit_texts = tuple(str(n.limit) for n in needs)
        self.line_parts = tuple(LINE_PARTS[n.kind] for n in needs)
        self.common = self.tokens_at == (False, True)  # a requests and a tokens limit: costs (1, tokens)
        self.rates = tuple(c / 60.0 for c in self.caps)  # refill per second
        # Each kind's limit line and the name of the remaining line, the text before its value (Limiter.take).
        self.common_heads = tuple(f"{a}{text}{b}" for (a, b, _), text in zip(self.line_parts, self.limit_texts))
        # This process's state of each bucket, bound by the limiter that uses the plan (Buckets.slots).
        self.slots: tuple[list[float], ...] = ()
        self.token_slots: tuple[list[float], ...] = ()

    def bind(self, buckets: Buckets) -> Plan:
        self.slots = buckets.slots(self.needs)
        self.token_slots = tuple(s for s, t in zip(self.slots, self.tokens_at) if t)
        return self

    def costs(self, tokens: int) -> tuple[int, ...]:
        return (1, tokens) if self.common else tuple([tokens if t else 1 for t in self.tokens_at])


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
    return duration_ms(int(seconds * 1000 + 0.5))


def duration_ms(ms: int) -> str:
    if ms < 1000:
        return f"{ms}ms" if ms > 0 else "0s"
    s, frac = divmod(ms, 1000)
    text = f"{s % 60}.{frac:03d}".rstrip("0") + "s" if frac else f"{s % 60}s"
    if s < 60:
        return text
    h, m = divmod(s // 60, 60)
    return f"{h}h{m}m{text}" if h else f"{m}m{text}"


# The texts of durations under a minute, by part, for the x-ratelimit-reset headers every reply of a limited key
# carries: list indexes instead of formatting. A bucket's reset is at most a minute unless usage overdrew it.
MS_TEXTS: Final = tuple(duration_ms(ms) for ms in range(1000))  # "0s", "1ms" ... "999ms"
SECOND_TEXTS: Final = tuple(str(s) for s in range(60))
FRACTION_TEXTS: Final = tuple(f".{ms:03d}".rstrip("0") + "s" if ms else "s" for ms in range(1000))  # "s", ".001s" ... ".999s"


def reset_text(ms: int) -> str:
    """duration_ms(ms), from the tables when under a minute."""
    if ms < 1000:
        return MS_TEXTS[ms] if ms > 0 else "0s"
    if ms < 60000:
        return SECOND_TEXTS[ms // 1000] + FRACTION_TEXTS[ms % 1000]
    return duration_ms(ms)


HEADER_NAMES: Final = {kind: (f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}")
                for kind in KINDS}
# The same triple as reply-head lines: the text before each of the three values (the per-request path joins
# them with the values in one f-string).
LINE_PARTS: Final = {kind: (f"{limit}: ", f"\r\n{remaining}: ", f"\r\n{reset}: ")
              for kind, (limit, remaining, reset) in HEADER_NAMES.items()}


def headers(needs: tuple[Need, ...], caps: tuple[float, ...], levels: Sequence[float]) -> dict[str, str]:
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
        names, cap, level = HEADER_NAMES[kind], caps[i], levels[i]
        out[names[0]] = str(int(cap))
        out[names[1]] = str(int(level)) if level > 0 else "0"
        out[names[2]] = reset_text(int((cap - level) * 60000.0 / cap + 0.5))
    return out


def plan_headers(plan: Plan, caps: tuple[float, ...], levels: Sequence[float]) -> dict[str, str]:
    """headers() for a plan's buckets (what an error reply carries)."""
    return headers(plan.needs, caps, levels)


def plan_lines(plan: Plan, caps: tuple[float, ...], levels: Sequence[float]) -> str:
    """plan_headers() as reply-head lines; a plan with one bucket per kind without a search or a dict."""
    if not plan.one_per_kind:
        return "".join([f"{k}: {v}\r\n" for k, v in headers(plan.needs, caps, levels).items()])
    exact = caps is plan.caps  # whole limits (not this process's share): their text is ready
    out = ""
    for (a, b, c), text, cap, level in zip(plan.line_parts, plan.limit_texts, caps, levels):
        ms = int((cap - level) * 60000.0 / cap + 0.5)
        out += (f"{a}{text if exact else int(cap)}{b}{int(level) if level > 0 else 0}{c}"
                f"{reset_text(ms)}\r\n")
    return out


class Buckets:
    """Token buckets of one process: [level, taken at] by bucket name. Used for every decision with memory state,
    and while the shared store does not answer with Redis state. A plan holds its buckets' state lists (bound
    once), so a request finds them without a lookup; an unused bucket is full (level infinite, cut to its
    limit when read)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._state: dict[str, list[float]] = {}  # name -> [level, taken at] (a monotonic clock)

    def slots(self, needs: tuple[Need, ...]) -> tuple[list[float], ...]:
        return tuple([self._state.setdefault(n.name, [math.inf, 0.0]) for n in needs])

    def take_slots(self, slots: tuple[list[float], ...], caps: tuple[float, ...], costs: tuple[int, ...],
                   now: float) -> tuple[int, list[float]]:
        """(index of the first bucket without room, or -1 when all had room and were charged; levels after)."""
        levels = []
        short = -1
        for i, s in enumerate(slots):  # one pass to check, one to charge: the per-request path
            cap = caps[i]
            level = s[0] + (now - s[1]) * (cap / 60.0)
            if level > cap:
                level = cap
            if short < 0 and level < costs[i]:
                short = i
            levels.append(level)
        if short >= 0:
            return short, levels
        for i, s in enumerate(slots):
            levels[i] = s[0] = levels[i] - costs[i]
            s[1] = now
        return -1, levels

    def adjust_slots(self, slots: tuple[list[float], ...], caps: tuple[float, ...], delta: int) -> None:
        """Charge `delta` more tokens (a refund when negative) once a request's usage is known."""
        now = self.clock()
        for s, cap in zip(slots, caps):
            level = s[0] + (now - s[1]) * (cap / 60.0)
            s[0] = (cap if level > cap else level) - delta
            s[1] = now

    def clear(self) -> None:
        for s in self._state.values():  # in place: plans hold these lists
            s[0] = math.inf


# What a request took from its key's buckets, kept on its state until it ends: (plan, caps: the plan's limits or this
# process's share of them, its buckets' levels after, tokens taken, taken from the shared store (settled there)
# rather than this process's buckets). A plain tuple: one is made for every request of a limited key, in a
# quarter of the time a named tuple takes. Its replies' x-ratelimit lines are on the request's state (limit_lines).
Reservation = tuple[Plan, tuple[float, ...], Sequence[float], int, bool]


def reservation_headers(r: Reservation) -> dict[str, str]:
    """The x-ratelimit headers of a reservation (what an error reply after it carries)."""
    plan, caps, levels, _, _ = r
    return plan_headers(plan, caps, levels)


def used_tokens(o: Outcome | None) -> int:
    """Tokens a request is charged: the usage of a reply that was served (or cut short by its client); nothing
    for a request no engine served (refused, engine failed, rejected by the engine as invalid)."""
    if o is None or o.result not in CHARGED:
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
        self.share = local_share() if shared is None else 1  # memory state: a worker group's size, fixed at start
        self._plans: dict[str | tuple[str, str], tuple[RateLimit, Plan | None]] = {}
        self.unsettled = 0  # requests that took from a bucket and have not ended yet

    def plan(self, principal: Principal, model: str, defaults: LimitsConfig) -> Plan | None:
        """The buckets a request of this key for this model draws from; None for a key without limits."""
        limits = principal.limits if principal.limits is not None else defaults
        # One plan per key, and one per key and model for a model with limits of its own.
        key: str | tuple[str, str] = (principal.id, model) if model in limits.models else principal.id
        hit = self._plans.get(key)
        if hit is not None and hit[0] is limits:  # a reload or another key set makes new objects
            return hit[1]
        built = build_plan(principal.id, limits, model, limits.models.get(model))
        plan = built.bind(self.local) if built.needs else None
        if len(self._plans) < MAX_PLANS:
            self._plans[key] = (limits, plan)
        return plan

    def take(self, st: RequestState, plan: Plan, tokens: int, now: float, share: int = 0) -> None:
        """Take one request and `tokens` from every bucket of this process (memory state: decided at once), or raise
        the 429 of the first without room. `share`: how many processes split each limit (0: the fixed number of
        a memory-state group)."""
        share = share or self.share
        if share == 1 and plan.common:
            # The usual plan (a requests and a tokens bucket) at whole limits, the path every request of such a key
            # takes: unrolled, and its lines written here. Anything else, a refusal included (it says why), goes
            # the general way below, which decides the same (a test holds them together).
            r, t = plan.slots
            rcap, tcap = plan.caps
            rrate, trate = plan.rates
            rlevel = r[0] + (now - r[1]) * rrate
            if rlevel > rcap:
                rlevel = rcap
            tlevel = t[0] + (now - t[1]) * trate
            if tlevel > tcap:
                tlevel = tcap
            if rlevel >= 1 and tlevel >= tokens:
                r[0] = rlevel = rlevel - 1
                t[0] = tlevel = tlevel - tokens
                r[1] = t[1] = now
                # floor() rather than int(): the same for these non-negative numbers, in a third of the time
                rms, tms = floor((rcap - rlevel) * 60000.0 / rcap + 0.5), floor((tcap - tlevel) * 60000.0 / tcap + 0.5)
                rhead, thead = plan.common_heads
                lines = (f"{rhead}{floor(rlevel)}\r\n"
                         f"x-ratelimit-reset-requests: {MS_TEXTS[rms] if rms < 1000 else reset_text(rms)}\r\n"
                         f"{thead}{floor(tlevel)}\r\n"
                         f"x-ratelimit-reset-tokens: {MS_TEXTS[tms] if tms < 1000 else reset_text(tms)}\r\n")
                st.limit = (plan, plan.caps, (rlevel, tlevel), tokens, False)
                st.limit_lines = lines
                self.unsettled += 1
                return
        costs = plan.costs(tokens)
        # With several processes and no shared store, this process's share: never below one request or the
        # tokens of this one.
        caps = plan.caps if share == 1 else tuple([max(c / share, min(c, float(cost)))
                                                   for c, cost in zip(plan.caps, costs)])
        refused, levels = self.local.take_slots(plan.slots, caps, costs, now)
        if refused >= 0:
            self._refuse(st, plan, caps, levels, costs, refused)
        st.limit = (plan, caps, levels, tokens, False)
        st.limit_lines = plan_lines(plan, caps, levels)
        self.unsettled += 1

    async def reserve(self, st: RequestState, plan: Plan, tokens: int, cfg: LimitsConfig) -> None:
        """take(), from the buckets shared through Redis when the state is (this process's, on its share of each
        limit, when Redis does not answer in time)."""
        shared = self.shared
        if shared is None:
            return self.take(st, plan, tokens, self.local.clock())
        costs = plan.costs(tokens)
        result = await shared.take(plan.needs, costs, cfg.redis_timeout_s)
        if result is None:
            return self.take(st, plan, tokens, self.local.clock(), self.local_share())
        refused, levels = result
        if refused >= 0:
            self._refuse(st, plan, plan.caps, levels, costs, refused)
        st.limit = (plan, plan.caps, levels, tokens, True)
        st.limit_lines = plan_lines(plan, plan.caps, levels)
        self.unsettled += 1

    def _refuse(self, st: RequestState, plan: Plan, caps: tuple[float, ...], levels: list[float],
                costs: tuple[int, ...], refused: int) -> NoReturn:
        self.metrics.limit_refused(plan.needs[refused].kind)
        assert st.principal is not None  # checked before the pipeline runs
        raise refusal(st.principal.id, plan.needs, caps, levels, costs, plan_headers(plan, caps, levels))

    def settle(self, st: RequestState, r: Reservation) -> None:
        """At the end of a request that took `r`: its tokens are charged from usage instead of the estimate."""
        st.limit = None
        self.unsettled -= 1
        plan, caps, _, tokens, shared = r
        if not plan.token_needs:
            return
        o = st.outcome  # used_tokens(o), written out: this runs for every request of a limited key
        delta = (o.prompt_tokens + o.completion_tokens if o is not None and o.result in CHARGED else 0) - tokens
        if delta == 0:
            return
        if shared and self.shared is not None:
            self.shared.settle(plan.token_needs, delta)
        elif plan.common and caps is plan.caps:  # the usual plan at whole limits: one tokens bucket
            t, cap, now = plan.slots[1], caps[1], self.local.clock()
            level = t[0] + (now - t[1]) * plan.rates[1]
            t[0] = (cap if level > cap else level) - delta
            t[1] = now
        else:
            token_caps = plan.token_caps if caps is plan.caps else tuple(
                [c for c, t in zip(caps, plan.tokens_at) if t])
            self.local.adjust_slots(plan.token_slots, token_caps, delta)
