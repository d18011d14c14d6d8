"""Per-key rate limits: the buckets and quotas a key's requests draw from (Plan), OpenAI's x-ratelimit headers, the limiter."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from math import floor
from typing import TYPE_CHECKING, Any, Final, NoReturn

from gateway.config import KeyLimits, LimitsConfig, RateLimit
from gateway.contracts import CLIENT_LEFT, OK, Outcome, RequestShape
from gateway.errors import GatewayError, rate_limited
from gateway.limits.buckets import REQUESTS, TOKENS, Buckets, Clock, Need, level_at
from gateway.limits.headers import LINE_PARTS, MS_TEXTS, duration, headers, kind_lines, lines, reset_text
from gateway.limits.quotas import (PlanQuotas, QuotaNeed, Quotas, QuotaSlot, build_quotas, expire_ms, quota_lines,
                                   quota_refusal, report_row)

if TYPE_CHECKING:
    from gateway.keys.principal import Principal
    from gateway.limits.redis_buckets import SharedBuckets
    from gateway.observe.metrics import Metrics

MAX_PLANS: Final = 4096  # plans cached, by key or by key and model (past this, a plan is built per request)
CHARGED: Final = (OK, CLIENT_LEFT)  # results whose usage a key is charged: served, or cut short by its client
# The fields that cap a request's output (gateway/routing/shape.py's requested_output reads the first that is a
# positive integer).
OUTPUT_CAPS: Final = ("max_completion_tokens", "max_tokens", "n_predict", "max_output_tokens")


def bucket_name(kind: str, principal: str, model: str | None) -> str:
    # The id's length first, so that no key id and model pair can spell another pair's name.
    return f"{kind}:{len(principal)}:{principal}" + (f":{model}" if model is not None else "")


class Plan:
    """The buckets one key's requests for one model draw from: the key's own, then the model's on top (a request
    needs room in each), with what every check of them needs worked out once."""

    __slots__ = ("caps", "common", "common_heads", "limit_texts", "line_parts", "needs", "one_per_kind", "outage",
                 "principal", "quotas", "seen", "slots", "token_caps", "token_needs", "token_slots", "tokens_at",
                 "whole_tokens")

    def __init__(self, principal: str, needs: tuple[Need, ...], quotas: PlanQuotas | None = None) -> None:
        self.principal = principal  # the key's id (a refusal names it)
        self.needs = needs
        self.quotas = quotas  # its token quotas per day and month (gateway/limits/quotas.py), if it has any
        self.caps = tuple(float(n.limit) for n in needs)
        self.tokens_at = tuple(n.kind == TOKENS for n in needs)
        self.token_needs = tuple(n for n in needs if n.kind == TOKENS)
        self.token_caps = tuple(float(n.limit) for n in self.token_needs)
        # Without per-model limits each kind has one bucket: its headers need no search for the tightest.
        self.one_per_kind = len({n.kind for n in needs}) == len(needs)
        self.limit_texts = tuple(str(n.limit) for n in needs)
        self.line_parts = tuple(LINE_PARTS[n.kind] for n in needs)
        self.common = self.tokens_at == (False, True)  # a requests and a tokens limit: costs (1, tokens)
        # Each kind's limit line and the name of the remaining line, the text before its value (Limiter.take).
        self.common_heads = tuple(f"{a}{text}{b}" for (a, b, _), text in zip(self.line_parts, self.limit_texts))
        # This process's state of each bucket, bound by the limiter that uses the plan (Buckets.slots).
        self.slots: tuple[list[float], ...] = ()
        self.token_slots: tuple[list[float], ...] = ()
        # What a request whose output the gateway cannot read reserves: the tightest tokens limit, whole.
        self.whole_tokens = min([n.limit for n in self.token_needs], default=0)
        # With Redis: the buckets' levels in its last answer (a reference kept, nothing computed on that path),
        # and the outage (SharedBuckets.outages) in which this process's buckets were last lowered to them.
        self.seen: list[float] | None = None
        self.outage = 0

    def bind(self, buckets: Buckets, quotas: Quotas) -> Plan:
        self.slots = buckets.slots(self.needs)
        self.token_slots = tuple(s for s, t in zip(self.slots, self.tokens_at) if t)
        if self.quotas is not None:
            self.quotas.bind(quotas)
        return self

    def costs(self, tokens: int) -> tuple[int, ...]:
        return (1, tokens) if self.common else tuple([tokens if t else 1 for t in self.tokens_at])

    def tokens(self, shape: RequestShape, body: dict[str, Any]) -> int:
        """Tokens a request reserves: its prompt once, and its output cap (or expected output) once for each of
        its `n` choices. An `n` or an output cap the shape stage could not read (not a positive integer: a
        string, a float, a bool, zero or below, which it passes on for the engine to judge, and which an engine
        may read as a number, or as no cap at all like llama.cpp's n_predict = -1) reserves the key's whole
        tokens limit: such a request passes only on a full bucket, and is settled from its usage like any."""
        n = body.get("n")
        if n is None:
            choices = 1
        elif type(n) is int and n > 0:  # type(): a bool is no count
            choices = n
        else:
            return max(shape.prompt_tokens + shape.output_tokens, self.whole_tokens)
        output = shape.output_tokens if choices == 1 else shape.output_tokens * choices
        if shape.max_output is None and self.whole_tokens and shape.route != "embeddings":
            for name in OUTPUT_CAPS:  # one of them set, yet none read: not a positive integer
                if body.get(name) is not None:
                    return max(shape.prompt_tokens + output, self.whole_tokens)
        return shape.prompt_tokens + output


def build_plan(principal: str, limits: RateLimit, model: str | None, per_model: RateLimit | None) -> Plan:
    needs = []
    scopes = []
    for scope, m in ((limits, None), (per_model, model)):
        if scope is None:
            continue
        if scope.rpm is not None:
            needs.append(Need(bucket_name(REQUESTS, principal, m), REQUESTS, scope.rpm, m))
        if scope.tpm is not None:
            needs.append(Need(bucket_name(TOKENS, principal, m), TOKENS, scope.tpm, m))
        scopes.append((scope.tokens_per_day, scope.tokens_per_month, m))
    return Plan(principal, tuple(needs), build_quotas(principal, scopes))


def plan_lines(plan: Plan, caps: tuple[float, ...], levels: Sequence[float]) -> str:
    """lines() for a plan's buckets; a plan with one bucket per kind without a search."""
    if not plan.one_per_kind:
        return lines(plan.needs, caps, levels)
    exact = caps is plan.caps  # whole limits (not this process's share): their text is ready
    out = ""
    for parts, text, cap, level in zip(plan.line_parts, plan.limit_texts, caps, levels):
        out += kind_lines(parts, text if exact else str(int(cap)), cap, level)
    return out


class Reservation:
    """What a request took from its key's buckets and quotas, kept on its state until it ends: the plan, caps (the
    plan's limits or this process's share of them), its buckets' levels after, the tokens taken, whether from the
    shared store (settled there) rather than this process's buckets, its replies' x-ratelimit lines, and the
    quota slots it charged with the periods they were in and their keys in the shared store."""

    __slots__ = ("limiter", "plan", "caps", "levels", "tokens", "shared", "lines", "qslots", "qperiods", "qkeys")

    def __init__(self, limiter: Limiter, plan: Plan, caps: tuple[float, ...], levels: Sequence[float], tokens: int,
                 shared: bool, lines: str, qslots: tuple[QuotaSlot, ...] = (), qkeys: tuple[str, ...] = ()) -> None:
        self.limiter = limiter
        self.plan = plan
        self.caps = caps
        self.levels = levels
        self.tokens = tokens
        self.shared = shared
        self.lines = lines
        self.qslots = qslots
        self.qperiods = tuple([q.period for q in qslots])
        self.qkeys = qkeys

    def headers(self) -> dict[str, str]:
        """The x-ratelimit headers (what an error reply after it carries)."""
        return line_headers(self.lines)

    def settle(self, o: Outcome | None) -> None:
        """At the end of the request that took it, `o` its last attempt (None: no backend was tried)."""
        self.limiter.settle(self, o)


def line_headers(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.split("\r\n"):
        if line:
            name, _, value = line.partition(": ")
            out[name] = value
    return out


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
                                f"or lower max_tokens (or n).", TOKENS, None, hdrs)
    short = [(n, cap, level, cost) for n, cap, level, cost in zip(needs, caps, levels, costs) if level < cost]
    wait = max((cost - level) * 60.0 / cap for _, cap, level, cost in short)
    n, cap, level, cost = short[0]
    unit = "requests per min (RPM)" if n.kind == REQUESTS else "tokens per min (TPM)"
    where = f" for model `{n.model}`" if n.model else ""
    used = math.ceil(cap - level)
    return rate_limited(f"Rate limit reached for key `{principal}`{where} on {unit}: Limit {math.floor(cap)}, "
                        f"Used {used}, Requested {cost}. Please try again in {duration(wait)}.", n.kind, wait, hdrs)


class Limiter:
    """Checks each request of a limited key against its buckets and quotas, shared through Redis when the state is,
    and returns what it took (its replies' headers, then settlement from its usage)."""

    def __init__(self, metrics: Metrics, local_share: Callable[[], int], shared: SharedBuckets | None = None,
                 clock: Clock = time.monotonic, wall: Clock = time.time) -> None:
        self.metrics = metrics
        self.local = Buckets(clock)
        self.quotas = Quotas(wall)  # on the wall clock: periods are UTC days and months
        self.shared = shared
        if shared is not None:
            shared.quota_view = self.quotas.known  # what it tells a Redis that lost the quotas (restart)
        # How many processes split a limit when this one enforces it alone (with Redis: at least [limits]
        # processes, see _alone()).
        self.local_share = local_share
        self.share = local_share() if shared is None else 1  # memory state: a worker group's size, fixed at start
        self._plans: dict[str | tuple[str, str], tuple[RateLimit, Plan | None]] = {}
        self.unsettled = 0  # requests that took from a bucket and have not ended yet

    def plan(self, principal: Principal, model: str, defaults: LimitsConfig) -> Plan | None:
        """The buckets and quotas a request of this key for this model draws from; None for a key without limits."""
        limits = principal.limits if principal.limits is not None else defaults
        # One plan per key, and one per key and model for a model with limits of its own.
        key: str | tuple[str, str] = (principal.id, model) if model in limits.models else principal.id
        hit = self._plans.get(key)
        if hit is not None and hit[0] is limits:  # a reload or another key set makes new objects
            return hit[1]
        built = build_plan(principal.id, limits, model, limits.models.get(model))
        plan = built.bind(self.local, self.quotas) if built.needs or built.quotas is not None else None
        if len(self._plans) < MAX_PLANS:
            self._plans[key] = (limits, plan)
        return plan

    def take(self, plan: Plan, tokens: int, now: float, share: int = 0, outage: int = 0) -> Reservation:
        """Take one request and `tokens` from every bucket and quota of this process (memory state: decided at
        once), or raise the 429 of the first without room. `share`: how many processes split each limit (0: the
        fixed number of a memory-state group); `outage`: the outage this process decides alone in (quotas split
        what was left when it began)."""
        share = share or self.share
        q = plan.quotas
        if share == 1 and plan.common:
            # The usual plan (a requests and a tokens bucket) at whole limits, the path every request of such a key
            # takes: unrolled. Anything else, a refusal included (it says why), goes the general way below, which
            # decides the same (a test holds them together). Quotas first: checked, charged once the buckets were.
            qslots: tuple[QuotaSlot, ...] = self._quota_check(plan, q, tokens, 1, outage) if q is not None else ()
            r, t = plan.slots
            rcap, tcap = plan.caps
            rlevel, tlevel = level_at(r, rcap, now), level_at(t, tcap, now)
            if rlevel >= 1 and tlevel >= tokens:
                r[0] = rlevel = rlevel - 1
                t[0] = tlevel = tlevel - tokens
                r[1] = t[1] = now
                # plan_lines(), written out for these two buckets (a test holds them equal): floor() rather than
                # int(), the same for these non-negative numbers in a third of the time
                rms, tms = floor((rcap - rlevel) * 60000.0 / rcap + 0.5), floor((tcap - tlevel) * 60000.0 / tcap + 0.5)
                rhead, thead = plan.common_heads
                lines = (f"{rhead}{floor(rlevel)}\r\n"
                         f"x-ratelimit-reset-requests: {MS_TEXTS[rms] if rms < 1000 else reset_text(rms)}\r\n"
                         f"{thead}{floor(tlevel)}\r\n"
                         f"x-ratelimit-reset-tokens: {MS_TEXTS[tms] if tms < 1000 else reset_text(tms)}\r\n")
                self.unsettled += 1
                if q is None:
                    return Reservation(self, plan, plan.caps, (rlevel, tlevel), tokens, False, lines)
                for s in qslots:
                    s.used += tokens
                return Reservation(self, plan, plan.caps, (rlevel, tlevel), tokens, False,
                                   lines + self.quotas.lines(q, qslots), qslots)
        costs = plan.costs(tokens)
        # With several processes and no shared store, this process's share: never below one request or the
        # tokens of this one.
        caps = plan.caps if share == 1 else tuple([max(c / share, min(c, float(cost)))
                                                   for c, cost in zip(plan.caps, costs)])
        qslots = self._quota_check(plan, q, tokens, share, outage) if q is not None else ()
        refused, levels = self.local.take_slots(plan.slots, caps, costs, now)
        if refused >= 0:
            self._refuse(plan, caps, levels, costs, refused)
        for s in qslots:
            s.used += tokens
        return self._taken(plan, caps, levels, tokens, False, qslots)

    def _quota_check(self, plan: Plan, q: PlanQuotas, tokens: int, share: int, outage: int) -> tuple[QuotaSlot, ...]:
        try:
            return self.quotas.check(plan.principal, q.needs, q.slots, tokens, share, outage,
                                     lambda: line_headers(self._quota_lines(q.needs, q.slots)))
        except GatewayError:
            self.metrics.limit_refused("quota")
            raise

    async def quota_report(self, keys: Sequence[tuple[str, KeyLimits]]) -> dict[str, list[dict[str, object]]]:
        """Each key's quotas (key id, its limits or the defaults it falls back on) with the tokens used in the
        current periods: from Redis when it answers (one read for all), else as this process knows them."""
        periods = self.quotas.periods
        periods.now()
        found: list[tuple[str, QuotaNeed]] = []
        for key_id, limits in keys:
            scopes: list[tuple[int | None, int | None, str | None]] = [
                (limits.tokens_per_day, limits.tokens_per_month, None)]
            scopes += [(m.tokens_per_day, m.tokens_per_month, name) for name, m in sorted(limits.models.items())]
            q = build_quotas(key_id, scopes)
            if q is not None:
                found += [(key_id, n) for n in q.needs]
        used: list[float | None] = [None] * len(found)
        if self.shared is not None and found:
            read = await self.shared.read_quotas([f"{self.shared.prefix}{n.name}:{periods.texts[n.period]}"
                                                  for _, n in found])
            if read is not None:
                used = read
        out: dict[str, list[dict[str, object]]] = {}
        for (key_id, n), u in zip(found, used):
            if u is None:
                u = self.quotas.used(n, periods.numbers[n.period])
            out.setdefault(key_id, []).append(report_row(n, u, periods))
        return out

    def _quota_lines(self, needs: Sequence[Any], slots: Sequence[QuotaSlot]) -> str:
        p = self.quotas.periods
        return quota_lines(needs, slots, p.ends, p.now())

    async def reserve(self, plan: Plan, tokens: int, cfg: LimitsConfig) -> Reservation:
        """take(), from the buckets and quotas shared through Redis when the state is (this process's, on its share
        of each limit, when Redis does not answer in time, fails or is full, or lost them in a restart)."""
        shared = self.shared
        if shared is None:
            return self.take(plan, tokens, self.local.clock())
        costs = plan.costs(tokens)
        q = plan.quotas
        if q is None:
            result = await shared.take(plan.needs, costs, cfg.redis_timeout_s, cfg.restart_hold_s)
            if result is None:
                return self._alone(plan, tokens, costs, shared, cfg)
            refused, levels = result
            plan.seen = levels
            if refused >= 0:
                self._refuse(plan, plan.caps, levels, costs, refused)
            return self._taken(plan, plan.caps, levels, tokens, True)
        return await self._reserve_with_quotas(plan, q, tokens, costs, shared, cfg)

    async def _reserve_with_quotas(self, plan: Plan, q: PlanQuotas, tokens: int, costs: tuple[int, ...],
                                   shared: SharedBuckets, cfg: LimitsConfig) -> Reservation:
        """reserve() for a plan with quotas: one script takes from its buckets and quotas at once, each quota's
        key in Redis given what this process knows of it (its floor: a key that vanished starts there)."""
        periods = self.quotas.periods
        periods.now()
        keys = q.store_keys(shared.prefix, periods)
        slots = tuple([s.current(periods.numbers[n.period]) for n, s in zip(q.needs, q.slots)])
        take_key = shared.take_key()
        result = await shared.take(plan.needs, costs, cfg.redis_timeout_s, cfg.restart_hold_s, keys,
                                   quota_args(q.needs, slots, tokens), take_key)
        if result is None:
            return self._alone(plan, tokens, costs, shared, cfg, keys, take_key if shared.uncertain else "")
        refused, values = result
        n = len(plan.needs)
        levels = values[:n]
        settled = shared.settled()
        for s, used in zip(slots, values[n:]):
            s.heard(used, settled)
        plan.seen = levels
        if refused >= n:
            j = refused - n
            self.metrics.limit_refused("quota")
            need, s = q.needs[j], slots[j]
            raise quota_refusal(plan.principal, need, float(need.limit), s.used, tokens, periods.ends[need.period],
                                periods.clock(), line_headers(self._quota_lines(q.needs, slots)))
        if refused >= 0:
            self._refuse(plan, plan.caps, levels, costs, refused)
        return self._taken(plan, plan.caps, levels, tokens, True, slots, keys)

    def _alone(self, plan: Plan, tokens: int, costs: tuple[int, ...], shared: SharedBuckets,
               cfg: LimitsConfig, qkeys: tuple[str, ...] = (), take_key: str = "") -> Reservation:
        """take() on this process's share while Redis is unusable. The share: the processes it last saw in Redis,
        and never fewer than [limits] processes (what a process that never reached Redis goes by; a larger
        count seen wins, so a deployment that grew is not counted short). This process's buckets carry over
        from outage to outage (never refilled but by time), and at an outage's start come down to its share of
        what Redis last said they held; its quotas split what was left of them then. What it takes is owed to
        Redis for when it is back."""
        share = max(self.local_share(), cfg.processes)
        now = self.local.clock()
        if plan.outage != shared.outages:
            plan.outage = shared.outages
            seen = plan.seen
            if seen is not None:
                self.local.lower_slots(plan.slots, tuple([c / share for c in plan.caps]),
                                       tuple([level / share for level in seen]), now)
        held = self.take(plan, tokens, now, share, shared.outages)
        shared.owe(plan.needs, costs)
        if held.qslots and plan.quotas is not None:
            held.qkeys = qkeys
            if take_key:  # Redis may have run the take whose answer was lost: charged there unless it did
                shared.quotas.charge_take(take_key, qkeys, plan.quotas.needs, held.qslots, held.qperiods, tokens)
            else:
                shared.charge_quotas(qkeys, plan.quotas.needs, held.qslots, held.qperiods, tokens)
        return held

    def _taken(self, plan: Plan, caps: tuple[float, ...], levels: Sequence[float], tokens: int,
               shared: bool, qslots: tuple[QuotaSlot, ...] = (), qkeys: tuple[str, ...] = ()) -> Reservation:
        self.unsettled += 1
        text = plan_lines(plan, caps, levels)
        if qslots and plan.quotas is not None:
            text += self.quotas.lines(plan.quotas, qslots)
        return Reservation(self, plan, caps, levels, tokens, shared, text, qslots, qkeys)

    def _refuse(self, plan: Plan, caps: tuple[float, ...], levels: list[float], costs: tuple[int, ...],
                refused: int) -> NoReturn:
        self.metrics.limit_refused(plan.needs[refused].kind)
        raise refusal(plan.principal, plan.needs, caps, levels, costs, headers(plan.needs, caps, levels))

    def settle(self, r: Reservation, o: Outcome | None) -> None:
        """At the end of a request that took `r`: its tokens are charged from usage instead of the estimate."""
        self.unsettled -= 1
        plan, caps = r.plan, r.caps
        if not plan.token_needs and not r.qslots:
            return
        # used_tokens(o), written out: this runs for every request of a limited key
        delta = (o.prompt_tokens + o.completion_tokens if o is not None and o.result in CHARGED else 0) - r.tokens
        if delta == 0:
            return
        if r.qslots:
            self._settle_quotas(r, delta)
            if not plan.token_needs:
                return
        if r.shared and self.shared is not None:
            self.shared.settle(plan.token_needs, delta)
            return
        if self.shared is not None:  # decided alone while Redis was unusable: what it used is owed there too
            self.shared.owe(plan.token_needs, [delta] * len(plan.token_needs))
        if plan.common and caps is plan.caps:  # the usual plan at whole limits: one tokens bucket
            t, now = plan.slots[1], self.local.clock()
            t[0] = level_at(t, caps[1], now) - delta
            t[1] = now
        else:
            token_caps = plan.token_caps if caps is plan.caps else tuple(
                [c for c, t in zip(caps, plan.tokens_at) if t])
            self.local.adjust_slots(plan.token_slots, token_caps, delta)

    def _settle_quotas(self, r: Reservation, delta: int) -> None:
        """A request's quotas charged its usage instead of its estimate: here at once (in the period it was taken
        in), and in Redis with the next batch of settlements."""
        for s, period in zip(r.qslots, r.qperiods):
            if s.period == period:
                s.used += delta
        if self.shared is not None and r.qkeys and r.plan.quotas is not None:
            self.shared.charge_quotas(r.qkeys, r.plan.quotas.needs, r.qslots, r.qperiods, delta)


def quota_args(needs: Sequence[Any], slots: Sequence[QuotaSlot], tokens: int) -> list[int]:
    """The take script's arguments of each quota: its tokens, the cost, this process's floor (what it knows Redis
    held: what it knows used, less what it has not sent yet), when the key may go, and what it has not sent."""
    out: list[int] = []
    for n, s in zip(needs, slots):
        unsent = max(math.ceil(s.unsent), 0)
        out += [n.limit, tokens, max(int(s.used - s.unsent), 0), expire_ms(n.period, s.period), unsent]
    return out
