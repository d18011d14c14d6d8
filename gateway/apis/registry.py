"""Every public API route, and the path -> Api lookup the HTTP front makes for each request.

Adding an API is a module in gateway/apis/ with its Api objects, and one line in ALL below."""

from __future__ import annotations

from typing import Final

from gateway.apis import audio, chat, completions, conversations, embeddings, messages, rerank, responses
from gateway.apis.api import Api
from gateway.apis.responses import RESPONSE_ID

ALL: Final[tuple[Api, ...]] = (
    chat.CHAT, completions.COMPLETIONS, embeddings.EMBEDDINGS,
    responses.CREATE, responses.INPUT_TOKENS, responses.RETRIEVE, responses.CANCEL, responses.INPUT_ITEMS,
    conversations.CREATE, conversations.ONE, conversations.ITEMS, conversations.ITEM,
    messages.MESSAGES, messages.COUNT_TOKENS,
    rerank.RERANK, rerank.SCORE,
    audio.TRANSCRIPTIONS, audio.TRANSLATIONS,
)
BY_NAME: Final[dict[str, Api]] = {a.name: a for a in ALL}
# The routes an engine may serve (adapters name theirs among these); the others are the gateway's own.
ENGINE_APIS: Final[frozenset[str]] = frozenset(a.name for a in ALL if a.upstream)

# Fixed paths, and the paths with ids by their fixed start and segment count (`{id}` stands for one segment).
_FIXED: Final[dict[str, Api]] = {p: a for a in ALL for p in (a.path, *a.aliases) if "{" not in p}
_PATTERNS: Final[tuple[tuple[tuple[str, ...], Api], ...]] = tuple(
    (tuple(a.path.split("/")), a) for a in ALL if "{" in a.path)


def api_of(path: str) -> Api | None:
    """The route a request path names (query string already cut), or None for a path that is no API route. Ids in
    a path must have an id's form (letters, digits, - and _)."""
    api = _FIXED.get(path)
    if api is not None or not path.startswith(("/v1/responses/", "/v1/conversations/")):
        return api
    parts = path.split("/")
    for pattern, candidate in _PATTERNS:
        if len(pattern) == len(parts) and all(
                p == s if p[:1] != "{" else RESPONSE_ID.fullmatch(s) is not None for p, s in zip(pattern, parts)):
            return candidate
    return None


def known_paths() -> list[str]:
    """Every API path, ids as `{id}`: for the 404 of an unknown path, which suggests the nearest."""
    return [p for a in ALL for p in (a.path, *a.aliases)]
