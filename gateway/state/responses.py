"""Stored responses kept by the gateway: a request that continues one is expanded to its whole input (Turn), and
the id routes (GET, DELETE, cancel, input_items) are answered from the store, on every engine.

A chain is read in one round trip when this process has its records already (the store is asked only whether
they all still exist), else in two (the response it continues, then every earlier one at once). Another key's
id is the same miss as an unknown one: the store's keys hold their owner."""

from __future__ import annotations

import asyncio
from typing import Any, Final, Mapping

import orjson

from gateway.apis import conversations as conv_api
from gateway.apis import responses as api
from gateway.config import ResponsesConfig
from gateway.errors import GatewayError, bad_request
from gateway.state.items import client_input, for_engine, stored_items
from gateway.state.records import RecordCache, decode_record
from gateway.state.store import RESPONSE, STORE_ERRORS, Store
from gateway.state.turns import FINAL_STATUSES, RUNNING, Turn

# Fields of a create that the gateway answers for and no engine is sent.
GATEWAY_FIELDS: Final = frozenset({"previous_response_id", "conversation", "background"})


def unavailable(what: str) -> GatewayError:
    return GatewayError(503, f"The gateway's {what} store did not answer; retry shortly.", code="state_unavailable",
                        headers={"Retry-After": "1"})


def gone(missing: str, prev: str) -> GatewayError:
    """An earlier turn of a chain is no longer kept: the chain cannot be continued whole."""
    return GatewayError(404, f"Response with id '{missing}' not found: it is an earlier turn of '{prev}', and it was "
                        f"deleted, evicted or expired, so the conversation can no longer be continued whole.",
                        param="previous_response_id", code="response_not_found")


class ResponsesService:
    """See the module's docstring. `cache`: recent records of this process (None: every read goes to the store)."""

    def __init__(self, store: Store, cfg: ResponsesConfig, cache: RecordCache | None) -> None:
        self.store = store
        self.cfg = cfg
        self.cache = cache
        self.running: dict[tuple[str, str], asyncio.Task] = {}  # background runs of this process, by (owner, id)

    # -- a create (or input_tokens): the request expanded -----------------------------------------------------------
    async def begin(self, body: dict[str, Any], owner: str) -> Turn:
        """The turn of a create: its upstream body (kept items, then its own input; `store: false`) and what it will
        record. 404 for an unknown, foreign or evicted id; 400 for input that cannot be kept."""
        prev = body.get("previous_response_id")
        prev = prev if isinstance(prev, str) else None
        conv = api.conversation_of(body)
        items = stored_items(body.get("input"))
        history: list[dict[str, Any]] = []  # the kept items, as an engine is sent them
        chain: list[str] = []
        try:
            if prev is not None:
                records = await self.chain_of(owner, prev)
                for rec in records:
                    history += engine_items(rec)
                chain = [*records[-1]["chain"], prev]
            elif conv is not None:
                kept = await self.store.items(owner, conv)
                if kept is None:
                    raise conv_api.not_found(conv)
                if len(kept) + len(items) > self.cfg.max_conversation_items:
                    raise GatewayError(400, f"The conversation '{conv}' holds {len(kept)} items, the most this gateway "
                                       f"keeps in one is {self.cfg.max_conversation_items}; start another.",
                                       param="conversation", code="conversation_full")
                history = for_engine([i for i in map(item_of, kept) if i is not None])
        except STORE_ERRORS:
            raise unavailable("conversation state") from None
        upstream = {k: v for k, v in body.items() if k not in GATEWAY_FIELDS}
        upstream["input"] = history + client_input(body.get("input")) if history else body.get("input")
        upstream["store"] = False
        if body.get("background") is True:
            upstream.pop("stream", None)  # the gateway runs it to its end and keeps the result
        turn = Turn(owner, body, prev, chain, conv, items, upstream, self.store, self.cache, self.cfg.max_response_bytes)
        if turn.store and len(orjson.dumps(items)) > self.cfg.max_response_bytes:
            raise bad_request(f"The input is larger than a stored response may be ({self.cfg.max_response_bytes} "
                              f"bytes): send it with `store: false`, or in smaller turns.", param="input",
                              code="response_too_large")
        return turn

    async def chain_of(self, owner: str, prev: str) -> list[dict[str, Any]]:
        """The records of a chain, oldest first, ending with `prev`'s: each a finished response of `owner`."""
        cache = self.cache
        hit = cache.get(owner, prev) if cache is not None else None
        if hit is not None and cache is not None:
            ids = [*hit["chain"], prev]
            known = [r for r in (cache.get(owner, i) for i in ids) if r is not None]
            if len(known) == len(ids) and await self.store.count(RESPONSE, owner, ids) == len(ids):
                return known
        data = await self.store.get(RESPONSE, owner, prev)
        last = decode_record(data) if data is not None else None
        if last is None:
            raise api.not_found(prev, "previous_response_id")
        _finished(last, prev)
        found = await self.store.get_many(RESPONSE, owner, last["chain"])
        records: list[dict[str, Any]] = []
        for rid, blob in zip(last["chain"], found):
            rec = decode_record(blob) if blob is not None else None
            if rec is None:
                raise gone(rid, prev)
            records.append(rec)
            if cache is not None and blob is not None:
                cache.put(owner, rid, blob, rec)
        if cache is not None and data is not None:
            cache.put(owner, prev, data, last)
        return [*records, last]

    # -- the id routes ----------------------------------------------------------------------------------------------
    async def answer(self, route: str, method: str, rid: str, query: Mapping[str, str], owner: str) -> bytes:
        """GET, DELETE or cancel of a stored response, or its input items: the JSON the client gets (200)."""
        try:
            data = await self.store.get(RESPONSE, owner, rid)
            rec = decode_record(data) if data is not None else None
            if rec is None:
                raise api.not_found(rid)
            if route == api.INPUT_ITEMS.name:
                return orjson.dumps(conv_api.page(await self._input_items(owner, rid, rec), query))
            if route == api.CANCEL.name:
                return orjson.dumps(await self._cancel(owner, rid, rec))
            if method == "DELETE":
                await self.store.delete(RESPONSE, owner, rid)
                if self.cache is not None:
                    self.cache.forget(owner, rid)
                return orjson.dumps({"id": rid, "object": "response.deleted", "deleted": True})
        except STORE_ERRORS:
            raise unavailable("response") from None
        if query.get("stream") == "true":
            raise bad_request("Streaming a stored response again is not offered by this gateway: GET it without "
                              "`stream`.", param="stream", code="unsupported_parameter")
        return orjson.dumps(rec["response"])

    async def _input_items(self, owner: str, rid: str, rec: dict[str, Any]) -> list[dict[str, Any]]:
        """Every item the response was made from: the chain's inputs and outputs before its own input."""
        items: list[dict[str, Any]] = []
        if rec.get("prev"):
            for earlier in await self.chain_of(owner, rec["prev"]):
                items += earlier["input"]
                items += earlier["response"].get("output") or []
        return items + rec["input"]

    async def _cancel(self, owner: str, rid: str, rec: dict[str, Any]) -> dict[str, Any]:
        if rec["status"] not in RUNNING:
            raise bad_request("Only a response made with `background: true` and not yet finished can be cancelled.",
                              param="response_id", code="not_cancellable")
        resp = {**rec["response"], "status": "cancelled"}
        cancelled = orjson.dumps({**rec, "status": "cancelled", "response": resp})
        if not await self.store.replace_response_if(owner, rid, cancelled, RUNNING):
            data = await self.store.get(RESPONSE, owner, rid)  # it finished meanwhile: as it is now
            now = decode_record(data) if data is not None else None
            return now["response"] if now is not None else resp
        task = self.running.get((owner, rid))
        if task is not None:
            task.cancel()  # running here: the engine's request ends now (elsewhere it ends, unrecorded, on its own)
        return resp


# Where a parsed record of this process keeps its items as an engine is sent them, made once (a key no JSON record
# can hold; records read from the cache are never written back).
ENGINE_ITEMS: Final = "\x00engine"


def engine_items(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """One finished response's input and output items, as an engine is sent them again (made once per record)."""
    made = rec.get(ENGINE_ITEMS)
    if made is None:
        made = rec[ENGINE_ITEMS] = for_engine([*rec["input"], *(rec["response"].get("output") or [])])
    return made


def _finished(rec: dict[str, Any], rid: str) -> None:
    if rec["status"] not in FINAL_STATUSES:
        raise bad_request(f"The response '{rid}' is {rec['status']}: only a finished response can be continued.",
                          param="previous_response_id", code="previous_response_not_finished")


def item_of(data: bytes) -> dict[str, Any] | None:
    try:
        item = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return item if isinstance(item, dict) else None

