"""Real-time driver of one scheduler: a single task steps the engine and sleeps to each step's modelled end."""

from __future__ import annotations

import asyncio
import logging

from gateway.sim.scheduler import SimRequest, StepResult, Scheduler
from gateway.sim.telemetry import Telemetry

# Behind by more than this, the loop stops catching up and restarts its clock at "now": the
# model then runs slower than modelled instead of releasing a burst of overdue tokens.
MAX_LAG_S = 0.1
# A step's tokens that go out later than this after its modelled end count as late.
LATE_S = 0.002

log = logging.getLogger(__name__)


class Ticket:
    """A handler's view of its request: tokens produced so far, and a wake-up per engine step."""

    __slots__ = ("req", "event", "produced", "done")

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.event = asyncio.Event()
        self.produced = 0
        self.done = False

    async def wait(self) -> int:
        """Tokens produced so far, after waiting for the next step that gave this request any."""
        await self.event.wait()
        self.event.clear()
        return self.produced


class EngineLoop:
    """One loop per engine, not one sleep per request: this is what carries 64+ concurrent streams."""

    def __init__(self, sched: Scheduler, tel: Telemetry) -> None:
        self.sched = sched
        self.tel = tel
        self._tickets: dict[SimRequest, Ticket] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")
            self._task.add_done_callback(self._report_crash)

    @staticmethod
    def _report_crash(task: asyncio.Task[None]) -> None:
        # A dead loop would leave every request waiting forever: make it loud.
        if not task.cancelled() and task.exception() is not None:
            log.error("simulated engine loop crashed", exc_info=task.exception())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass  # the cancellation we asked for
            self._task = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def submit(self, req: SimRequest) -> Ticket:
        self.sched.submit(req)
        self.tel.on_submit(req)
        ticket = Ticket(req)
        self._tickets[req] = ticket
        self._wake.set()
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """Client gone: free the request's batch entry or slot now, not when it would have ended."""
        self._tickets.pop(ticket.req, None)
        ticket.done = True
        started = ticket.req.generated > 0
        if self.sched.abort(ticket.req) and started and not ticket.req.internal:
            self.tel.on_release(ticket.req)
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time()  # modelled start of the next step
        while True:
            now = loop.time()
            if now - clock > MAX_LAG_S:
                self.tel.rebases += 1
                clock = now
            res = self.sched.step(clock)
            if res is None:
                await self._idle(loop)
                clock = loop.time()
                continue
            # Absolute deadlines: sleeping to res.end (not for the step's length) keeps
            # timer and scheduling jitter from adding up over thousands of steps.
            delay = res.end - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            if loop.time() - res.end > LATE_S:
                self.tel.late_steps += 1
            self._deliver(res)
            clock = res.end

    async def _idle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sleep until a request is submitted or a waiting one reaches the scheduler."""
        self._wake.clear()
        ready = self.sched.next_ready()
        timer = loop.call_at(ready, self._wake.set) if ready is not None else None
        try:
            await self._wake.wait()
        finally:
            if timer is not None:
                timer.cancel()

    def _deliver(self, res: StepResult) -> None:
        tickets = self._tickets
        for req in res.emitted:
            ticket = tickets.get(req)
            if ticket is not None:
                ticket.produced = req.generated
                ticket.event.set()
        for req in res.finished:
            ticket = tickets.pop(req, None)
            if ticket is not None:
                ticket.done = True
        self.tel.on_step(res)
