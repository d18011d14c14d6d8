"""Responses made with `background: true`: answered at once (queued), run by the gateway to their end and recorded;
a GET polls them, a cancel ends them (gateway/state/responses.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Mapping

import orjson

from gateway.contracts import Decision, RequestShape
from gateway.errors import GatewayError, upstream_failed, upstream_timeout
from gateway.routing.request import RequestState
from gateway.state.turns import RUNNING
from gateway.upstream import dispatch

if TYPE_CHECKING:
    from gateway.runtime import Gateway

log = logging.getLogger("shapegate")


class Captured:
    """The reply of a run nobody waits on: what the pipeline would have written to the client (an Exchange)."""

    def __init__(self, headers: Mapping[str, str], target: str, raw: bytes) -> None:
        self.headers = headers
        self.method = "POST"
        self.target = target
        self._raw = raw
        self.status = 0
        self.body = b""

    async def read(self) -> bytes:
        return self._raw

    def reply(self, status: int, headers: dict[str, str], body: bytes, lines: str = "") -> Captured:
        self.status, self.body = status, body
        return self

    async def open_stream(self, headers: dict[str, str], lines: str = "") -> Any:
        raise RuntimeError("a background run is never streamed")  # (its upstream body has no `stream`)


async def start_background(g: Gateway, st: RequestState, shape: RequestShape, decision: Decision,
                           candidates: list) -> Any:
    """Record the response as queued, answer with it, and run the request in a task of its own (which waits in the
    gateway's queue first while every candidate is saturated)."""
    turn = st.turn
    queued = turn.shell("queued")
    await turn.commit(queued)
    if turn.errors:
        raise GatewayError(503, "The gateway's response store did not take the background response; retry shortly.",
                           code="state_unavailable", headers={"Retry-After": "1"})
    run = RequestState(st.request_id, Captured(st.ex.headers, st.ex.target, st.raw), st.api)
    run.principal, run.t_in, run.raw, run.body, run.shape = st.principal, st.t_in, st.raw, st.body, shape
    run.reason, run.split, run.limit, run.limit_lines = st.reason, st.split, st.limit, st.limit_lines
    st.limit = None  # the run's end settles the key's tokens, from the usage it reports
    task = asyncio.get_running_loop().create_task(_run(g, run, turn, shape, decision, candidates),
                                                  name=f"background-{turn.id}")
    assert g.responses is not None
    key = (turn.owner, turn.id)
    g.responses.running[key] = task
    g.background_tasks.add(task)

    def ended(t: asyncio.Task) -> None:
        g.background_tasks.discard(t)
        if g.responses is not None:
            g.responses.running.pop(key, None)
    task.add_done_callback(ended)
    st.backend = ""
    return st.ex.reply(200, {"x-request-id": st.request_id, "x-shapegate-reason": "background"},
                       orjson.dumps(queued))


async def _run(g: Gateway, run: RequestState, turn: Any, shape: RequestShape, decision: Decision,
               candidates: list) -> None:
    status = 500
    try:
        async with asyncio.timeout(g.cfg.responses.background_timeout_s):
            qs = g.hot.queue
            if qs is not None and candidates:  # a seat first, as any request: the policy's order among the open ones
                assert run.principal is not None
                open_ = {b.id for b in await g.queue.admit(run.ex.headers, run.principal, shape, candidates,
                                                           time.monotonic(), qs)}
                # The ones without a seat last, for failover only (an engine's own queue beats a failed response).
                ranked = decision.ranked
                decision = Decision((*(v for v in ranked if v.id in open_), *(v for v in ranked if v.id not in open_)),
                                    decision.reason)
            done = await dispatch(g, run, shape, decision)
        status = done.status
        resp = orjson.loads(done.body) if status == 200 else None
        if isinstance(resp, dict):
            turn.rewrite(resp)
            await turn.commit(resp, replace=RUNNING)
        else:
            await turn.commit(turn.failed(upstream_failed(f"the engine answered HTTP {status}")), replace=RUNNING)
    except GatewayError as e:
        status = e.status
        await turn.commit(turn.failed(e), replace=RUNNING)
    except TimeoutError:
        status = 504
        await turn.commit(turn.failed(upstream_timeout("the background response ran past its time limit")),
                          replace=RUNNING)
    except orjson.JSONDecodeError:
        status = 502
        await turn.commit(turn.failed(upstream_failed("the engine's reply is not JSON")), replace=RUNNING)
    except asyncio.CancelledError:
        status = 499  # cancelled (its record says so already) or the gateway stopping
        if not g.stopping:
            return
        await turn.commit(turn.failed(GatewayError(503, "The gateway stopped before the response was done.",
                                                   code="shutting_down")), replace=RUNNING)
    finally:
        g.finish(run, status)
