"""A/B experiments on live traffic: sticky weighted arms per public model, their samples and their verdicts."""

from __future__ import annotations

import hashlib
import logging
import random
import time
from typing import TYPE_CHECKING, Any, Final, Iterable, Mapping

from gateway.config_experiments import ExperimentConfig
from gateway.contracts import ENGINE_ERROR, OK, Decision, Outcome, Policy, RequestShape, RouteInput
from gateway.errors import GatewayError, bad_request
from gateway.experiments.guard import ErrorGuard, shared_stop
from gateway.experiments.verdict import METRICS, Reservoir
from gateway.keys.auth import ANONYMOUS

if TYPE_CHECKING:
    from gateway.fleet.pool import BackendState
    from gateway.routing.request import Caller

ALL: Final = "all"  # the class every request also counts in: a verdict comes sooner on the whole traffic
PRIMARY: Final = "primary"  # a shadow experiment's control: the model served as usual
ARM_HEADER: Final = "x-shapegate-arm"

log = logging.getLogger("shapegate.experiments")


def bucket(experiment: str, subject: str) -> float:
    """Where a subject falls in [0, 1): the same on every worker and replica (no process-seeded hash)."""
    d = hashlib.blake2b(f"{experiment}\0{subject}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "big") / 2.0 ** 64


class Arm:
    __slots__ = ("name", "backends", "weight")

    def __init__(self, name: str, backends: Iterable[str], weight: float) -> None:
        self.name, self.backends, self.weight = name, frozenset(backends), weight


class ArmClass:
    """One arm's samples in one request class: a bounded uniform sample per metric, exact counts."""

    __slots__ = ("samples", "requests", "errors")

    def __init__(self, seed: int) -> None:
        self.samples = {m: Reservoir(seed=seed + i) for i, m in enumerate(METRICS)}
        self.requests = 0
        self.errors = 0

    def add(self, o: Outcome) -> None:
        if o.result not in (OK, ENGINE_ERROR):
            return  # a client's own error or departure says nothing about the engine
        self.requests += 1
        s = self.samples
        if o.result == ENGINE_ERROR:
            self.errors += 1
            s["error_rate"].add(1.0)
            return
        s["error_rate"].add(0.0)
        s["e2e"].add(o.e2e)
        if o.ttft is not None:
            s["ttft"].add(o.ttft)
        if o.itl is not None:
            s["itl"].add(o.itl)
        if o.completion_tokens and o.e2e > 0:
            s["output_tps"].add(o.completion_tokens / o.e2e)


class Agreement:
    """For shadowed requests at temperature 0: does the candidate say what the primary said?"""

    __slots__ = ("compared", "exact", "prefix_chars", "prefix_tokens")

    def __init__(self) -> None:
        self.compared = self.exact = 0
        self.prefix_chars = Reservoir(seed=7)
        self.prefix_tokens = Reservoir(seed=8)

    def add(self, primary: str, candidate: str, p_tokens: list[str] | None, c_tokens: list[str] | None) -> None:
        self.compared += 1
        self.exact += primary == candidate
        n = 0
        for x, y in zip(primary, candidate):
            if x != y:
                break
            n += 1
        self.prefix_chars.add(n / max(len(primary), 1))
        if p_tokens is not None and c_tokens is not None:
            k = 0
            for x, y in zip(p_tokens, c_tokens):
                if x != y:
                    break
                k += 1
            self.prefix_tokens.add(float(k))

    def shared(self, cap: int) -> dict:
        return {"compared": self.compared, "exact": self.exact,
                "prefix_share": _rounded(self.prefix_chars.values[:cap]),
                "prefix_tokens": list(self.prefix_tokens.values[:cap])}


class Experiment:
    """One running experiment: arms and weights (changeable at run time), samples by (arm, class)."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.name, self.model, self.mode, self.subject = cfg.name, cfg.model, cfg.mode, cfg.subject
        self.arms = [Arm(a.name, a.backends, a.weight) for a in cfg.arms]
        self.enabled = cfg.enabled
        self.fraction = cfg.fraction
        self.margin = cfg.practical_margin
        # Split arms only: a shadow arm serves no client, so its errors cost nobody a reply.
        self.guard = ErrorGuard(cfg.error_guard_margin, cfg.error_guard_min_requests) if cfg.mode == "split" \
            else None
        self.version = 0  # bumped by each run-time change; replicas take the highest (share.py)
        self.changed_at = time.time()
        self._arm_of = {b: a.name for a in self.arms for b in a.backends}
        self._by_name = {a.name: a for a in self.arms}
        self._cum: list[tuple[float, Arm]] = []
        self._serving: frozenset[str] = frozenset()
        self._weights_changed()
        self.classes: dict[tuple[str, str], ArmClass] = {}
        self.started = time.time()
        # Shadow bookkeeping, per shadow arm.
        self.shadow_in_flight = {a.name: 0 for a in self.arms}
        self.shadow_counts: dict[tuple[str, str], int] = {}
        self.agreement = {a.name: Agreement() for a in self.arms}

    @property
    def shadow_backends(self) -> frozenset[str]:
        return frozenset(self._arm_of) if self.mode == "shadow" else frozenset()

    def _weights_changed(self) -> None:
        # An arm the error guard stopped counts as weight 0; the guard never stops the last serving arm, and
        # every run-time change lifts its stops, so some arm always serves.
        stopped = self.guard.stopped if self.guard is not None else {}
        weights = [(a, 0.0 if a.name in stopped else a.weight) for a in self.arms]
        total = sum(w for _, w in weights)
        acc, self._cum = 0.0, []
        for a, w in weights:
            if w > 0:
                acc += w / total
                self._cum.append((acc, a))
        self._serving = frozenset(a.name for _, a in self._cum)

    # -- assignment ---------------------------------------------------------------------------------------
    def subject_of(self, principal: str | None, session: str | None, body: Mapping[str, Any],
                   headers: Mapping[str, str]) -> str | None:
        """What keeps the request on one arm: the configured subject, else its session, else its key (None
        without any of them, or without a key of its own: auth off)."""
        kind = self.subject
        if kind == "key":
            found = principal
        elif kind == "session":
            found = session
        elif kind == "user":
            user = body.get("user")
            found = user if isinstance(user, str) and user else None
        else:
            found = headers.get(kind[7:]) or None  # header:<name>, names in lower case
        # A request without the subject would otherwise draw an arm of its own, and one conversation could hop
        # from arm to arm; its session and key were found anyway (no lookup more).
        return found or session or principal

    def assign(self, subject: str | None) -> Arm:
        """The subject's arm; a request with no subject draws one of its own."""
        u = bucket(self.name, subject) if subject is not None else random.random()
        for edge, arm in self._cum:
            if u < edge:
                return arm
        return self._cum[-1][1]  # u within rounding of 1.0

    def arm(self, name: str) -> Arm | None:
        return self._by_name.get(name)

    def arm_of(self, backend_id: str) -> str | None:
        return self._arm_of.get(backend_id)

    # -- run-time control -----------------------------------------------------------------------------------
    def change(self, weights: Mapping[str, float] | None = None, enabled: bool | None = None,
               fraction: float | None = None) -> None:
        """Apply a checked change (see check_change) at once. Any change, made here or adopted from another
        process, lifts the error guard's stops: an admin has acted (and a still failing arm is stopped again)."""
        lift = self.guard is not None and bool(self.guard.stopped)
        if lift and self.guard is not None:
            log.info("experiment %s: the error guard's stops lifted by a run-time change (%s)", self.name,
                     ", ".join(sorted(self.guard.stopped)))
            self.guard.lift(self._counts())
        if weights:
            for name, w in weights.items():
                self._by_name[name].weight = float(w)
        if weights or lift:
            self._weights_changed()
        if enabled is not None:
            self.enabled = enabled
        if fraction is not None:
            self.fraction = fraction
        self.version += 1
        self.changed_at = time.time()

    def control(self) -> dict:
        """The part of the state replicas share."""
        return {"version": self.version, "enabled": self.enabled,
                "fraction": self.fraction if self.mode == "shadow" else None,
                "weights": {a.name: a.weight for a in self.arms}, "changed_at": self.changed_at}

    def adopt(self, control: Mapping[str, Any]) -> bool:
        """Take another replica's newer change; False when it is not newer or does not fit this config."""
        v = control.get("version")
        if not isinstance(v, int) or v <= self.version:
            return False
        if check_change(self, control) is not None:
            return False
        self.change(control.get("weights"), control.get("enabled"), control.get("fraction"))
        self.version, self.changed_at = v, float(control.get("changed_at") or time.time())
        return True

    # -- samples --------------------------------------------------------------------------------------------
    def record(self, arm: str, klass: str, o: Outcome) -> None:
        for k in (klass, ALL):
            c = self.classes.get((arm, k))
            if c is None:
                c = self.classes[arm, k] = ArmClass(seed=len(self.classes) * 16)
            c.add(o)
        if o.result == ENGINE_ERROR and self.guard is not None:
            self._guard(arm)

    def _counts(self) -> dict[str, tuple[int, int]]:
        """Each arm's requests and engine errors so far (the `all` class)."""
        counts = {}
        for a in self.arms:
            c = self.classes.get((a.name, ALL))
            if c is not None:
                counts[a.name] = (c.requests, c.errors)
        return counts

    def _guard(self, arm: str) -> None:
        """After an engine error on `arm`: stop it when the guard says its errors climbed above another arm's."""
        guard = self.guard
        if guard is None or not self.enabled:
            return
        stop = guard.check(arm, self._counts(), self._serving)
        if stop is not None:
            self._weights_changed()
            log.warning("experiment %s: arm %s stopped by the error guard: %s; its weight counts as 0 in this "
                        "process until a run-time change (PUT /admin/experiments/%s, shapegate ab start %s)",
                        self.name, arm, stop.reason(), self.name, self.name)

    def count_shadow(self, arm: str, result: str) -> None:
        self.shadow_counts[arm, result] = self.shadow_counts.get((arm, result), 0) + 1

    def arm_names(self) -> list[str]:
        return [PRIMARY, *(a.name for a in self.arms)] if self.mode == "shadow" else [a.name for a in self.arms]

    def shared_samples(self, cap: int) -> dict:
        """What other processes merge into their verdicts: counts, up to `cap` samples per metric, and the arms
        the error guard stopped here."""
        return {"classes": {f"{arm}|{k}": {"requests": c.requests, "errors": c.errors,
                                           "samples": {m: _rounded(c.samples[m].values[:cap]) for m in METRICS}}
                            for (arm, k), c in self.classes.items()},
                "shadow": {f"{arm}|{r}": n for (arm, r), n in self.shadow_counts.items()},
                "agreement": {arm: a.shared(cap) for arm, a in self.agreement.items()},
                "guard": {arm: stop.as_dict() for arm, stop in self.guard.stopped.items()} if self.guard else {}}

    def snapshot(self, remote: list[dict]) -> dict:
        """Everything a report needs, as plain data (own samples and other processes'), taken at once so that
        the statistics can run off the event loop."""
        classes: dict[str, dict] = {}
        own = self.shared_samples(cap=1 << 30)
        for part in (own, *remote):
            for key, c in (part.get("classes") or {}).items():
                into = classes.setdefault(key, {"requests": 0, "errors": 0, "samples": {m: [] for m in METRICS}})
                into["requests"] += int(c.get("requests") or 0)
                into["errors"] += int(c.get("errors") or 0)
                for m in METRICS:
                    v = (c.get("samples") or {}).get(m)
                    if isinstance(v, list):
                        into["samples"][m].extend(v)
        shadow: dict[str, int] = {}
        agreement: dict[str, dict] = {}
        for part in (own, *remote):
            for key, n in (part.get("shadow") or {}).items():
                shadow[key] = shadow.get(key, 0) + int(n)
            for arm, a in (part.get("agreement") or {}).items():
                into = agreement.setdefault(arm, {"compared": 0, "exact": 0, "prefix_share": [], "prefix_tokens": []})
                for k in ("compared", "exact"):
                    into[k] += int(a.get(k) or 0)
                for k in ("prefix_share", "prefix_tokens"):
                    into[k].extend(a.get(k) or [])
        guard = self.guard
        return {"name": self.name, "model": self.model, "mode": self.mode, "subject": self.subject,
                "enabled": self.enabled, "fraction": self.fraction if self.mode == "shadow" else None,
                "practical_margin": self.margin,
                "error_guard": {"margin": guard.margin, "min_requests": guard.min_requests, "window": guard.window}
                if guard is not None else None,
                "version": self.version, "started": round(self.started, 3), "changed_at": round(self.changed_at, 3),
                "arms": [{"name": n, "backends": sorted(a.backends) if a else None, "weight": a.weight if a else None,
                          "serving": n in self._serving if a else None,
                          "guard": _stops(n, [own, *remote]) if guard is not None else None,
                          "in_flight": self.shadow_in_flight.get(n) if self.mode == "shadow" and a else None}
                         for n, a in ((n, self._by_name.get(n)) for n in self.arm_names())],
                "classes": classes, "shadow": shadow, "agreement": agreement,
                "processes": 1 + len(remote)}


def _stops(arm: str, parts: list[dict]) -> dict | None:
    """The error guard's stop of `arm` in this process or, if none, the first in another, with how many of the
    processes stopped it (each judges its own requests); None when none did."""
    stops = []
    for part in parts:
        g = part.get("guard")
        stop = shared_stop(g.get(arm)) if isinstance(g, dict) else None
        if stop is not None:
            stops.append(stop)
    return {**stops[0], "processes": len(stops)} if stops else None


def _rounded(values: list[float]) -> list[float]:
    return [float(f"{v:.5g}") for v in values]


def check_change(x: Experiment, change: Mapping[str, Any]) -> str | None:
    """Why a run-time change cannot apply (None when it can): weights of known arms, >= 0, not all zero."""
    weights = change.get("weights")
    if weights is not None:
        if not isinstance(weights, dict) or not weights:
            return "weights must be an object of arm name to weight"
        after = {a.name: a.weight for a in x.arms}
        for name, w in weights.items():
            if name not in after:
                return f"unknown arm {name!r}; arms: {', '.join(after)}"
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 or w == float("inf"):
                return f"the weight of {name!r} must be a finite number >= 0"
            after[name] = float(w)
        if not any(w > 0 for w in after.values()):
            return "at least one arm needs a weight greater than 0"
    enabled = change.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        return "enabled must be true or false"
    fraction = change.get("fraction")
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            return "fraction must be a number in (0, 1]"
        if x.mode != "shadow":
            return "fraction applies to shadow experiments only"
    return None


class Experiments:
    """Every configured experiment, found by name and by (model, mode)."""

    def __init__(self, configs: Iterable[ExperimentConfig], previous: "Experiments | None" = None) -> None:
        self.by_name: dict[str, Experiment] = {}
        self.split: dict[str, Experiment] = {}
        self.shadow: dict[str, Experiment] = {}
        for c in configs:
            old = previous.by_name.get(c.name) if previous is not None else None
            x = old if old is not None and _same_shape(old.cfg, c) else Experiment(c)
            if x is old and old.cfg != c:
                x = _renewed(old, c)
            self.by_name[c.name] = x
            (self.split if c.mode == "split" else self.shadow)[c.model] = x
        self.models = frozenset((*self.split, *self.shadow))

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def snapshot(self, remote_of) -> list[dict]:
        """Plain data for report(); `remote_of(name)` gives other processes' samples of an experiment."""
        return [x.snapshot(remote_of(n)) for n, x in self.by_name.items()]


def _same_shape(a: ExperimentConfig, b: ExperimentConfig) -> bool:
    """Whether samples gathered under `a` still mean the same under `b`: same model, mode and arm backends."""
    return (a.model, a.mode, [(x.name, x.backends) for x in a.arms]) == \
        (b.model, b.mode, [(x.name, x.backends) for x in b.arms])


def _renewed(old: Experiment, cfg: ExperimentConfig) -> Experiment:
    """A reload that changed weights, subject or switches: the file's new values, the samples kept."""
    x = Experiment(cfg)
    x.classes, x.started, x.shadow_counts, x.agreement = old.classes, old.started, old.shadow_counts, old.agreement
    x.shadow_in_flight = old.shadow_in_flight
    x.version = old.version + 1
    if x.guard is not None:
        x.guard.lift(x._counts())  # its windows start now, not at the samples' start
    return x


class Choice:
    """What the experiments decide for one request: its candidates (shadow arms never serve), the split arm it is
    assigned to (None: routed as usual) and the experiments it takes part in (the pipeline keeps them)."""

    __slots__ = ("candidates", "arm", "split", "shadow")

    def __init__(self, candidates: list[BackendState], arm: Arm | None, split: Experiment | None,
                 shadow: tuple[Experiment, Arm] | None) -> None:
        self.candidates = candidates
        self.arm = arm
        self.split = split  # the split experiment whose arms serve the request
        self.shadow = shadow  # the shadow experiment and the arm a copy may go to


def enter(xs: Experiments, caller: Caller | None, shape: RequestShape, body: Mapping[str, Any],
          headers: Mapping[str, str], candidates: list[BackendState]) -> Choice:
    """A request of a model under experiment, from `caller`: what the experiments decide for it."""
    model = shape.model
    pin = headers.get(ARM_HEADER)
    # With auth off every request is the same anonymous caller: no key of its own to keep it on one arm.
    key = shape.principal if caller is not ANONYMOUS else None
    if pin is not None and not (caller is not None and caller.admin):
        raise GatewayError(403, f"Pinning an experiment arm ({ARM_HEADER}) needs an admin key.",
                           type="permission_error", param=ARM_HEADER, code="permission_denied")
    arm: Arm | None = None
    split: Experiment | None = None
    shadow: tuple[Experiment, Arm] | None = None
    x = xs.shadow.get(model)
    if x is not None:
        candidates = [b for b in candidates if b.id not in x.shadow_backends]
        if x.enabled:
            shadow = x, _pinned(x, pin) or x.assign(x.subject_of(key, shape.session_id, body, headers))
    x = xs.split.get(model)
    if x is not None and x.enabled:
        split = x
        arm = _pinned(x, pin) or x.assign(x.subject_of(key, shape.session_id, body, headers))
    if pin is not None and not any(e is not None and e.arm(pin) for e in (xs.split.get(model), xs.shadow.get(model))):
        raise bad_request(f"No experiment of model {model!r} has an arm named {pin[:64]!r}.", param=ARM_HEADER,
                          code="unknown_arm")
    return Choice(candidates, arm, split, shadow)


def _pinned(x: Experiment, pin: str | None) -> Arm | None:
    return x.arm(pin) if pin is not None else None


def rank_arm_first(policy: Policy, inp: RouteInput, arm: Arm) -> Decision:
    """The policy's order inside the arm, then (for failover only) its order among the other candidates."""
    inside = tuple(v for v in inp.candidates if v.id in arm.backends)
    outside = tuple(v for v in inp.candidates if v.id not in arm.backends)
    if not inside:
        d = policy.rank(inp)
        return Decision(d.ranked, f"{d.reason}; arm {arm.name} unavailable")
    d = policy.rank(inp.with_candidates(inside))
    if not outside:
        return Decision(d.ranked, f"{d.reason}; arm {arm.name}")
    return Decision(d.ranked + policy.rank(inp.with_candidates(outside)).ranked, f"{d.reason}; arm {arm.name}")
