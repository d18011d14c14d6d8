"""Graceful shutdown: stop accepting at once, let in-flight streams finish within the grace, end the rest cleanly."""

from __future__ import annotations

import asyncio
import logging

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


async def shutdown(front, g, grace_s: float) -> None:
    """Stop a gateway served by gateway.http.front (its runner made with shutdown_timeout >= grace_s + CUT_MARGIN_S).

    front.close() closes the listening socket first (new connections are refused), closes idle
    keep-alive connections, then waits for the requests in flight; /readyz answers 503 from the start.
    """
    g.stopping = True
    cleanup = asyncio.create_task(front.close(grace_s + CUT_MARGIN_S), name="shutdown")
    done, _ = await asyncio.wait({cleanup}, timeout=grace_s)
    if not done:
        n = cut_streams(g)
        log.warning("shutdown grace of %.1f s ran out: ending %d stream(s) with an error event", grace_s, n)
    await cleanup
