"""One Responses request whose state the gateway keeps (Turn): the expanded request it sends, and what it records.

A turn continuing a stored response (`previous_response_id`) or a conversation is sent to an engine as one
self-contained request: the kept items before its own input, `store: false` (the engine keeps nothing). The
engine's Response comes back under the gateway's id, with the fields the client set (`store`,
`previous_response_id`, `conversation`), and is recorded before the client sees its final event, so that the
next turn, on any engine or replica, finds it."""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Final

import orjson

from gateway.apis.responses import FINAL_EVENTS, OBJECT_EVENTS
from gateway.errors import GatewayError
from gateway.state.items import output_items
from gateway.state.records import RecordCache, record_of
from gateway.state.store import OK, STORE_ERRORS, Store

log = logging.getLogger("shapegate")

FINAL_STATUSES: Final = frozenset({"completed", "incomplete"})  # a response that can be continued
RUNNING: Final = ("queued", "in_progress")  # a background response not yet done


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(16)  # 128 random bits: unguessable, and short (chains keep their ids)


class Turn:
    """One create (or input_tokens) request with gateway-kept state; see the module's docstring."""

    __slots__ = ("id", "owner", "model", "created_at", "prev", "chain", "conversation", "store", "background",
                 "items", "body", "session", "engine_id", "_store", "_cache", "max_bytes", "errors", "holds", "_final",
                 "private")
    marks: Final = OBJECT_EVENTS  # a stream's events that carry the Response object: rewritten

    def __init__(self, owner: str, body: dict[str, Any], prev: str | None, chain: list[str],
                 conversation: str | None, items: list[dict[str, Any]], upstream: dict[str, Any], store: Store,
                 cache: RecordCache | None, max_bytes: int) -> None:
        self.id = new_response_id()
        self.owner = owner
        self.model = body["model"]
        self.created_at = int(time.time())
        self.prev = prev
        self.chain = chain  # every response before this one, oldest first (prev last): what its input holds
        self.conversation = conversation
        self.store = body.get("store") is not False
        self.background = body.get("background") is True
        self.items = items  # this turn's own input items, as kept
        self.body = upstream  # what goes to the engine
        # The chain's or the conversation's first id: later turns keep one session (and its engine's cache).
        self.session = conversation or (chain[0] if chain else prev)
        self.engine_id: bytes | None = None  # the engine's id for this response, once its stream named it
        self._store = store
        self._cache = cache
        self.max_bytes = max_bytes
        self.errors = 0  # writes the store did not take
        # A stream's final event waits until the turn is recorded (only when there is something to record).
        self.holds = FINAL_EVENTS if self.keeps else ()
        self._final: dict[str, Any] | None = None
        self.private: tuple[str, ...] = ()  # the serving engine's own reply fields: neither relayed nor kept

    # -- a stream's events (gateway/routing/typed_relay.py's Watcher) ------------------------------------------------
    @property
    def renamed(self) -> tuple[bytes, bytes] | None:
        return (self.engine_id, self.id.encode()) if self.engine_id is not None else None

    def on_event(self, obj: dict[str, Any]) -> bool:
        resp = obj.get("response")
        if not isinstance(resp, dict):
            return False
        self.rewrite(resp)
        if obj.get("type") in ("response.completed", "response.incomplete"):
            self._final = resp
        return True

    async def finish_reply(self, data: bytes) -> bytes:
        """A whole (non-streamed) reply: its Response rewritten and recorded; the bytes the client gets."""
        try:
            resp = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data  # not a Response: passed on as it came, nothing recorded
        if not isinstance(resp, dict):
            return data
        self.rewrite(resp)
        await self.commit(resp)
        return orjson.dumps(resp)

    async def end(self) -> None:
        final, self._final = self._final, None
        if final is not None:
            await self.commit(final)

    @property
    def keeps(self) -> bool:
        """Whether this turn writes anything at its end (its response, or its conversation's new items)."""
        return self.store or self.conversation is not None

    def rewrite(self, resp: dict[str, Any]) -> None:
        """An engine's Response object as the client sees it: the gateway's id, the fields the client set."""
        eid = resp.get("id")
        if self.engine_id is None and isinstance(eid, str) and eid and eid != self.id:
            self.engine_id = eid.encode()
        resp["id"] = self.id
        resp["model"] = self.model  # the public name, as the client sent it (and as it is kept)
        for name in self.private:
            resp.pop(name, None)
        resp["store"] = self.store
        resp["previous_response_id"] = self.prev
        if self.conversation is not None:
            resp["conversation"] = {"id": self.conversation}
        if self.background or "background" in resp:
            resp["background"] = self.background

    def shell(self, status: str) -> dict[str, Any]:
        """A Response object before an engine made one: a background response queued, or cancelled."""
        b = self.body
        resp: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "output": [], "error": None, "incomplete_details": None, "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"), "metadata": b.get("metadata") or {},
            "parallel_tool_calls": b.get("parallel_tool_calls", True), "temperature": b.get("temperature"),
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [], "top_p": b.get("top_p"),
            "usage": None}
        self.rewrite(resp)
        return resp

    async def commit(self, resp: dict[str, Any], replace: tuple[str, ...] = ()) -> None:
        """Record a finished Response (rewritten already): the response itself when stored, this turn's items and
        its output in its conversation. A store that fails is logged; the client's reply stands (with a cache,
        this process still continues the chain). `replace`: only over a record of one of these statuses (a
        background run, which a cancel may have ended first)."""
        status = resp.get("status")
        if self.conversation is not None and status in FINAL_STATUSES:
            await self._append(resp)
        if not self.store:
            return
        rec = record_of(str(status), self.prev, self.chain, self.conversation, self.items, resp)
        data = orjson.dumps(rec)
        if len(data) > self.max_bytes:
            log.warning("a stored response was not kept: %d bytes, over [responses] max_response_bytes (%d)",
                        len(data), self.max_bytes)
            return
        try:
            if replace:
                if not await self._store.replace_response_if(self.owner, self.id, data, replace):
                    return  # cancelled meanwhile: the cancel's record stands
            else:
                await self._store.put_response(self.owner, self.id, data)
        except STORE_ERRORS as e:
            self.errors += 1
            log.warning("stored responses: the store did not take a response (%s)", type(e).__name__)
        if self._cache is not None and status in FINAL_STATUSES:
            self._cache.put(self.owner, self.id, data, rec)  # (parsed already: the dict it was made from)

    async def _append(self, resp: dict[str, Any]) -> None:
        assert self.conversation is not None
        added = [orjson.dumps(it) for it in (*self.items, *output_items(resp))]
        try:
            done = await self._store.append_items(self.owner, self.conversation, added)
        except STORE_ERRORS as e:
            self.errors += 1
            log.warning("conversations: the store did not take a turn's items (%s)", type(e).__name__)
            return
        if done != OK:
            log.warning("conversations: a turn's items were not added (%s)", done)

    def failed(self, err: GatewayError) -> dict[str, Any]:
        """The Response of a background run that failed."""
        resp = self.shell("failed")
        resp["error"] = {"code": err.code or "server_error", "message": err.message}
        return resp
