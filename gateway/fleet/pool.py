"""Live state of every backend, and the usable candidates for a model as BackendView snapshots."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Final, Iterable

import aiohttp

from gateway.config import BackendConfig, GatewayConfig
from gateway.contracts import READY, BackendView, LoadSample
from gateway.errors import GatewayError, no_backend
from gateway.fleet import served
from gateway.fleet.engine_latency import EngineLatency
from gateway.fleet.health import Breaker, HealthState
from gateway.stats.rolling import BackendStats, LatencyModel

log = logging.getLogger("shapegate")

AUTH_RETRY_S: Final = 30.0  # a backend whose engine refused the gateway's credentials is tried again after this


class BackendState:
    """Everything the gateway knows about one backend right now."""

    def __init__(self, cfg: BackendConfig, adapter, gcfg: GatewayConfig) -> None:
        self.id = cfg.id
        self.engine = cfg.engine
        self.adapter = adapter
        # [probe] at_start, and engines that refuse a configured model by name: public model -> why it is not
        # routed here (the candidate filter's one lookup; /stats shows it).
        self.unsupported: dict[str, str] = {}
        self.listed: tuple[str, ...] | None = None  # the ids of the engine's GET /v1/models, as last read
        # Configured models the engine refused by name: public -> (the name sent, its list when it refused, the
        # reason in `unsupported`). Out of routing here until that list changes.
        self.lacks: dict[str, tuple[str, tuple[str, ...] | None, str]] = {}
        self._unlisted: dict[str, tuple[str, tuple[str, ...]]] = {}  # public -> (native, list) logged as missing
        self.list_due = True
        # API routes its engine answered with a 404 for the path itself (a build that lacks them): route -> detail.
        self.unserved: dict[str, str] = {}
        # The engine refused the gateway's own credentials (HTTP 401/403): why, and when to try it again.
        self.misconfigured: str | None = None
        self.retry_auth_at = 0.0
        self.reconfigure(cfg)
        self.in_flight = 0
        # The queue's view (gateway/queueing/): seats granted to queued requests not yet gone out, requests in flight
        # or granted of a class with a seat share, the most requests the engine was seen running, and the most it
        # was seen running while it queued more.
        self.held = 0
        self.capped = 0
        self.peak_running = 0
        self.full_at = 0
        self.queued_scrapes = 0  # load samples in a row that showed it queueing at the most it ever ran
        # While its seat count is not known: the count the queue assumes for the seat shares, grown at each load
        # sample that shows the engine queueing nothing while a share held requests back (held_by_share).
        self.assumed = 0
        self.held_by_share = False
        self.on_load: Callable[[], None] | None = None  # told of each load sample (a seat may have freed)
        self.health = HealthState()
        self.breaker = Breaker(gcfg.health.breaker_failures, gcfg.health.breaker_open_s, cfg.id)
        self.load: LoadSample | None = None
        self.load_in_flight = 0  # the gateway's own in-flight count when that sample was taken
        self.reported = EngineLatency()  # the engine's own latency figures, from the same scrapes
        self.last_output = float("-inf")  # start time of the latest-started request that got output here
        self.latency = LatencyModel(cfg.hints, gcfg.stats.model_half_life_s, gcfg.stats.warmup_samples)
        self.stats = BackendStats(gcfg.stats.max_samples)
        self.next_probe = 0.0
        self._load_stale_s = 0.0
        self.apply_settings(gcfg)
        self.windows: dict[str, int] = {}  # public model -> context window the engine reported
        self.probe_cfg = gcfg.probe
        self.probe_task: asyncio.Task | None = None  # the support probe running since the last promotion to ready

    def reconfigure(self, cfg: BackendConfig) -> None:
        """Its own settings: at creation, and when a reload changes what it serves (same engine and URL)."""
        self.cfg = cfg
        self.models = cfg.models  # public name -> the engine's own name
        self.seats = cfg.seats
        self.classes = frozenset(cfg.classes) if cfg.classes is not None else None
        # Read for every request: copied out of the pydantic model, each of whose reads costs a few hundred
        # instructions (its __getattr__ hook).
        self.max_context = cfg.max_context
        self.interactive = cfg.interactive
        self.weight = cfg.weight
        # A model no longer configured, or now under another engine name, is judged afresh.
        for public in [p for p, (native, _, _) in self.lacks.items() if cfg.models.get(p) != native]:
            self._serves_again(public)
        for public in [p for p, (native, _) in self._unlisted.items() if cfg.models.get(p) != native]:
            del self._unlisted[public]
        self.list_due = True  # the engine's list is read (and judged against these models) at the next good probe

    def apply_settings(self, gcfg: GatewayConfig) -> None:
        """The gateway-wide settings a backend works by (at creation, and again on each reload)."""
        self.breaker.threshold, self.breaker.open_s = gcfg.health.breaker_failures, gcfg.health.breaker_open_s
        self._load_stale_s = gcfg.health.load_stale_s
        self.latency.refit_s = gcfg.stats.refit_interval_s
        keep = self.cfg.engine_private_fields
        if keep is None:
            keep = gcfg.server.engine_private_fields
        # The engine's own reply fields the relay drops ('"timings"' for llama.cpp; none for most engines).
        self.private_fields: tuple[bytes, ...] = () if keep else tuple(
            f'"{name}"'.encode() for name in getattr(self.adapter, "private_fields", ()))

    def take_load(self, sample: LoadSample) -> None:
        """A new load sample: routing sees it at once; the engine's own latency figures are folded in and,
        while the gateway has measured little here itself, stand in for the latency model's prior."""
        self.load, self.load_in_flight = sample, self.in_flight
        running = sample.running
        if running is not None:
            if running > self.peak_running:
                self.peak_running = int(running)
            # Queueing at the most it ever ran, scrape after scrape: full there, its seats as far as is known. (A
            # queue seen once, or beside fewer running, is a request between two of its steps.)
            if sample.waiting and running >= self.peak_running:
                self.queued_scrapes += 1
                if self.queued_scrapes >= 2 and running > self.full_at:
                    self.full_at = int(running)
            else:
                self.queued_scrapes = 0
            if self.held_by_share:
                self.held_by_share = False
                if not sample.waiting:  # room there still: the assumed count grows (a quarter, and at least one)
                    self.assumed = max(self.assumed + 1, self.assumed * 5 // 4, self.peak_running + 1)
        r = self.reported
        if r.observe(sample):
            self.latency.engine_prior(r.ttft, r.itl, r.prefill_rate)
        if self.on_load is not None:
            self.on_load()

    def window(self, model: str) -> int | None:
        """Tokens one request for `model` may hold here: the configured max_context, else what the engine
        said, else unknown (None: any request may be sent)."""
        return self.max_context or self.windows.get(model)

    async def discover_windows(self, timeout: float) -> None:
        """Ask the engine its context window for each model it serves (at readiness: a restart may change it)."""
        ask = getattr(self.adapter, "context_window", None)
        if ask is None or self.max_context:
            return
        for public, native in self.models.items():
            try:
                n = await ask(native, timeout)
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
                log.info("context window of %s for %s unknown: %s", self.id, public, type(e).__name__)
                continue
            if n is not None:
                self.windows[public] = n
            else:
                self.windows.pop(public, None)

    # -- the models the engine serves by name ------------------------------------------------------
    async def learn_models(self, timeout: float) -> None:
        """Read the engine's model list (on promotion to ready, after a reload, again while it lacks a model) and
        judge it."""
        self.list_due = False
        listed, why = await served.read_model_list(self.adapter, timeout)
        if listed is None:
            log.debug("model list of %s unknown: %s", self.id, why)  # kept as last read; routing goes on as it was
            return
        self.take_model_list(listed)

    def take_model_list(self, listed: tuple[str, ...]) -> None:
        """The engine's list as read: each configured model it does not name is logged with the fix, once per
        list; a model it refused by name is routed here again once the list changed or names it."""
        self.listed = listed
        for public, native in self.models.items():
            if native in listed:
                self._unlisted.pop(public, None)
            elif self._unlisted.get(public) != (native, listed):
                self._unlisted[public] = (native, listed)
                log.warning("%s", served.not_listed(self.id, self.engine, self.cfg.url, public, native, listed))
        for public, (native, then, _) in list(self.lacks.items()):
            if native in listed or (then is not None and then != listed):
                self._serves_again(public)
                log.info("backend %s: the engine now lists %s, model %s is routed there again", self.id,
                         served.names(listed), public)
            elif then is None:
                self.lacks[public] = (native, listed, self.lacks[public][2])  # known now, and still without it

    def serves_route(self, route: str) -> bool:
        """Whether the engine serves an API route: its adapter says so and it never answered it as an unknown path."""
        return route in self.adapter.apis and route not in self.unserved

    def refused_route(self, route: str, path: str, detail: str) -> None:
        """The engine answered `path` as a path it does not know: the route goes elsewhere from now on."""
        if route not in self.unserved:
            self.unserved[route] = detail
            log.warning("backend %s (%s at %s) does not serve %s (HTTP 404: %s); that route is not sent there any "
                        "more", self.id, self.engine, self.cfg.url, path, served.excerpt(detail))

    def refused_model(self, public: str, detail: str) -> str:
        """The engine refused the configured name of `public` (model_not_found): no more requests for it here
        until its model list changes. Returns the reason (shown in /stats), logged the first time only."""
        known = self.lacks.get(public)
        if known is not None:
            return known[2]
        native = self.models.get(public, public)
        why = (f"the engine does not serve {served.model_named(public, native)} ({served.excerpt(detail)}), "
               f"it lists: {served.names(self.listed)}; {served.fix(self.engine, public, native, self.listed)}")
        self.lacks[public] = (native, self.listed, why)
        self.unsupported.setdefault(public, why)  # a support probe's verdict already there stays
        log.warning("backend %s (%s at %s) refused model %s, not routed there until its model list changes: %s",
                    self.id, self.engine, self.cfg.url, public, why)
        return why

    def _serves_again(self, public: str) -> None:
        _, _, why = self.lacks.pop(public)
        if self.unsupported.get(public) == why:
            del self.unsupported[public]

    def refused_credentials(self, status: int, now: float) -> None:
        """The engine refused the gateway's credentials: no client requests here for AUTH_RETRY_S (then one tries
        again), logged once per episode with the fix; the engine's text is neither logged nor relayed."""
        if self.misconfigured is None:
            self.misconfigured = (f"the engine refused the gateway's credentials (HTTP {status}): set "
                                  f"{self.cfg.api_key_env or 'api_key_env'} to the key the engine was started with "
                                  f"(vLLM and llama-server: --api-key; SGLang: --api-key)")
            log.error("backend %s (%s at %s): %s; no requests are sent there, it is tried again every %.0f s",
                      self.id, self.engine, self.cfg.url, self.misconfigured, AUTH_RETRY_S)
        self.retry_auth_at = now + AUTH_RETRY_S

    def accepted_credentials(self) -> None:
        if self.misconfigured is not None:
            self.misconfigured = None
            log.info("backend %s: the engine accepts the gateway's credentials again", self.id)

    def usable(self, now: float) -> bool:
        return self.health.state == READY and self.breaker.allows(now) and now >= self.retry_auth_at

    def fresh_load(self, now: float) -> LoadSample | None:
        """The last load sample, or None once it is older than load_stale_s (the engine stopped answering
        scrapes): policies then rank this backend by the gateway's own in-flight count alone, and
        admission control ignores its queue and slot figures."""
        load = self.load
        return load if load is not None and now - load.at <= self._load_stale_s else None

    def view(self, now: float) -> BackendView:
        return BackendView(self.id, self.engine, self.in_flight, self.latency.estimate(), self.fresh_load(now),
                           self.classes, self.interactive, self.weight)

    async def warm_up(self, timeout: float) -> bool:
        model = next(iter(self.models.values()))
        return await self.adapter.warm_up(model, timeout=timeout)


class Pool:
    """All backends by id and by public model name; rebuilt atomically on config reload.

    Backends removed by a reload leave the index at once (no new requests) but stay listed as
    draining until their last in-flight request ends.
    """

    def __init__(self, backends: Iterable[BackendState]) -> None:
        self._by_id: dict[str, BackendState] = {}
        self._by_model: dict[str, list[BackendState]] = {}
        self._draining: list[BackendState] = []
        self._on_breaker_open: Callable[[str, float], None] | None = None
        for b in backends:
            self.add(b)

    def watch_breakers(self, listener: Callable[[str, float], None]) -> None:
        """Call listener(backend id, opened_until) whenever a failure opens a backend's breaker, for the backends
        there are and those a reload adds."""
        self._on_breaker_open = listener
        for b in self._by_id.values():
            self._watch(b)

    def _watch(self, b: BackendState) -> None:
        listener, bid = self._on_breaker_open, b.id
        if listener is not None:
            b.breaker.on_open = lambda until: listener(bid, until)

    def add(self, b: BackendState) -> None:
        self._watch(b)
        self._by_id[b.id] = b
        for public in b.models:
            self._by_model.setdefault(public, []).append(b)

    def remove(self, backend_id: str) -> BackendState | None:
        b = self._by_id.pop(backend_id, None)
        if b is not None:
            for public in b.models:
                lst = self._by_model.get(public, [])
                if b in lst:
                    lst.remove(b)
                if not lst:
                    self._by_model.pop(public, None)
        return b

    def all(self) -> list[BackendState]:
        """Active backends, then draining ones (a draining backend replaced under the same id is not listed)."""
        out = list(self._by_id.values())
        out.extend(b for b in self._draining if b.id not in self._by_id)
        return out

    def get(self, backend_id: str) -> BackendState | None:
        return self._by_id.get(backend_id)

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def candidates(self, model: str, klass: str, now: float | None = None) -> list[BackendState]:
        """Backends that serve the model (and did not fail the support probe for it), are ready, whose breaker
        admits a request and that take this class."""
        now = time.monotonic() if now is None else now
        out = []
        for b in self._by_model.get(model, ()):
            if b.usable(now) and (b.classes is None or klass in b.classes) and model not in b.unsupported:
                out.append(b)
        return out

    def serving_route(self, model: str, route: str) -> list[BackendState]:
        """The backends of `model` whose engines serve `route`, usable now or not."""
        return [b for b in self._by_model.get(model, ()) if b.serves_route(route)]

    def largest_window(self, model: str) -> int | None:
        """The largest context window among every backend of `model`, usable now or not (None: one is unknown)."""
        windows = [b.window(model) for b in self._by_model.get(model, ())]
        known = [w for w in windows if w is not None]
        return max(known) if known and len(known) == len(windows) else None

    def unavailable(self, model: str, now: float) -> GatewayError:
        """What a client gets when no backend takes `model` now: a 404 naming the misconfiguration when every
        backend of it refused it by name, else a 503 with the soonest retry."""
        owners = self._by_model.get(model) or []
        if owners and all(b.misconfigured is not None and now < b.retry_auth_at for b in owners):
            return GatewayError(502, f"Every backend of `{model}` refused the gateway's credentials for its engine; "
                                f"the gateway's operator must fix its configuration.", code="upstream_auth_failed")
        if owners and all(model in b.lacks for b in owners):
            b = owners[0]
            native = b.models.get(model, model)
            return GatewayError(404, f"The model `{model}` is configured on this gateway, but no backend's engine "
                                f"serves it (a gateway misconfiguration: backend {b.id}: "
                                f"{served.fix(b.engine, model, native)}).", param="model", code="model_not_found")
        return no_backend(model, self.retry_hint(model, now))

    def retry_hint(self, model: str, now: float) -> float:
        """Seconds a client should wait when no backend can take `model`: the soonest breaker reopening (the
        Retry-After header rounds and bounds it: gateway.errors.retry_after_header)."""
        waits = [b.breaker.reopens_in(now) for b in self._by_model.get(model, ()) if b.health.state == READY]
        return min((w for w in waits if w > 0), default=1.0)

    def is_ready(self) -> bool:
        now = time.monotonic()
        return any(b.usable(now) for b in self._by_id.values())

    def drain(self, backend_id: str) -> BackendState | None:
        """Take a backend out of routing; its in-flight requests finish, then sweep_drained forgets it."""
        b = self.remove(backend_id)
        if b is not None:
            b.health.drain()
            self._draining.append(b)
        return b

    def sweep_drained(self) -> list[BackendState]:
        done = [b for b in self._draining if b.in_flight == 0]
        if done:
            self._draining = [b for b in self._draining if b.in_flight > 0]
            for b in done:
                close = getattr(b.adapter, "close", None)
                if close is not None:
                    close()  # idle upstream connections of a backend that is gone
        return done
