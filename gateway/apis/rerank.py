"""Rerank (/v1/rerank, /rerank, /v2/rerank) and score (/v1/score): body checks and the text that is sized."""

from __future__ import annotations

from typing import Any, Final, Mapping

from gateway.apis.api import Api
from gateway.errors import bad_request


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        out = []
        for v in value:
            if isinstance(v, str):
                out.append(v)
            elif isinstance(v, dict) and isinstance(v.get("text"), str):
                out.append(v["text"])
        return out
    return []


def check(route: str, body: Mapping[str, Any]) -> None:
    if route == "rerank":
        if not isinstance(body.get("query"), str):
            raise bad_request("Missing required parameter: 'query' (a string).", param="query",
                              code="missing_required_parameter")
        if not isinstance(body.get("documents"), list):
            raise bad_request("Missing required parameter: 'documents' (an array).", param="documents",
                              code="missing_required_parameter")
        return
    pairs = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
    if not any(a in body and b in body for a, b in pairs):
        raise bad_request("Missing required parameters: 'text_1' and 'text_2'.", param="text_1",
                          code="missing_required_parameter")


def prompt_parts(body: Mapping[str, Any]) -> tuple[list[str], int]:
    """Every text the engine reads: the query (or first texts) and the documents."""
    parts: list[str] = []
    for name in ("query", "text_1", "queries", "data_1", "documents", "text_2", "items", "data_2"):
        parts += _texts(body.get(name))
    return parts, 0


_FIRST: Final = ("query", "text_1", "queries", "data_1")
_SECOND: Final = ("documents", "text_2", "items", "data_2")


def largest_pair(body: Mapping[str, Any]) -> tuple[list[str], int]:
    """The longest first text and the longest second text: the largest pair an engine scores at once (each
    query-document pair is one sequence of the model)."""
    firsts = [t for name in _FIRST for t in _texts(body.get(name))]
    seconds = [t for name in _SECOND for t in _texts(body.get(name))]
    return [max(firsts, key=len, default=""), max(seconds, key=len, default="")], 0


class Rerank(Api):
    def check(self, body: dict[str, Any]) -> None:
        check(self.name, body)

    def prompt_parts(self, body: Mapping[str, Any]) -> tuple[list[str], int]:
        return prompt_parts(body)

    def fit_parts(self, body: Mapping[str, Any]) -> tuple[list[str], int] | None:
        return largest_pair(body)


# Rerank has three names among the engines: each goes to /v1/rerank, which all of them serve.
RERANK: Final[Api] = Rerank("rerank", "/v1/rerank", "/v1/rerank", aliases=("/rerank", "/v2/rerank"))
SCORE: Final[Api] = Rerank("score", "/v1/score", "/v1/score")
