"""Live state of every backend, and the usable candidates for a model as BackendView snapshots."""

from __future__ import annotations

import time
from typing import Iterable

from gateway.config import BackendConfig, GatewayConfig
from gateway.contracts import DRAINING, READY, BackendView, LoadSample
from gateway.health import Breaker, HealthState
from gateway.stats import BackendStats, LatencyModel


class BackendState:
    """Everything the gateway knows about one backend right now."""

    def __init__(self, cfg: BackendConfig, adapter, gcfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.id = cfg.id
        self.engine = cfg.engine
        self.adapter = adapter
        self.models = cfg.models  # public name -> the engine's own name
        self.classes = frozenset(cfg.classes) if cfg.classes is not None else None
        self.in_flight = 0
        self.health = HealthState()
        self.breaker = Breaker(gcfg.health.breaker_failures, gcfg.health.breaker_open_s)
        self.load: LoadSample | None = None
        self.latency = LatencyModel(cfg.hints)
        self.stats = BackendStats(gcfg.stats.max_samples)
        self.next_probe = 0.0
        self._load_stale_s = gcfg.health.load_stale_s
        self._view: BackendView | None = None

    def usable(self, now: float) -> bool:
        return self.health.state == READY and self.breaker.allows(now)

    def fresh_load(self, now: float) -> LoadSample | None:
        load = self.load
        return load if load is not None and now - load.at <= self._load_stale_s else None

    def view(self, now: float) -> BackendView:
        return BackendView(self.id, self.engine, self.in_flight, self.latency.estimate(), self.fresh_load(now),
                           self.classes, self.cfg.interactive, self.cfg.weight)

    async def warm_up(self) -> None:
        model = next(iter(self.models.values()))
        await self.adapter.warm_up(model, timeout=30.0)


class Pool:
    """All backends by id and by public model name; rebuilt atomically on config reload."""

    def __init__(self, backends: Iterable[BackendState]) -> None:
        self._by_id: dict[str, BackendState] = {}
        self._by_model: dict[str, list[BackendState]] = {}
        self.ready_count = 0
        for b in backends:
            self.add(b)

    def add(self, b: BackendState) -> None:
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
        return list(self._by_id.values())

    def get(self, backend_id: str) -> BackendState | None:
        return self._by_id.get(backend_id)

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def candidates(self, model: str, klass: str, now: float | None = None) -> list[BackendState]:
        """Backends that serve the model, are ready, whose breaker admits a request and that take this class."""
        now = time.monotonic() if now is None else now
        out = []
        for b in self._by_model.get(model, ()):
            if b.usable(now) and (b.classes is None or klass in b.classes):
                out.append(b)
        return out

    def on_health_change(self, b: BackendState) -> None:
        self.ready_count = sum(1 for x in self._by_id.values() if x.health.state == READY)

    def is_ready(self) -> bool:
        now = time.monotonic()
        return any(b.usable(now) for b in self._by_id.values())

    def drain(self, backend_id: str) -> None:
        b = self._by_id.get(backend_id)
        if b is not None:
            b.health.drain()
            for lst in self._by_model.values():
                if b in lst:
                    lst.remove(b)
            self._by_model = {k: v for k, v in self._by_model.items() if v}

    def sweep_drained(self) -> None:
        for b in [b for b in self._by_id.values() if b.health.state == DRAINING and b.in_flight == 0]:
            self._by_id.pop(b.id, None)
