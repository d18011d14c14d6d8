"""What an engine serves by name: its model list (GET /v1/models), a configured model it lacks, and the fix named."""

from __future__ import annotations

import re
from typing import Any, Final

import aiohttp
import orjson

from backends.openai_http import printable
from gateway.config_errors import near

# Reading a model list is best effort: any of these means "could not tell".
LOOKUP_ERRORS: Final = (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError)
# The flag that names what an engine serves (see /work/shared/ENGINES.md: vLLM and SGLang take
# --served-model-name, llama-server takes --alias); any other OpenAI server is told in words.
NAME_FLAGS: Final = {"vllm": "--served-model-name", "sglang": "--served-model-name", "llamacpp": "--alias"}
# Engines that serve whatever model they loaded under any name: a name they do not list still gets answers.
ANY_NAME: Final = frozenset({"llamacpp"})
LISTED_SHOWN = 10  # names of an engine's list quoted in one line
# The engines' words for a model they do not serve: vLLM's 404 "The model `X` does not exist.", SGLang's 400 of
# the same words (its strict model-name check), OpenAI's "does not exist or you do not have access to it", and
# the "not found" of others.
MISSING_WORDS: Final = re.compile(r"does not exist|not exist|not found|unknown model|no such model|not served", re.I)


def model_ids(body: bytes) -> tuple[str, ...]:
    """The model ids of an OpenAI-style list (`{"data": [{"id": ...}]}`)."""
    data = orjson.loads(body)["data"]
    return tuple(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))


async def read_model_list(adapter: Any, timeout: float) -> tuple[tuple[str, ...] | None, str]:
    """The ids the engine lists, or None and why not (its probe GET: the adapter's key, its own connections)."""
    try:
        status, body = await adapter._get("/v1/models", timeout)
    except LOOKUP_ERRORS as e:
        return None, type(e).__name__
    if status != 200:
        return None, f"HTTP {status}"
    try:
        return model_ids(body), ""
    except LOOKUP_ERRORS:
        return None, "not an OpenAI model list"


def excerpt(text: str, limit: int = 200) -> str:
    """Engine text fit for one log line: whitespace runs made one space, control characters replaced, capped."""
    return printable(" ".join(text.split()), limit)


def names(listed: tuple[str, ...] | None) -> str:
    """An engine's list fit for a log line (names it chose: made printable, the first few only)."""
    if listed is None:
        return "unknown"
    if not listed:
        return "nothing"
    shown = ", ".join(printable(m, 120) for m in listed[:LISTED_SHOWN])
    return shown if len(listed) <= LISTED_SHOWN else f"{shown}, ... ({len(listed)} in all)"


def fix(engine: str, public: str, native: str, listed: tuple[str, ...] | None = None) -> str:
    """How an operator makes the engine serve what the configuration says it does: when the engine lists a near
    match (another case, a typo), the mapping to it comes first, since it needs no restart of the engine."""
    flag = NAME_FLAGS.get(engine)
    start = f"start the engine with {flag} {native}" if flag else f"serve it under the name {native}"
    match = near(native, listed or ())
    if match is not None:
        return (f"the engine lists {printable(match, 120)!r}: did you mean it? Write models = "
                f"{{ \"{public}\" = \"{printable(match, 120)}\" }} in [[backends]] (no engine restart), or {start}")
    mapping = "map it" if public == native else f"map {public} to a name the engine lists"
    return f"{start}, or {mapping} in [[backends]] models"


def model_named(public: str, native: str) -> str:
    return f"'{native}'" if public == native else f"'{native}' (configured as {public})"


def not_listed(bid: str, engine: str, url: str, public: str, native: str, listed: tuple[str, ...]) -> str:
    """The log line for a configured model the engine's list does not name."""
    line = (f"backend {bid} ({engine} at {url}) does not list model {model_named(public, native)} "
            f"(it lists: {names(listed)}): {fix(engine, public, native, listed)}")
    if engine in ANY_NAME:
        line += "; until then its requests are served by the model it loaded, whatever they name"
    return line


def names_model(message: str, native: str) -> bool:
    """Whether an engine's error message names `native` as a whole name (quoted or not), not as part of a word."""
    return re.search(rf"(?<![\w./:-]){re.escape(native)}(?![\w./:-])", message) is not None


def refuses_model(status: int, code: str | None, message: str, native: str) -> bool:
    """An engine's refusal of the model name the gateway sent (404 model_not_found, or SGLang's 400 of the same
    words), naming that very name: not the client's fault, since the gateway chose it from its configuration."""
    if status not in (400, 404) or not names_model(message, native):
        return False
    return (status == 404 and code == "model_not_found") or MISSING_WORDS.search(message) is not None
