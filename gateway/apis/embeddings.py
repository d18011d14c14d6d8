"""OpenAI's Embeddings (/v1/embeddings): an input string or a list of them; no output, no stream."""

from __future__ import annotations

from typing import Any, Final, Mapping

from gateway.apis.api import Api
from gateway.apis.prompt import session_fields, texts_of
from gateway.errors import bad_request


class Embeddings(Api):
    def check(self, body: dict[str, Any]) -> None:
        if "input" not in body:
            raise bad_request("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")

    def prompt_parts(self, body: Mapping[str, Any]) -> tuple[list[str], int]:
        return texts_of(body.get("input")), 0

    def session(self, body: Mapping[str, Any]) -> str | None:
        return session_fields(body)


# Its attempts teach a backend's latency model too (prefill speed), as they always have. Served only by an engine
# with an embedding model (or launched to embed): one that answers the path 404, or 501, is learned at run time.
EMBEDDINGS: Final[Api] = Embeddings("embeddings", "/v1/embeddings", "/v1/embeddings", learns=True, shadow=True)
