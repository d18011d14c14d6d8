"""Where each stored response lives and whose it is: response id -> (backend, owning key, model), on every replica.

An engine keeps a stored response (`store`, the Responses API's default) in its own memory: a follow-up naming it
(`previous_response_id`) or a GET, DELETE or cancel of it is answered only by the backend that made it. The gateway
records that backend with the key that made the response and its model, in this process (bounded, least recent
first out, expiring) and, with `[state] backend = "redis"`, in Redis for the other workers and replicas. The write
goes out in the background, never on a request's path; a replica that does not know an id asks Redis once, and once
more after a short wait (a follow-up can overtake the write of the response it continues)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Final

import orjson
from redis import asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway.apis import responses
from gateway.contracts import READY
from gateway.errors import GatewayError
from gateway.fleet.pool import BackendState, Pool

log = logging.getLogger("shapegate")

SECOND_LOOK_S: Final = 0.05  # a Redis miss is asked again after this: the write may still be on its way
_SEP: Final = "\n"  # between the record's fields: none of them can hold one (ids, key ids and model names are checked)


class StoredResponse:
    __slots__ = ("backend", "owner", "model", "at")

    def __init__(self, backend: str, owner: str, model: str, at: float) -> None:
        self.backend = backend
        self.owner = owner
        self.model = model
        self.at = at

    def encode(self) -> bytes:
        return _SEP.join((self.backend, self.owner, self.model)).encode()

    @classmethod
    def decode(cls, data: bytes, at: float) -> StoredResponse | None:
        parts = data.decode("utf-8", "replace").split(_SEP)
        return cls(parts[0], parts[1], parts[2], at) if len(parts) == 3 else None

    def backend_in(self, pool: Pool, now: float, response_id: str) -> BackendState:
        """The backend the response lives on, when it can take a request now; else a 503 that says why."""
        b = pool.get(self.backend)
        if b is None or not b.usable(now):
            why = "is no longer configured" if b is None else f"is {b.health.state}" if b.health.state != READY \
                else "is failing (its circuit breaker is open)"
            raise GatewayError(503, f"The response '{response_id}' is stored on backend {self.backend}, which {why}; "
                               f"a stored response lives only on the engine that made it. Retry when that backend "
                               f"is back, or start again without it.", code="stored_response_unavailable",
                               headers={"Retry-After": "5"})
        return b


class StoredResponses:
    """The index of stored responses (see the module's docstring)."""

    def __init__(self, max_entries: int, ttl_s: float, redis_url: str | None = None, key_prefix: str = "shapegate:",
                 timeout_s: float = 0.25) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._local: OrderedDict[str, StoredResponse] = OrderedDict()
        self._prefix = key_prefix + "resp:"
        self._timeout = timeout_s
        self._redis = None if redis_url is None else redis_asyncio.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._writes: set[asyncio.Task] = set()
        self.redis_errors = 0

    def remember(self, response_id: str, backend: str, owner: str, model: str) -> None:
        """A response an engine stored: kept here now, in Redis in the background."""
        rec = StoredResponse(backend, owner, model, time.monotonic())
        self._put(response_id, rec)
        if self._redis is not None:
            self._background(self._redis.set(self._prefix + response_id, rec.encode(), ex=max(int(self.ttl_s), 1)))

    def remember_reply(self, data: bytes, backend: str, owner: str, model: str) -> None:
        """The id of a non-streamed Response an engine stored (of an id's form, else not kept)."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        rid = responses.id_of(obj) if isinstance(obj, dict) else None
        if rid is not None:
            self.remember(rid, backend, owner, model)

    async def owned(self, response_id: object, owner: str, param: str) -> StoredResponse:
        """The record of a response `owner` made; another key's id, or an unknown one, is the same 404."""
        rec = await self.find(response_id) if isinstance(response_id, str) else None
        if rec is None or rec.owner != owner:
            raise responses.not_found(response_id if isinstance(response_id, str) else None, param)
        return rec

    def forget(self, response_id: str) -> None:
        """A response deleted on its engine."""
        self._local.pop(response_id, None)
        if self._redis is not None:
            self._background(self._redis.delete(self._prefix + response_id))

    async def find(self, response_id: str) -> StoredResponse | None:
        """The record of a response id: this process's, else Redis's (asked twice on a miss)."""
        rec = self._local.get(response_id)
        now = time.monotonic()
        if rec is not None:
            if now - rec.at <= self.ttl_s:
                self._local.move_to_end(response_id)
                return rec
            del self._local[response_id]
        if self._redis is None:
            return None
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(SECOND_LOOK_S)
            data = await self._get(response_id)
            if data is not None:
                found = StoredResponse.decode(data, time.monotonic())
                if found is not None:
                    self._put(response_id, found)
                return found
        return None

    async def _get(self, response_id: str) -> bytes | None:
        assert self._redis is not None
        try:
            async with asyncio.timeout(self._timeout):
                data = await self._redis.get(self._prefix + response_id)
                return data if isinstance(data, bytes) else None
        except (RedisError, OSError, TimeoutError) as e:
            self.redis_errors += 1
            log.warning("stored responses: Redis did not answer a lookup (%s)", type(e).__name__)
            return None

    def _put(self, response_id: str, rec: StoredResponse) -> None:
        local = self._local
        local[response_id] = rec
        local.move_to_end(response_id)
        while len(local) > self.max_entries:
            local.popitem(last=False)

    def _background(self, coro) -> None:
        async def run() -> None:
            try:
                async with asyncio.timeout(self._timeout * 4):
                    await coro
            except (RedisError, OSError, TimeoutError) as e:
                self.redis_errors += 1
                log.warning("stored responses: Redis did not take a write (%s)", type(e).__name__)
        task = asyncio.get_running_loop().create_task(run())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=self._timeout * 4)
        if self._redis is not None:
            await self._redis.aclose()


class IdSink:
    """Where a stream's response id goes once its first event names it (gateway/routing/typed_relay.py)."""

    __slots__ = ("index", "backend", "owner", "model")

    def __init__(self, index: StoredResponses, backend: str, owner: str, model: str) -> None:
        self.index, self.backend, self.owner, self.model = index, backend, owner, model

    def __call__(self, response_id: str) -> None:
        self.index.remember(response_id, self.backend, self.owner, self.model)
