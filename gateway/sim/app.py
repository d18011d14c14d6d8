"""The aiohttp application of one simulated engine: its routes, warm-up and engine-loop lifetime."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.sim import anthropic, pooling, responses
from gateway.sim import faults as faults_mod
from gateway.sim.handlers import make_chat_handler
from gateway.sim.options import SimOptions
from gateway.sim.routes import engine_routes, llama_loading, sim_state
from gateway.sim.state import SIM, SimState

FAULTS = web.AppKey("sim_faults", faults_mod.FaultState)

# llama.cpp answers these while the model loads; everything else gets 503 "Loading model".
_LLAMA_OPEN_WHILE_LOADING = ("/", "/models", "/v1/models")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def llama_loading_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    st = request.app[SIM]
    path = request.path
    if st.ready.is_set() or path in _LLAMA_OPEN_WHILE_LOADING or path.startswith("/sim/"):
        return await handler(request)
    return llama_loading(st)


def _json(data: object, status: int, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers=headers)


def unknown_route(engine: str) -> Middleware:
    """Paths and methods the engine does not serve, answered the way its HTTP framework answers them."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed as exc:
            if engine == "llamacpp":
                return _llama_not_found()  # cpp-httplib matches method and path together
            # aiohttp adds HEAD to every GET route; Starlette does not.
            allowed = sorted(m for m in exc.allowed_methods if m != "HEAD")
            return _json({"detail": "Method Not Allowed"}, 405, {"Allow": ", ".join(allowed)})
        except web.HTTPNotFound:
            if engine == "llamacpp":
                return _llama_not_found()
            return _json({"detail": "Not Found"}, 404)  # FastAPI's default, for vLLM and SGLang

    return middleware


def _llama_not_found() -> web.Response:
    return _json({"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}, 404)


def inference_routes(engine: str, serves: frozenset[str]) -> list[web.RouteDef]:
    chat, text = make_chat_handler("chat"), make_chat_handler("text")
    routes = [web.post("/v1/chat/completions", chat), web.post("/v1/completions", text)]
    if engine == "llamacpp":
        routes.append(web.post("/chat/completions", chat))
    return routes + responses.routes(engine) + anthropic.routes(engine) + pooling.routes(engine, serves)


def build_app(opts: SimOptions, bind_later: bool = False) -> web.Application:
    """The engine's app. With `bind_later` the caller owns readiness (it marks ready at bind time)."""
    st = SimState.create(opts)
    middlewares = [unknown_route(opts.engine)]
    if opts.engine == "llamacpp":
        middlewares.append(llama_loading_gate)
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app[SIM] = st
    app[FAULTS] = st.faults
    app.add_routes(engine_routes(opts.engine))
    app.add_routes(inference_routes(opts.engine, opts.serves))
    app.add_routes(faults_mod.admin_routes(FAULTS))
    app.add_routes([web.get("/sim/state", sim_state)])

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        st.engine.start()
        warmup = None
        if bind_later:
            pass  # readiness follows the socket: the runner sets it when it binds
        elif opts.warmup_s > 0:
            warmup = asyncio.get_running_loop().call_later(opts.warmup_s, st.ready.set)
        else:
            st.ready.set()
        yield
        if warmup is not None:
            warmup.cancel()
        st.responses.cancel_all()
        await st.engine.stop()

    app.cleanup_ctx.append(lifetime)
    return app
