"""A counting gate for upstream connections: a free slot is taken without awaiting, waiters are served in order."""

from __future__ import annotations

import asyncio
from collections import deque


def _expire(w: asyncio.Future) -> None:
    if not w.done():
        w.set_exception(TimeoutError("no connection slot in time"))


class Slots:
    """What asyncio.Semaphore does for the pools, without its per-call scan of the waiters: taking a free slot
    is one comparison on the request path, and only a wait makes a future and a timer."""

    __slots__ = ("free", "_waiters")

    def __init__(self, n: int) -> None:
        self.free = n
        self._waiters: deque[asyncio.Future] = deque()

    def try_take(self) -> bool:
        """A slot now, or False (also while others wait: they came first)."""
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def take(self, deadline: float) -> None:
        """A slot, waiting in line until `deadline` (loop time) at most: TimeoutError after it."""
        if self.try_take():
            return
        loop = asyncio.get_running_loop()
        w = loop.create_future()
        self._waiters.append(w)
        timer = loop.call_at(deadline, _expire, w)
        try:
            await w  # release() hands its slot over by resolving w
        except BaseException:
            if w.done() and not w.cancelled() and w.exception() is None:
                self.release()  # handed a slot, then cancelled before it could run: pass the slot on
            else:
                try:
                    self._waiters.remove(w)
                except ValueError:
                    pass
            raise
        finally:
            timer.cancel()

    def release(self) -> None:
        """Give a slot back: to the first waiter still waiting, else to the free count."""
        waiters = self._waiters
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(None)
                return
        self.free += 1
