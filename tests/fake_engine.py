"""A small, fast OpenAI-compatible fake engine on loopback, with knobs for failures and a hold gate."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from benchmarks.loopback import free_port


@dataclass
class Knobs:
    fail_status: int = 0  # answer every completion with this status (0: succeed)
    fail_body: bytes = b'{"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}'
    retry_after: str | None = None
    hang: bool = False  # never answer (until released)
    drop_after: int = -1  # close the connection after this many stream chunks (-1: never)
    chunk_delay: float = 0.0
    stream_chunks: int = 20
    done: bool = True  # end streams with [DONE]
    usage_default: bool = False  # include usage without being asked
    gate: asyncio.Event | None = None  # when set, requests wait here until the test releases them
    seen: list = field(default_factory=list)  # parsed bodies received
    headers_seen: list = field(default_factory=list)
    health_status: int = 200
    aborted: int = 0
    active: int = 0
    max_active: int = 0  # the most requests it held at once
    word: str = "w"  # the output is "<word>0 <word>1 ...": engines with another word answer differently
    # A latency model, streamed or not: first token after ttft_s + prompt characters / 1000 * prefill_s_per_kchar,
    # then token_s per further token. With it the usage counts prompt tokens as characters / 4.
    ttft_s: float = 0.0
    prefill_s_per_kchar: float = 0.0
    token_s: float = 0.0


KNOBS: web.AppKey[Knobs] = web.AppKey("knobs", Knobs)


def _chunk(model: str, content: str | None, finish: str | None = None, route: str = "chat") -> bytes:
    if route == "chat":
        choice = {"index": 0, "delta": {} if content is None else {"content": content}, "finish_reason": finish}
        obj = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": model,
               "choices": [choice]}
    else:
        obj = {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": model,
               "choices": [{"index": 0, "text": content or "", "finish_reason": finish}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _completion(request: web.Request, route: str) -> web.StreamResponse:
    k = request.app[KNOBS]
    body = orjson.loads(await request.read())
    k.seen.append(body)
    k.headers_seen.append(request.headers.copy())
    k.active += 1
    k.max_active = max(k.max_active, k.active)
    try:
        if k.gate is not None:
            await k.gate.wait()
        if k.hang:
            await asyncio.sleep(3600)
        if k.fail_status:
            headers = {"Retry-After": k.retry_after} if k.retry_after else {}
            return web.Response(status=k.fail_status, body=k.fail_body, content_type="application/json",
                                headers=headers)
        model = body.get("model", "fake")
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or k.stream_chunks)
        timed = k.ttft_s or k.prefill_s_per_kchar or k.token_s
        chars = len(orjson.dumps(body.get("messages") or body.get("prompt") or ""))
        prompt_tokens = chars // 4 if timed else 10
        if timed:
            await asyncio.sleep(k.ttft_s + chars / 1000 * k.prefill_s_per_kchar)
        if not body.get("stream"):
            if timed:
                await asyncio.sleep((n - 1) * k.token_s)
            text = " ".join(f"{k.word}{i}" for i in range(n))
            if route == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": text, "finish_reason": "length"}
            obj = {"id": "x", "object": "chat.completion" if route == "chat" else "text_completion", "created": 1,
                   "model": model, "choices": [choice],
                   "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}}
            return web.Response(body=orjson.dumps(obj), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if route == "chat":
            await resp.write(b"data: " + orjson.dumps({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                                                        "created": 1, "model": model, "choices": [
                                                            {"index": 0, "delta": {"role": "assistant", "content": ""},
                                                             "finish_reason": None}]}) + b"\n\n")
        for i in range(n):
            if i == k.drop_after:
                request.transport.close()
                return resp
            if k.chunk_delay:
                await asyncio.sleep(k.chunk_delay)
            if i and k.token_s:
                await asyncio.sleep(k.token_s)
            await resp.write(_chunk(model, f"{k.word}{i} ", route=route))
        await resp.write(_chunk(model, None, "length", route) if route == "chat" else _chunk(model, "", "length", route))
        opts = body.get("stream_options") or {}
        if opts.get("include_usage") or k.usage_default:
            await resp.write(b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "created": 1,
                                                        "model": model, "choices": [], "usage": {
                                                            "prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                            "total_tokens": prompt_tokens + n}}) + b"\n\n")
        if k.done:
            await resp.write(b"data: [DONE]\n\n")
        return resp
    except asyncio.CancelledError:
        k.aborted += 1
        raise
    finally:
        k.active -= 1


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "completions")


async def _embeddings(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read())
    request.app[KNOBS].seen.append(body)
    return web.Response(body=orjson.dumps({"object": "list", "model": body.get("model"), "data": [
        {"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
        "usage": {"prompt_tokens": 3, "total_tokens": 3}}), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=request.app[KNOBS].health_status)


def make_app(knobs: Knobs | None = None) -> web.Application:
    app = web.Application(client_max_size=16 * 1024 * 1024)  # bodies up to the gateway's own limit and beyond
    app[KNOBS] = knobs or Knobs()
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _health)
    return app


class FakeEngine:
    """A running fake engine; `knobs` changes its behaviour live."""

    def __init__(self, knobs: Knobs | None = None) -> None:
        self.knobs = knobs or Knobs()
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        return make_app(self.knobs)

    async def start(self, port: int = 0) -> "FakeEngine":
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        self.port = port or free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
