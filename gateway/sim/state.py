"""The live state of one simulated engine, kept on its aiohttp app under one AppKey."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from gateway.sim.engine import EngineLoop
from gateway.sim.faults import FaultState
from gateway.sim.formats import FORMATS, EngineFormat
from gateway.sim.options import SimOptions
from gateway.sim.parse import ParseContext
from gateway.sim.profiles import Profile
from gateway.sim.scheduler import Scheduler
from gateway.sim.store import ResponseStore
from gateway.sim.telemetry import Telemetry


@dataclass
class SimState:
    """Everything one engine owns: options, profile, scheduler, loop, telemetry, faults, readiness."""

    opts: SimOptions
    profile: Profile
    fmt: EngineFormat
    sched: Scheduler
    tel: Telemetry
    engine: EngineLoop
    faults: FaultState
    parse_ctx: ParseContext
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    inflight: int = 0  # HTTP requests inside an inference handler (vLLM's server_load)
    started_unix: float = field(default_factory=time.time)
    responses: ResponseStore = field(default_factory=ResponseStore)  # stored Responses-API objects

    @property
    def engine_name(self) -> str:
        return self.opts.engine

    @property
    def stores_responses(self) -> bool:
        """Whether `store: true` keeps responses: SGLang always, vLLM only when enabled, llama.cpp never."""
        if self.opts.engine == "llamacpp":
            return False
        if self.opts.responses_store is not None:
            return self.opts.responses_store
        return self.opts.engine == "sglang"

    @property
    def model(self) -> str:
        return self.opts.model_names[0]

    @classmethod
    def create(cls, opts: SimOptions) -> SimState:
        profile = opts.resolve_profile()
        sched = Scheduler(profile)
        tel = Telemetry.for_engine(opts.engine)
        return cls(
            opts=opts, profile=profile, fmt=FORMATS[opts.engine](), sched=sched, tel=tel,
            engine=EngineLoop(sched, tel), faults=FaultState(opts.faults, opts.seed),
            parse_ctx=ParseContext(opts.engine, profile, opts.model_names, opts.seed),
        )


SIM = web.AppKey("sim_state", SimState)
