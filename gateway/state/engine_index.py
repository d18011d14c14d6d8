"""With `[responses] state = "engine"`: where each engine-kept response lives, for its owner: (owner, id) -> (backend,
model), on every replica.

An engine keeps a stored response (`store`, the Responses API's default) in its own memory: a follow-up naming it
(`previous_response_id`) or a GET, DELETE or cancel of it is answered only by the backend that made it. The gateway
records that backend with the key that made the response and its model, in this process (bounded, least recent
first out, expiring) and, with `[state] backend = "redis"`, in Redis for the other workers and replicas. The write
goes out in the background, never on a request's path; a replica that does not know an id asks Redis once, and once
more after a short wait (a follow-up can overtake the write of the response it continues). Entries are kept under
their owner (the key's identity, gateway/keys/principal.py): another key's id is the same miss as an unknown one,
with the same two looks, so neither the answer nor its time tells them apart."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Awaitable, Callable, Final

import orjson
from redis import asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway.apis import responses
from gateway.contracts import READY
from gateway.errors import GatewayError
from gateway.fleet.pool import BackendState, Pool

log = logging.getLogger("shapegate")

WRITE_TRIES: Final = 2
SECOND_LOOK_S: Final = 0.05  # a Redis miss is asked again after this: the write may still be on its way
_SEP: Final = "\n"  # between the record's fields: none of them can hold one (ids and model names are checked)


class StoredResponse:
    __slots__ = ("backend", "model", "at")

    def __init__(self, backend: str, model: str, at: float) -> None:
        self.backend = backend
        self.model = model
        self.at = at

    def encode(self) -> bytes:
        return _SEP.join((self.backend, self.model)).encode()

    @classmethod
    def decode(cls, data: bytes, at: float) -> StoredResponse | None:
        parts = data.decode("utf-8", "replace").split(_SEP)
        return cls(parts[0], parts[1], at) if len(parts) == 2 and parts[0] and parts[1] else None

    def backend_in(self, pool: Pool, now: float, response_id: str) -> BackendState:
        """The backend the response lives on, when it can take a request now; else a 503 that says why (also for an
        entry naming a backend that no longer serves its model: a reload, or a forged entry)."""
        b = pool.get(self.backend)
        if b is None or not b.usable(now) or self.model not in b.models:
            why = "is no longer configured" if b is None else "no longer serves its model" \
                if self.model not in b.models else f"is {b.health.state}" if b.health.state != READY \
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
        self._local: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._prefix = key_prefix + "engine-resp:"
        self._timeout = timeout_s
        self._redis = None if redis_url is None else redis_asyncio.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._writes: set[asyncio.Task] = set()
        self.redis_errors = 0

    def _key(self, owner: str, response_id: str) -> str:
        return f"{self._prefix}{owner}:{response_id}"

    def remember(self, response_id: str, backend: str, owner: str, model: str) -> None:
        """A response an engine stored: kept here now, in Redis in the background."""
        rec = StoredResponse(backend, model, time.monotonic())
        self._put((owner, response_id), rec)
        if self._redis is not None:
            redis, key, data = self._redis, self._key(owner, response_id), rec.encode()
            self._background(lambda: redis.set(key, data, ex=max(int(self.ttl_s), 1)))

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
        rec = await self.find(owner, response_id) if isinstance(response_id, str) else None
        if rec is None:
            raise responses.not_found(response_id if isinstance(response_id, str) else None, param)
        return rec

    def forget(self, owner: str, response_id: str) -> None:
        """A response deleted on its engine."""
        self._local.pop((owner, response_id), None)
        if self._redis is not None:
            redis, key = self._redis, self._key(owner, response_id)
            self._background(lambda: redis.delete(key))

    async def find(self, owner: str, response_id: str) -> StoredResponse | None:
        """The record of an owner's response id: this process's, else Redis's (asked twice on a miss)."""
        key = (owner, response_id)
        rec = self._local.get(key)
        now = time.monotonic()
        if rec is not None:
            if now - rec.at <= self.ttl_s:
                self._local.move_to_end(key)
                return rec
            del self._local[key]
        if self._redis is None:
            return None
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(SECOND_LOOK_S)
            data = await self._get(self._key(owner, response_id))
            if data is not None:
                found = StoredResponse.decode(data, time.monotonic())
                if found is not None:
                    self._put(key, found)
                return found
        return None

    async def _get(self, key: str) -> bytes | None:
        assert self._redis is not None
        try:
            async with asyncio.timeout(self._timeout):
                data = await self._redis.get(key)
                return data if isinstance(data, bytes) else None
        except (RedisError, OSError, TimeoutError) as e:
            self.redis_errors += 1
            log.warning("stored responses: Redis did not answer a lookup (%s)", type(e).__name__)
            return None

    def _put(self, key: tuple[str, str], rec: StoredResponse) -> None:
        local = self._local
        local[key] = rec
        local.move_to_end(key)
        while len(local) > self.max_entries:
            local.popitem(last=False)

    def _background(self, call: Callable[[], Awaitable[object]]) -> None:
        async def run() -> None:
            for attempt in range(WRITE_TRIES):  # a write lost would lose a chain: one more try on a slow moment
                try:
                    async with asyncio.timeout(self._timeout * 4):
                        await call()
                    return
                except (RedisError, OSError, TimeoutError) as e:
                    if attempt + 1 == WRITE_TRIES:
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
    """Where a stream's response id goes once its first event names it (a Watcher of
    gateway/routing/typed_relay.py)."""

    __slots__ = ("index", "backend", "owner", "model")
    marks: Final[tuple[bytes, ...]] = ()
    holds: Final[tuple[bytes, ...]] = ()
    renamed: Final[tuple[bytes, bytes] | None] = None

    def __init__(self, index: StoredResponses, backend: str, owner: str, model: str) -> None:
        self.index, self.backend, self.owner, self.model = index, backend, owner, model

    def on_event(self, obj: dict) -> bool:
        resp = obj.get("response")
        if obj.get("type") == "response.created" and isinstance(resp, dict):
            rid = responses.id_of(resp)
            if rid is not None:
                self.index.remember(rid, self.backend, self.owner, self.model)
        return False

    async def end(self) -> None:
        return None


class EngineKept:
    """A Responses request whose state the engines keep: records which engine keeps what it makes (a create that
    stores) and forgets what it deletes (gateway/routing/request.py's KeptBy)."""

    __slots__ = ("index", "owner", "model", "stores", "deletes")

    def __init__(self, index: StoredResponses, owner: str, model: str, stores: bool, deletes: str | None) -> None:
        self.index, self.owner, self.model = index, owner, model
        self.stores = stores  # a create the engine keeps
        self.deletes = deletes  # the id a DELETE names

    def after_reply(self, data: bytes, backend: str, method: str) -> None:
        if self.stores:
            self.index.remember_reply(data, backend, self.owner, self.model)
        elif self.deletes is not None and method == "DELETE":
            self.index.forget(self.owner, self.deletes)

    def watcher(self, backend: str) -> IdSink | None:
        return IdSink(self.index, backend, self.owner, self.model) if self.stores else None
