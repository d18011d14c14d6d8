"""The floor of the stack: a bare aiohttp + uvloop + orjson proxy (no auth, policy, stats), for side-by-side runs."""

from __future__ import annotations

import argparse

import aiohttp
import orjson
import uvloop
from aiohttp import web

UPSTREAM: web.AppKey[str] = web.AppKey("upstream", str)
SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)


async def proxy(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = orjson.loads(raw)  # parse once, as any router must
    async with request.app[SESSION].post(request.app[UPSTREAM] + request.path, data=raw,
                                         headers={"Content-Type": "application/json"}) as up:
        if not body.get("stream"):
            return web.Response(body=await up.read(), status=up.status, content_type="application/json")
        resp = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def session_ctx(app: web.Application):
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
    yield
    await app[SESSION].close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    a = p.parse_args()
    app = web.Application()
    app[UPSTREAM] = a.upstream
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", proxy)
    app.router.add_get("/readyz", health)
    web.run_app(app, host="127.0.0.1", port=a.port, access_log=None, print=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
