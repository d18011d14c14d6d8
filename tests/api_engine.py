"""A fake engine for the APIs beyond chat (Responses, Messages, rerank, transcriptions) on loopback, with knobs."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import orjson
from aiohttp import BodyPartReader, MultipartReader, StreamReader, web

from tests.fake_engine import FakeEngine

_ids = itertools.count(1)


@dataclass
class ApiKnobs:
    name: str = "e"  # in its response ids and texts, so a test sees which engine answered
    missing: frozenset = frozenset()  # paths answered as unknown (404 {"detail": "Not Found"})
    words: int = 5  # output tokens
    fail_after: int = -1  # a stream's connection is cut after this many deltas (-1: never)
    bad_id: bool = False  # its response ids are not of an id's form
    script: list | None = None  # a stream's bytes, write by write, instead of its events (hostile engines)
    seen: list = field(default_factory=list)  # (method, path, headers, body bytes)
    forms: list = field(default_factory=list)  # each form as aiohttp's reader read it: [(name, filename, bytes)]
    stored: dict = field(default_factory=dict)  # response id -> the Response object


KNOBS: web.AppKey[ApiKnobs] = web.AppKey("api_knobs", ApiKnobs)


def _sse(kind: str, obj: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **obj}) + b"\n\n"


def _response(k: ApiKnobs, body: dict, text: str) -> dict:
    rid = f"resp {k.name}" if k.bad_id else f"resp_{k.name}{next(_ids):06d}"
    return {"id": rid, "object": "response", "created_at": 1, "status": "completed", "model": body.get("model"),
            "output": [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": k.words,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7 + k.words},
            "previous_response_id": body.get("previous_response_id"), "store": body.get("store", True)}


async def _scripted(request: web.Request, script: list) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for part in script:
        await out.write(part)
    await out.write_eof()
    return out


async def _responses(request: web.Request) -> web.StreamResponse:
    k = request.app[KNOBS]
    body = orjson.loads(await request.read())
    if k.script is not None and body.get("stream"):
        return await _scripted(request, k.script)
    prev = body.get("previous_response_id")
    if prev is not None and prev not in k.stored:
        return web.json_response({"error": {"message": f"Response with id '{prev}' not found.",
                                            "type": "invalid_request_error", "param": "previous_response_id",
                                            "code": None}}, status=404)
    words = [f"{k.name}{i}" for i in range(k.words)]
    resp = _response(k, body, " ".join(words))
    if body.get("store", True):
        k.stored[resp["id"]] = resp
    if not body.get("stream"):
        return web.json_response(resp)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    start = {**resp, "status": "in_progress", "output": [], "usage": None}
    await out.write(_sse("response.created", {"response": start, "sequence_number": 0}))
    for i, w in enumerate(words):
        if i == k.fail_after:
            request.transport.close()  # type: ignore[union-attr]
            return out
        await out.write(_sse("response.output_text.delta", {"item_id": "msg_1", "output_index": 0,
                                                            "content_index": 0, "delta": w + " ",
                                                            "sequence_number": i + 1}))
    await out.write(_sse("response.completed", {"response": resp, "sequence_number": len(words) + 1}))
    await out.write_eof()
    return out


async def _stored(request: web.Request) -> web.Response:
    k = request.app[KNOBS]
    rid = request.match_info["rid"]
    resp = k.stored.get(rid)
    if resp is None:
        return web.json_response({"error": {"message": f"Response with id '{rid}' not found.",
                                            "type": "invalid_request_error", "param": None, "code": None}},
                                 status=404)
    if request.method == "DELETE":
        del k.stored[rid]
        return web.json_response({"id": rid, "object": "response", "deleted": True})
    if request.path.endswith("/cancel"):
        return web.json_response({**resp, "status": "cancelled"})
    return web.json_response(resp)


async def _messages(request: web.Request) -> web.StreamResponse:
    k = request.app[KNOBS]
    body = orjson.loads(await request.read())
    if k.script is not None and body.get("stream"):
        return await _scripted(request, k.script)
    words = [f"{k.name}{i}" for i in range(k.words)]
    msg = {"id": f"msg_{k.name}", "type": "message", "role": "assistant", "model": body.get("model"),
           "content": [{"type": "text", "text": " ".join(words)}], "stop_reason": "end_turn",
           "stop_sequence": None, "usage": {"input_tokens": 9, "output_tokens": k.words}}
    if not body.get("stream"):
        return web.json_response(msg)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    start = {**msg, "content": [], "stop_reason": None, "usage": {"input_tokens": 9, "output_tokens": 1}}
    await out.write(_sse("message_start", {"message": start}))
    await out.write(_sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
    for i, w in enumerate(words):
        if i == k.fail_after:
            request.transport.close()  # type: ignore[union-attr]
            return out
        await out.write(_sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": w + " "}}))
    await out.write(_sse("content_block_stop", {"index": 0}))
    await out.write(_sse("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                           "usage": {"output_tokens": k.words}}))
    await out.write(_sse("message_stop", {}))
    await out.write_eof()
    return out


async def _count_tokens(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"input_tokens": 9})


async def _rerank(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read())
    docs = body.get("documents") or []
    results = [{"index": i, "relevance_score": 1.0 / (i + 1), "document": {"text": d}} for i, d in enumerate(docs)]
    return web.json_response({"id": "rerank-1", "model": body.get("model"), "usage": {"total_tokens": 10},
                              "results": results})


async def _form_of(request: web.Request, data: bytes) -> list[tuple[str | None, str | None, bytes]]:
    """The form as aiohttp's multipart reader reads it, from the bytes the engine received (recorded first)."""
    stream = StreamReader(request.protocol, 2 ** 16, loop=asyncio.get_running_loop())
    stream.feed_data(data)
    stream.feed_eof()
    out = []
    async for part in MultipartReader(request.headers, stream):
        assert isinstance(part, BodyPartReader)
        out.append((part.name, part.filename, bytes(await part.read())))
    return out


async def _transcribe(request: web.Request) -> web.Response:
    k = request.app[KNOBS]
    form = await _form_of(request, k.seen[-1][3])
    k.forms.append(form)
    model = next((v.decode() for name, _, v in form if name == "model"), None)
    return web.json_response({"text": f"heard {k.name} via {model}"})


@web.middleware
async def _record(request: web.Request, handler):
    k = request.app[KNOBS]
    k.seen.append((request.method, request.path_qs, dict(request.headers), await request.read()))
    if request.path in k.missing:
        return web.json_response({"detail": "Not Found"}, status=404)
    return await handler(request)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})


class ApiEngine(FakeEngine):
    """One fake engine: `await ApiEngine(ApiKnobs(name="a")).start()`, then `.url`, `.stop()`."""

    def __init__(self, knobs: ApiKnobs | None = None) -> None:
        super().__init__()
        self.knobs = knobs or ApiKnobs()  # type: ignore[assignment]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_record])
        app[KNOBS] = self.knobs
        r = app.router
        r.add_post("/v1/responses", _responses)
        r.add_get("/v1/responses/{rid}", _stored)
        r.add_delete("/v1/responses/{rid}", _stored)
        r.add_post("/v1/responses/{rid}/cancel", _stored)
        r.add_post("/v1/messages", _messages)
        r.add_post("/v1/messages/count_tokens", _count_tokens)
        r.add_post("/v1/rerank", _rerank)
        r.add_post("/v1/audio/transcriptions", _transcribe)
        r.add_get("/health", _health)
        r.add_get("/v1/models", _health)
        return app
