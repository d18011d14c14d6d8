"""Graceful shutdown: stop accepting at once, let in-flight streams finish within the grace, end the rest cleanly."""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("shapegate")

# Time the streams cut at the end of the grace period get to write their error event and [DONE]
# before the server closes their connections.
CUT_MARGIN_S = 2.0


def cut_streams(g) -> int:
    """End every stream still running: each handler writes an OpenAI error event and [DONE] (see pipeline)."""
    g.cutting = True
    tasks = list(g.streams)
    for t in tasks:
        t.cancel()
    return len(tasks)


def in_flight(g) -> tuple[int, int]:
    """(requests at the engines now, streams among them)."""
    return sum(b.in_flight for b in g.pool.all()), len(g.streams)


async def shutdown(front, g, grace_s: float, why: str = "asked to stop") -> None:
    """Stop a gateway served by gateway.http.front (its runner made with shutdown_timeout >= grace_s + CUT_MARGIN_S).

    front.close() closes the listening socket first (new connections are refused), closes idle
    keep-alive connections, then waits for the requests in flight; /readyz answers 503 from the start.
    """
    g.stopping = True
    started = time.monotonic()
    requests, streams = in_flight(g)
    log.info("shutting down (%s): no new connections, /readyz answers 503; draining %d request(s) in flight (%d "
             "stream(s)) for up to %.1f s ([server] shutdown_grace_s)", why, requests, streams, grace_s)
    cleanup = asyncio.create_task(front.close(grace_s + CUT_MARGIN_S), name="shutdown")
    done, _ = await asyncio.wait({cleanup}, timeout=grace_s)
    cut = 0
    if not done:
        cut = cut_streams(g)
        log.warning("shutdown grace of %.1f s ran out: ending %d stream(s) with an error event", grace_s, cut)
    await cleanup
    log.info("stopped after %.1f s: %d request(s) drained, %d stream(s) cut", time.monotonic() - started,
             max(requests - cut, 0), cut)
