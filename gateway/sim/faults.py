"""Fault knobs of a simulated engine: the spec, its run-time state, and the /sim/faults admin routes."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import orjson
from aiohttp import web


@dataclass(frozen=True)
class FaultSpec:
    """What to break. Every knob off by default; all can be changed while the engine runs."""

    error_rate: float = 0.0  # share of inference requests that fail, 0..1
    error_next: int = 0  # fail exactly the next N inference requests
    error_status: int = 500  # 400..599
    retry_after_s: float | None = None  # Retry-After header on injected errors
    hang_s: float = 0.0  # wait before the first byte; negative hangs until the client leaves
    slow_start_s: float = 0.0  # extra time before the scheduler sees a request
    drop_after_chunks: int | None = None  # close the TCP connection after N SSE events
    error_after_chunks: int | None = None  # the engine's mid-stream error after N events
    unhealthy: bool = False  # health route fails the engine's way

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), str(f.type))
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be within 0..1")
        if not 400 <= self.error_status <= 599:
            raise ValueError("error_status must be within 400..599")
        for name in ("error_next", "slow_start_s", "retry_after_s", "drop_after_chunks",
                     "error_after_chunks"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must not be negative")

    def model_dump(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> FaultSpec:
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown fault knobs: {', '.join(sorted(unknown))}")
        return replace(self, **changes)


def _check_type(name: str, value: Any, annotation: str) -> None:
    """JSON-level type check of one knob (the annotations are strings under postponed evaluation)."""
    if value is None and "None" in annotation:
        return
    if annotation.startswith("bool"):
        ok = isinstance(value, bool)
    elif annotation.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{name}: expected {annotation}, got {value!r}")


class FaultState:
    """The live fault spec of one engine, plus the seeded draw behind error_rate."""

    def __init__(self, spec: FaultSpec, seed: int) -> None:
        self.spec = spec
        self._rng = random.Random(seed ^ 0x5EED)

    def update(self, changes: dict[str, Any]) -> FaultSpec:
        """Merge changes into the current spec (validated as a whole)."""
        self.spec = self.spec.replace(**changes)
        return self.spec

    def reset(self) -> FaultSpec:
        self.spec = FaultSpec()
        return self.spec

    def take_error(self) -> bool:
        """Whether this inference request gets the injected error."""
        spec = self.spec
        if spec.error_next > 0:
            self.spec = spec.replace(error_next=spec.error_next - 1)
            return True
        return spec.error_rate > 0 and self._rng.random() < spec.error_rate


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def admin_routes(key: web.AppKey) -> list[web.RouteDef]:
    """GET/POST/DELETE /sim/faults and POST /sim/faults/reset, reading the FaultState under `key`."""

    async def get_faults(request: web.Request) -> web.Response:
        return _json(request.app[key].spec.model_dump())

    async def post_faults(request: web.Request) -> web.Response:
        try:
            changes = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError as exc:
            return _json({"error": f"invalid JSON: {exc}"}, 400)
        if not isinstance(changes, dict):
            return _json({"error": "expected a JSON object"}, 400)
        state: FaultState = request.app[key]
        if changes.pop("reset", False):
            state.reset()
        try:
            spec = state.update(changes)
        except (TypeError, ValueError) as exc:
            return _json({"error": str(exc)}, 400)
        return _json(spec.model_dump())

    async def reset_faults(request: web.Request) -> web.Response:
        return _json(request.app[key].reset().model_dump())

    return [
        web.get("/sim/faults", get_faults),
        web.post("/sim/faults", post_faults),
        web.delete("/sim/faults", reset_faults),
        web.post("/sim/faults/reset", reset_faults),
    ]
