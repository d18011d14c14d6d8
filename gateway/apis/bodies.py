"""A request body parsed once and checked for what routing needs, by its route; everything else passes through."""

from __future__ import annotations

from typing import Any, Final, Mapping

import orjson

from gateway.apis import audio, messages, rerank, responses
from gateway.errors import bad_request

REQUIRED: Final[dict[str, str]] = {"chat": "messages", "completions": "prompt", "embeddings": "input"}
NO_BODY: Final[frozenset[str]] = frozenset({"response", "response_cancel"})  # the id in the path is the request
FORMS: Final[frozenset[str]] = frozenset({"transcriptions", "translations"})


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"The request body is not valid JSON: {e}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


def parse_body(raw: bytes, route: str, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The body as a dict (a form's text fields for audio routes); a 400 for what the route cannot take."""
    if route in NO_BODY:
        return {}
    if route in FORMS:
        fields: dict[str, Any] = audio.check((headers or {}).get("content-type", ""), raw)
        fields["stream"] = fields.get("stream", "").lower() == "true"
        return fields
    body = parse_json(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("you must provide a model parameter", param="model", code="missing_required_parameter")
    field = REQUIRED.get(route)
    if field is not None and field not in body:
        raise bad_request(f"Missing required parameter: '{field}'.", param=field, code="missing_required_parameter")
    if route == "chat" and (not isinstance(body["messages"], list) or not body["messages"]):
        raise bad_request("'messages' must be a non-empty array.", param="messages", code="invalid_type")
    elif route in ("responses", "responses_input_tokens"):
        responses.check(body)
    elif route in ("messages", "count_tokens"):
        messages.check(route, body)
    elif route in ("rerank", "score"):
        rerank.check(route, body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream", code="invalid_type")
    if "stream_options" in body and stream is not True and body["stream_options"] is not None:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    return body


def prompt_parts(route: str, body: Mapping[str, Any]) -> tuple[list[str], int] | None:
    """The prompt pieces of the routes beyond chat, completions and embeddings (None: one of those three)."""
    if route in ("responses", "responses_input_tokens"):
        return responses.prompt_parts(body)
    if route in ("messages", "count_tokens"):
        return messages.prompt_parts(body)
    if route in ("rerank", "score"):
        return rerank.prompt_parts(body)
    if route in FORMS or route in NO_BODY:
        return [], 0
    return None


def requested_output(route: str, body: Mapping[str, Any]) -> int | None | bool:
    """The output a request of these routes asks for (False: one of chat, completions, embeddings)."""
    if route == "responses":
        return responses.requested_output(body)
    if route == "messages":
        return messages.requested_output(body)
    return False


def session(route: str, body: Mapping[str, Any]) -> str | None:
    if route == "responses":
        return responses.session(body)
    if route == "messages":
        return messages.session(body)
    return None
