"""What one public API route is to the gateway (Api): its paths, body, prompt, stream rules, errors and state."""

from __future__ import annotations

from typing import Any, Final, Mapping, Protocol

import orjson

from gateway.errors import GatewayError, bad_request

# How a route's request body is read.
JSON: Final[int] = 0  # a JSON object with a `model`
FORM: Final[int] = 1  # multipart/form-data (audio)
NONE: Final[int] = 2  # no body: the path names what is asked (GET, DELETE, cancel)


class Meter(Protocol):
    """What a typed stream's special events tell the relay (gateway/routing/relay.py's StreamMeter has it)."""

    usage: dict[str, Any] | None
    saw_finish: bool
    saw_done: bool
    error: GatewayError | None


class ErrorShape:
    """How an API's errors look: OpenAI's `{"error": {...}}` (this class), or another API's own (a subclass)."""

    def status_of(self, err: GatewayError) -> int:
        return err.status

    def body(self, err: GatewayError, request_id: str) -> bytes:
        return err.body()

    def event(self, err: GatewayError, last: bytes) -> bytes:
        """The error event that ends a stream of this API after output began (`last`: the last event sent)."""
        return err.sse_event()


OPENAI_ERRORS: Final[ErrorShape] = ErrorShape()


class StreamRules:
    """A typed event stream (`event:` lines, its own usage and ending, no [DONE]): what a token event looks like,
    which few events are parsed, and what they mean. The chat stream's rules are the relay's own (no StreamRules)."""

    def __init__(self, token_mark: bytes, special: tuple[bytes, ...], errors: ErrorShape) -> None:
        self.token_mark = token_mark  # in every event that carries output
        self.special = special  # in the events worth parsing (an id, usage, the ending, an error)
        self.errors = errors

    def note(self, obj: dict[str, Any], meter: Meter) -> None:
        """What one parsed special event says (usage, the stream's end, an error), written to the meter."""

    def error_event(self, err: GatewayError, last: bytes) -> bytes:
        return self.errors.event(err, last)


class Api:
    """One public route: built once per route, read on every request of it. Data in the constructor, behaviour in
    the methods a subclass overrides (gateway/apis/<api>.py); gateway/apis/registry.py maps paths to them."""

    def __init__(self, name: str, path: str, upstream: str = "", *, methods: tuple[str, ...] = ("POST",),
                 body: int = JSON, generating: bool = False, learns: bool = False, everywhere: bool = False,
                 passed_headers: tuple[tuple[str, str], ...] = (), stream: StreamRules | None = None,
                 errors: ErrorShape = OPENAI_ERRORS, usage_on_request: bool = False, shadow: bool = False,
                 state: str = "", local: bool = False, by_id: bool = False, aliases: tuple[str, ...] = ()) -> None:
        self.name = name  # the route's name: metrics' `route` label, the access log, adapters' `apis`
        self.path = path  # the client's path; `{id}` (and `{item}`) stand for ids the path carries
        self.aliases = aliases  # other client paths of the same route
        self.upstream = upstream  # the engine path ("": never sent to an engine)
        self.methods = methods
        self.body = body
        self.generating = generating  # shaped by its output, measured per token
        self.learns = learns or generating  # its attempts teach a backend's latency model
        self.everywhere = everywhere  # every engine serves it: no per-route candidate filter, no 404 learning
        self.passed_headers = passed_headers  # client headers passed on: (name as received, name sent)
        self.stream = stream  # a typed event stream; None: chat's SSE chunks ending in [DONE]
        self.errors = errors
        self.usage_on_request = usage_on_request  # a stream reports usage only when asked (stream_options)
        self.shadow = shadow  # a shadow experiment may copy it
        self.state = state  # the gateway-owned state it reads or writes ("responses", "conversations"; "": none)
        self.local = local  # answered by the gateway from its own state, never by an engine
        self.by_id = by_id  # names a stored response (with state kept by the engines: only its engine knows it)
        self.allow = ", ".join(methods)  # a 405's Allow header

    def __repr__(self) -> str:
        return f"Api({self.name})"

    def allows(self, method: str) -> bool:
        return method in self.methods

    # -- the request body -----------------------------------------------------------------------------------------
    def parse(self, raw: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
        """The body as a dict, checked for what routing needs (the engine checks the rest); a 400 otherwise."""
        body = parse_json(raw)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("you must provide a model parameter", param="model", code="missing_required_parameter")
        self.check(body)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise bad_request("'stream' must be a boolean.", param="stream", code="invalid_type")
        if "stream_options" in body and stream is not True and body["stream_options"] is not None:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        return body

    def check(self, body: dict[str, Any]) -> None:
        """The API's own required fields and types."""

    # -- what routing reads ---------------------------------------------------------------------------------------
    def prompt_parts(self, body: Mapping[str, Any]) -> tuple[list[str], int]:
        """The prompt as pieces in order (joined: the canonical text that is sized and hashed) and how many
        messages it had (each costs template tokens). The pieces are the body's own strings: nothing is copied."""
        return [], 0

    def requested_output(self, body: Mapping[str, Any]) -> int | None:
        """The output cap the client set, if any."""
        return None

    def fit_parts(self, body: Mapping[str, Any]) -> tuple[list[str], int] | None:
        """The largest part of the input an engine runs at once, where it runs it in parts (rerank and score: a
        query-document pair); None: the whole prompt must fit the context window."""
        return None

    def session(self, body: Mapping[str, Any]) -> str | None:
        """A session id the body carries (the `x-session-id` header comes first, read by the caller)."""
        return None

    def upstream_path(self, target: str) -> str:
        """The engine path of a request (target: the client's path and query string)."""
        return self.upstream

    # -- what a reply says (a shadow copy's output is compared on it) -------------------------------------------------
    def reply_text(self, doc: dict[str, Any]) -> str:
        """A whole reply's text: the first choice's (chat, completions)."""
        return choice_text(doc, "message")

    def event_text(self, doc: dict[str, Any]) -> str:
        """One stream event's text."""
        return choice_text(doc, "delta")


def dicts(items: Any) -> list[dict[str, Any]]:
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def texts(parts: Any, kind: str) -> str:
    """The text of the parts (content parts, content blocks) of one type."""
    return "".join(p["text"] for p in dicts(parts) if p.get("type") == kind and isinstance(p.get("text"), str))


def choice_text(doc: dict[str, Any], key: str) -> str:
    """The first choice's text: its message's (or delta's) content, or its `text` (completions)."""
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return ""
    for c in choices:
        if isinstance(c, dict) and c.get("index", 0) == 0:
            m = c.get(key)
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                return m["content"]
            return c["text"] if isinstance(c.get("text"), str) else ""
    return ""


def parse_json(raw: bytes) -> dict[str, Any]:
    """A JSON object body, parsed once; a 400 for anything else."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"The request body is not valid JSON: {e}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


def string_field(body: Mapping[str, Any], name: str) -> str | None:
    """A field that must be a string when present (None: absent or null); a 400 for another type."""
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string.", param=name, code="invalid_type")
    return v


def route_not_served(model: str, api: Api) -> GatewayError:
    return GatewayError(404, f"No backend of the model `{model}` serves {api.path}: their engines do not offer "
                        f"this API.", code="route_not_served")
