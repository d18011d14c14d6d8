"""Typed gateway errors and engine error bodies, turned into OpenAI-shaped JSON in one place."""

from __future__ import annotations

import math
import re
from typing import Any, Final, Mapping

import orjson

_TYPE_BY_STATUS: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class GatewayError(Exception):
    """An error the client sees: status, OpenAI error fields and optional headers."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None,
                 extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def payload(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}

    def body(self) -> bytes:
        return orjson.dumps(self.payload())

    def reply_headers(self, request_id: str) -> dict[str, str]:
        """The headers of this error's JSON reply (its own, such as Retry-After, included)."""
        return {"Content-Type": "application/json", "x-request-id": request_id, **self.headers}

    def sse_event(self) -> bytes:
        return b"data: " + self.body() + b"\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_request") -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def unauthorized(message: str = "Invalid or missing API key.") -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key")


def forbidden(message: str = "This route needs an admin API key.") -> GatewayError:
    return GatewayError(403, message, code="admin_key_required")


def model_not_found(model: str) -> GatewayError:
    return GatewayError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


# The openai client gives up on retrying altogether when Retry-After is longer than this.
MAX_RETRY_AFTER_S: Final = 120.0


def retry_after_header(seconds: float) -> str:
    """Whole seconds, at least 1 and at most 120, so that every OpenAI client honours it."""
    return str(int(min(max(math.ceil(seconds), 1), MAX_RETRY_AFTER_S)))


def no_backend(model: str, retry_after: float = 1.0) -> GatewayError:
    return GatewayError(503, f"No backend can take a request for `{model}` right now; retry shortly.",
                        code="no_backend_available", headers={"Retry-After": retry_after_header(retry_after)})


def overloaded(model: str, status: int, retry_after: int) -> GatewayError:
    """Every candidate is saturated: refused at once instead of queued without bound."""
    return GatewayError(status, f"Every backend for `{model}` is saturated; retry after {retry_after} s.",
                        code="server_is_overloaded" if status == 503 else "rate_limit_exceeded",
                        headers={"Retry-After": str(retry_after)})


def rate_limited(message: str, kind: str, retry_after: float | None, headers: Mapping[str, str]) -> GatewayError:
    """A key's rate limit (kind: "requests" or "tokens", as OpenAI's `type`). Without retry_after the request can
    never pass as it is: OpenAI's SDKs are told not to retry it."""
    h = dict(headers)
    if retry_after is None:
        h["x-should-retry"] = "false"
    else:
        h["Retry-After"] = retry_after_header(retry_after)
    return GatewayError(429, message, type=kind, code="rate_limit_exceeded", headers=h)


def shutting_down() -> GatewayError:
    return GatewayError(503, "The gateway is shutting down; retry the request.", code="shutting_down",
                        headers={"Retry-After": "1"})


def upstream_failed(detail: str) -> GatewayError:
    return GatewayError(502, f"The upstream engine failed: {detail}.", code="upstream_error")


def upstream_timeout(detail: str) -> GatewayError:
    return GatewayError(504, f"The upstream engine timed out: {detail}.", code="upstream_timeout")


class ContextRefusal:
    """How one engine words its refusal of a prompt too long for the context window."""

    __slots__ = ("engine", "marker", "size", "exact")

    def __init__(self, engine: str, marker: str, size: str | None = None, exact: bool = True) -> None:
        self.engine = engine
        self.marker = marker  # a phrase of that refusal's message or type, and of no other error
        self.size = re.compile(size) if size is not None else None  # group 1: the prompt's size in tokens
        self.exact = exact  # whether that size is exact (vLLM 0.32 stops counting past the limit: a lower bound)


# The one list of the engines' wordings: normalize_engine_error knows a context error by its marker,
# gateway.routing.context reads the prompt's size from it, and the support probe (gateway.fleet.probe_checks)
# tells a refusal as too long from any other by it (TOO_LONG_HINT). First match wins for the size.
CONTEXT_REFUSALS: Final = (
    ContextRefusal("vLLM before 0.32", "maximum context length", r"has (\d+) input tokens"),
    ContextRefusal("vLLM 0.32", "maximum context length", r"contains at least (\d+) input", exact=False),
    ContextRefusal("vLLM, Responses API", "exceeds the max_model_len", r"prompt length (\d+) exceeds"),
    ContextRefusal("SGLang", "longer than the model's context length", r"The input \((\d+) tokens\)"),
    ContextRefusal("SGLang, prompt and output", "maximum context length", r"(\d+) tokens from the input"),
    ContextRefusal("OpenAI", "maximum context length", r"resulted in (\d+) tokens"),
    ContextRefusal("llama.cpp", "exceeds the available context size"),  # its size: the n_prompt_tokens field
    ContextRefusal("llama.cpp, the error's type", "exceed_context_size"),
)
_CONTEXT_MARKERS: Final = tuple(dict.fromkeys(r.marker for r in CONTEXT_REFUSALS))
# Looser, for the support probe: it judges any OpenAI-compatible server, from the first 120 characters of its
# refusal, so besides every marker above it takes the words other engines use (and it ignores case).
TOO_LONG_HINT: Final = re.compile("|".join([*map(re.escape, _CONTEXT_MARKERS), "context", "too long",
                                            "too many tokens", "max_model_len", "maximum.{0,24}length"]), re.I)


def _string_code(status: int, err: Mapping[str, Any]) -> str | None:
    text = f"{err.get('message', '')} {err.get('type', '')}"
    if status == 400 and (err.get("param") == "input_tokens" or any(m in text for m in _CONTEXT_MARKERS)):
        return "context_length_exceeded"
    code = err.get("code")
    if isinstance(code, str) and code:
        return code
    if status == 404:
        return "model_not_found" if "model" in text.lower() else "not_found"
    return {429: "rate_limit_exceeded", 503: "server_is_overloaded"}.get(status)


def normalize_engine_error(status: int, raw: bytes) -> GatewayError:
    """Re-shape any engine's error body (nested vLLM/llama.cpp, flat SGLang, or text) into the OpenAI shape."""
    try:
        data = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        data = None
    err: dict[str, Any]
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        err = data["error"]
    elif isinstance(data, dict) and ("message" in data or "detail" in data):
        err = data
    else:
        err = {"message": f"upstream returned HTTP {status}"}
    message = err.get("message") or err.get("detail") or f"upstream returned HTTP {status}"
    if not isinstance(message, str):
        message = orjson.dumps(message).decode()
    param = err.get("param") if isinstance(err.get("param"), str) else None
    extra: dict[str, Any] = {k: err[k] for k in ("n_prompt_tokens", "n_ctx") if k in err}
    code = _string_code(status, err)
    if code == "context_length_exceeded" and param in (None, "input_tokens"):
        param = "messages"
    return GatewayError(status, message, param=param, code=code, extra=extra)


def error_from_event(payload: Mapping[str, Any]) -> GatewayError:
    """An in-band SSE error event from any engine, as an OpenAI error (status from its code when known)."""
    err = payload.get("error")
    err = err if isinstance(err, dict) else payload
    code = err.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return normalize_engine_error(status, orjson.dumps({"error": err}))


def raised_at(e: BaseException) -> str:
    """Where an exception was raised (file:line), for a log line that quotes nothing of a request."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"
