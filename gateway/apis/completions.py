"""OpenAI's (legacy) Completions (/v1/completions): a prompt string or a list of them, the output cap."""

from __future__ import annotations

from typing import Any, Final, Mapping

from gateway.apis.api import Api
from gateway.apis.prompt import session_fields, single_cap, texts_of
from gateway.errors import bad_request


class Completions(Api):
    def check(self, body: dict[str, Any]) -> None:
        if "prompt" not in body:
            raise bad_request("Missing required parameter: 'prompt'.", param="prompt",
                              code="missing_required_parameter")

    def prompt_parts(self, body: Mapping[str, Any]) -> tuple[list[str], int]:
        return texts_of(body.get("prompt")), 0

    def requested_output(self, body: Mapping[str, Any]) -> int | None:
        return single_cap(body, ("max_completion_tokens", "max_tokens", "n_predict"))

    def session(self, body: Mapping[str, Any]) -> str | None:
        return session_fields(body)


COMPLETIONS: Final[Api] = Completions("completions", "/v1/completions", "/v1/completions", generating=True,
                                      everywhere=True, usage_on_request=True, shadow=True)
