"""OpenAI's Chat Completions (/v1/chat/completions): messages, tools, the output cap, its SSE chunks."""

from __future__ import annotations

from typing import Any, Final, Mapping

from gateway.apis.api import Api
from gateway.apis.prompt import add_tools, content_text, json_text, session_fields, single_cap
from gateway.errors import bad_request


class Chat(Api):
    def check(self, body: dict[str, Any]) -> None:
        if "messages" not in body:
            raise bad_request("Missing required parameter: 'messages'.", param="messages",
                              code="missing_required_parameter")
        if not isinstance(body["messages"], list) or not body["messages"]:
            raise bad_request("'messages' must be a non-empty array.", param="messages", code="invalid_type")

    def prompt_parts(self, body: Mapping[str, Any]) -> tuple[list[str], int]:
        """Tool definitions (templates render them into the system prefix), then each message's role and text."""
        parts: list[str] = []
        n = add_tools(body.get("tools"), parts)
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                role = m.get("role", "")
                parts += ("<", role if isinstance(role, str) else json_text(role, "messages"), ">",
                          content_text(m.get("content")))
                n += 1
        return parts, n

    def requested_output(self, body: Mapping[str, Any]) -> int | None:
        return single_cap(body, ("max_completion_tokens", "max_tokens", "n_predict"))

    def session(self, body: Mapping[str, Any]) -> str | None:
        return session_fields(body)


CHAT: Final[Api] = Chat("chat", "/v1/chat/completions", "/v1/chat/completions", generating=True, everywhere=True,
                        usage_on_request=True, shadow=True)
