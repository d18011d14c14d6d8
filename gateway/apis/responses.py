"""OpenAI's Responses API (/v1/responses and its id routes): body checks, prompt text, session, its stream's events."""

from __future__ import annotations

import re
from typing import Any, Final, Mapping

import orjson

from gateway.apis.api import NONE, OPENAI_ERRORS, Api, Meter, StreamRules, dicts, string_field, texts
from gateway.apis.prompt import add_tools, positive_int
from gateway.errors import GatewayError, bad_request

# A response id as engines and the gateway make them (resp_ and hex or alphanumerics): letters, digits, - and _.
RESPONSE_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check(body: Mapping[str, Any]) -> None:
    """What routing needs of a Responses body (the engine checks the rest): `input` a string or a list of items,
    at most one of `previous_response_id` and `conversation`, ids of an id's form."""
    prev = body.get("previous_response_id")
    conv = conversation_of(body)
    if "input" not in body and not isinstance(prev, str) and conv is None:
        raise bad_request("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    value = body.get("input")
    if value is not None and not isinstance(value, (str, list)):
        raise bad_request("'input' must be a string or an array of input items.", param="input",
                          code="invalid_type")
    if prev is not None and not (isinstance(prev, str) and RESPONSE_ID.fullmatch(prev)):
        raise not_found(None, "previous_response_id")
    if prev is not None and conv is not None:
        raise bad_request("Mutually exclusive parameters: provide only one of 'previous_response_id' or "
                          "'conversation'.", param="conversation", code="mutually_exclusive_parameters")
    string_field(body, "instructions")


def conversation_of(body: Mapping[str, Any]) -> str | None:
    """The conversation a request names (`conversation`: an id, or an object with one), of an id's form; a 400
    for anything else."""
    conv = body.get("conversation")
    if conv is None:
        return None
    if isinstance(conv, dict):
        conv = conv.get("id")
    if not isinstance(conv, str) or not RESPONSE_ID.fullmatch(conv):
        raise bad_request("'conversation' must be a conversation id or an object with its id.",
                          param="conversation", code="invalid_type")
    return conv


def not_found(response_id: str | None, param: str = "response_id") -> GatewayError:
    """An unknown id, an id another key made and an id of an unknown form get the same answer: no tenant can tell a
    foreign id from a missing one. The id is echoed only when it has the form of one."""
    shown = f" '{response_id}'" if response_id is not None and RESPONSE_ID.fullmatch(response_id) else ""
    return GatewayError(404, f"Response with id{shown} not found.", param=param, code="response_not_found")


def _item_text(item: Any, out: list[str]) -> int:
    """The text of one input item (a message, a function call or its output): appended to out; 1 per message."""
    if isinstance(item, str):
        out.append(item)
        return 0
    if not isinstance(item, dict):
        return 0
    content = item.get("content")
    if isinstance(content, str):
        out += ("<", str(item.get("role", "")), ">", content)
        return 1
    if isinstance(content, list):
        out += ("<", str(item.get("role", "")), ">")
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
        return 1
    for name in ("arguments", "output"):  # function_call / function_call_output items
        v = item.get(name)
        if isinstance(v, str):
            out.append(v)
    return 0


def prompt_parts(body: Mapping[str, Any]) -> tuple[list[str], int]:
    """instructions, tool definitions and input, in order, as the engines' templates put them."""
    parts: list[str] = []
    n = 0
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        parts += ("<system>", instructions)
        n += 1
    n += add_tools(body.get("tools"), parts)
    value = body.get("input")
    if isinstance(value, str):
        parts += ("<user>", value)
        n += 1
    elif isinstance(value, list):
        for item in value:
            n += _item_text(item, parts)
    return parts, n


def session(body: Mapping[str, Any]) -> str | None:
    """A conversation's own ids make its session: the conversation, else the response it continues."""
    conv = body.get("conversation")
    if isinstance(conv, dict):
        conv = conv.get("id")
    if isinstance(conv, str) and conv:
        return conv
    for name in ("prompt_cache_key", "user", "previous_response_id"):
        v = body.get(name)
        if isinstance(v, str) and v:
            return v
    return None


def stores(body: Mapping[str, Any]) -> bool:
    """Whether the response is kept (`store` defaults to true)."""
    return body.get("store") is not False


def id_of(reply: Mapping[str, Any]) -> str | None:
    """A Response object's id when it has the form of one (an engine's text is never used as a key otherwise)."""
    rid = reply.get("id")
    return rid if isinstance(rid, str) and RESPONSE_ID.fullmatch(rid) else None


def usage(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """A Response's usage in the chat form the gateway counts in (prompt_tokens, completion_tokens, cached)."""
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    out: dict[str, Any] = {"prompt_tokens": u.get("input_tokens"), "completion_tokens": u.get("output_tokens")}
    details = u.get("input_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        out["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
    return out


# -- its stream ---------------------------------------------------------------------------------------------------
# An event with output: each `*.delta` type (text, reasoning, refusal, function-call arguments). A JSON string
# ending in `.delta"` inside a delta's own text is escaped (`\"`), so the quote marks the type's end.
TOKEN_MARK: Final[bytes] = b'.delta"'
# Events worth parsing: the first (its id), the last (usage, status) and failures.
SPECIAL: Final[tuple[bytes, ...]] = (b'"response.created"', b'"response.completed"', b'"response.incomplete"',
                                     b'"response.failed"', b'"error"')
# The events that carry the Response object itself (the gateway that keeps the state rewrites them).
OBJECT_EVENTS: Final[tuple[bytes, ...]] = (b'"response.created"', b'"response.in_progress"', b'"response.queued"',
                                           b'"response.completed"', b'"response.incomplete"', b'"response.failed"')
# The events that end a stream.
FINAL_EVENTS: Final[tuple[bytes, ...]] = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"',
                                          b'"error"')
_SEQ: Final = re.compile(rb'"sequence_number"\s*:\s*(\d+)')


def error_event(err: GatewayError, last: bytes) -> bytes:
    """The stream's own error event, numbered after the last event the client got."""
    found = _SEQ.findall(last)
    seq = int(found[-1]) + 1 if found else 0
    payload = {"type": "error", "code": err.code or "server_error", "message": err.message, "param": err.param,
               "sequence_number": seq}
    return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"


class ResponsesStream(StreamRules):
    """Usage and the end from response.completed (or .incomplete), failures from response.failed and error."""

    def note(self, obj: dict[str, Any], meter: Meter) -> None:
        kind = obj.get("type")
        resp = obj.get("response")
        resp = resp if isinstance(resp, dict) else {}
        if kind in ("response.completed", "response.incomplete"):
            meter.usage = usage(resp) or meter.usage
            meter.saw_finish = meter.saw_done = True
        elif kind == "response.failed":
            err = resp.get("error")
            msg = err.get("message") if isinstance(err, dict) else None
            meter.error = GatewayError(502, f"The upstream engine failed: {msg or 'response.failed'}.",
                                       code="upstream_error")
            meter.saw_done = True
        elif kind == "error":
            message = obj.get("message")
            code = obj.get("code")
            meter.error = GatewayError(500, message if isinstance(message, str) else "The engine reported an error.",
                                       code=code if isinstance(code, str) else "server_error")
            meter.saw_done = True

    def error_event(self, err: GatewayError, last: bytes) -> bytes:
        return error_event(err, last)


class Create(Api):
    def check(self, body: dict[str, Any]) -> None:
        check(body)

    def prompt_parts(self, body: Mapping[str, Any]) -> tuple[list[str], int]:
        return prompt_parts(body)

    def requested_output(self, body: Mapping[str, Any]) -> int | None:
        return positive_int(body.get("max_output_tokens")) if self.generating else None

    def session(self, body: Mapping[str, Any]) -> str | None:
        return session(body)

    def reply_text(self, doc: dict[str, Any]) -> str:
        """Output items of type message, their output_text parts."""
        return "".join(texts(item.get("content"), "output_text") for item in dicts(doc.get("output"))
                       if item.get("type") == "message")

    def event_text(self, doc: dict[str, Any]) -> str:
        delta = doc.get("delta")
        return delta if doc.get("type") == "response.output_text.delta" and isinstance(delta, str) else ""


class ById(Api):
    """A route whose path names a response: `/v1/responses/{id}` and what follows it. No body."""

    def response_id(self, path: str) -> str:
        return path.split("/")[3]

    def upstream_path(self, target: str) -> str:
        path, _, query = target.partition("?")
        return path + "?" + query if query else path  # the engines' paths are the client's


STREAM: Final[StreamRules] = ResponsesStream(TOKEN_MARK, SPECIAL, OPENAI_ERRORS)
CREATE: Final[Api] = Create("responses", "/v1/responses", "/v1/responses", generating=True, stream=STREAM,
                            shadow=True, state="responses")
# The prompt a create would run, counted (llama.cpp); a chain is expanded first, as for a create.
INPUT_TOKENS: Final[Api] = Create("responses_input_tokens", "/v1/responses/input_tokens", "/v1/responses/input_tokens",
                                  state="responses")
# With the state kept by the gateway, it answers these; kept by the engines, they go to the one that made the id
# (a GET with ?stream=true replays the stored events).
RETRIEVE: Final[Api] = ById("response", "/v1/responses/{id}", "/v1/responses/", methods=("GET", "DELETE"), body=NONE,
                            stream=STREAM, state="responses", by_id=True)
CANCEL: Final[Api] = ById("response_cancel", "/v1/responses/{id}/cancel", "/v1/responses/", body=NONE,
                          state="responses", by_id=True)
INPUT_ITEMS: Final[Api] = ById("response_input_items", "/v1/responses/{id}/input_items", methods=("GET",), body=NONE,
                               state="responses", local=True)
