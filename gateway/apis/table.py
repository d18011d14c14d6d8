"""Every API route the gateway serves: the client's path and methods, the route's name, the engine path it goes to."""

from __future__ import annotations

import re
from typing import Final

from gateway.errors import GatewayError

# Route name -> the engine path a request of it is sent to (the id routes add the response's id).
UPSTREAM: Final[dict[str, str]] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
    "responses_input_tokens": "/v1/responses/input_tokens",
    "response": "/v1/responses/",  # + id (GET, DELETE)
    "response_cancel": "/v1/responses/",  # + id + /cancel
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
    "rerank": "/v1/rerank",
    "score": "/v1/score",
    "transcriptions": "/v1/audio/transcriptions",
    "translations": "/v1/audio/translations",
}

# Client path -> route name. Rerank has three names among the engines: each goes to /v1/rerank, which all serve.
PATH_ROUTES: Final[dict[str, str]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    "/v1/responses/input_tokens": "responses_input_tokens",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/v1/score": "score",
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
}

METHODS: Final[dict[str, tuple[str, ...]]] = {"response": ("GET", "DELETE")}  # every other route: POST only
RESPONSE_PREFIX: Final[str] = "/v1/responses/"
# A response id as engines make them (resp_ and 32 hex on vLLM; other letters elsewhere): letters, digits, - and _.
RESPONSE_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")

# Client headers passed on, per route, besides a valid trace context: (name as received, name sent).
_ANTHROPIC_HEADERS: Final = (("anthropic-version", "anthropic-version"), ("anthropic-beta", "anthropic-beta"))
_FORM_HEADERS: Final = (("content-type", "Content-Type"),)
PASSED_HEADERS: Final[dict[str, tuple[tuple[str, str], ...]]] = {
    "messages": _ANTHROPIC_HEADERS, "count_tokens": _ANTHROPIC_HEADERS,
    "transcriptions": _FORM_HEADERS, "translations": _FORM_HEADERS}

# Routes that generate text: they are shaped, measured per token and learn the engines' latencies.
GENERATING: Final[frozenset[str]] = frozenset({"chat", "completions", "responses", "messages"})
# Routes whose stream is typed events (`event:` lines, no [DONE]) rather than chat chunks.
TYPED_STREAMS: Final[frozenset[str]] = frozenset({"responses", "messages"})
# Routes that answer from a stored response: they go to the backend that made it, never elsewhere.
BY_RESPONSE_ID: Final[frozenset[str]] = frozenset({"response", "response_cancel"})
# Routes whose errors take Anthropic's shape.
ANTHROPIC: Final[frozenset[str]] = frozenset({"messages", "count_tokens"})


def route_of(path: str) -> str | None:
    """The route a request path names (query string already cut), or None for a path that is no API route."""
    route = PATH_ROUTES.get(path)
    if route is not None or not path.startswith(RESPONSE_PREFIX):
        return route
    rest = path[len(RESPONSE_PREFIX):]
    if rest.endswith("/cancel"):
        return "response_cancel" if RESPONSE_ID.fullmatch(rest[:-7]) else None
    return "response" if RESPONSE_ID.fullmatch(rest) else None


def allows(route: str, method: str) -> bool:
    return method in METHODS.get(route, ("POST",))


def allowed(route: str) -> str:
    """The Allow header of a 405 on this route."""
    return ", ".join(METHODS.get(route, ("POST",)))


def response_id_in(path: str) -> str:
    """The response id of an id route's path (route_of checked its form)."""
    rest = path[len(RESPONSE_PREFIX):]
    return rest[:-7] if rest.endswith("/cancel") else rest


def public_path(route: str) -> str:
    """The path a client uses for a route, for messages that name it."""
    for path, r in PATH_ROUTES.items():
        if r == route:
            return path
    return "/v1/responses/{id}" + ("/cancel" if route == "response_cancel" else "")


def route_not_served(model: str, route: str) -> GatewayError:
    return GatewayError(404, f"No backend of the model `{model}` serves {public_path(route)}: their engines do not "
                        f"offer this API.", code="route_not_served")


def upstream_path(route: str, target: str) -> str:
    """The engine path of a request (target: the client's path and query string)."""
    if route not in BY_RESPONSE_ID:
        return UPSTREAM[route]
    path, _, query = target.partition("?")
    tail = UPSTREAM[route] + response_id_in(path) + ("/cancel" if route == "response_cancel" else "")
    return tail + "?" + query if query else tail
