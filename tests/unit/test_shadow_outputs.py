"""Which requests a shadow copy is made of, and the text each API's reply holds for comparing outputs."""

from __future__ import annotations

import orjson
import pytest

from gateway.apis.registry import BY_NAME
from gateway.experiments.outputs import output_of
from gateway.experiments.shadow import copyable


@pytest.mark.parametrize("route, body, copied", [
    ("chat", {}, True), ("completions", {}, True), ("embeddings", {}, True), ("messages", {}, True),
    ("responses", {"input": "x"}, True), ("responses", {"previous_response_id": None}, True),
    ("responses", {"previous_response_id": "resp_1"}, False), ("responses", {"conversation": "conv_1"}, False),
    ("responses", {"background": True}, False), ("rerank", {}, False), ("count_tokens", {}, False),
    ("transcriptions", {}, False), ("response", {}, False),
])
def test_a_copy_is_made_only_where_the_candidate_can_answer_alike(route, body, copied):
    assert copyable(BY_NAME[route], body) is copied


def _events(*objs: dict, typed: bool) -> bytes:
    out = b""
    for o in objs:
        out += (b"event: " + o["type"].encode() + b"\n" if typed else b"") + b"data: " + orjson.dumps(o) + b"\n\n"
    return out + (b"" if typed else b"data: [DONE]\n\n")


@pytest.mark.parametrize("route, whole, stream", [
    ("chat", {"choices": [{"index": 0, "message": {"content": "hi there"}}]},
     _events({"type": "x", "choices": [{"index": 0, "delta": {"content": "hi"}}]},
             {"type": "x", "choices": [{"index": 0, "delta": {"content": " there"}}]}, typed=False)),
    ("responses", {"output": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
                              {"type": "message", "content": [{"type": "output_text", "text": "hi"},
                                                              {"type": "output_text", "text": " there"}]}]},
     _events({"type": "response.created", "response": {}}, {"type": "response.reasoning_text.delta", "delta": "hmm"},
             {"type": "response.output_text.delta", "delta": "hi"},
             {"type": "response.output_text.delta", "delta": " there"}, {"type": "response.completed"}, typed=True)),
    ("messages", {"content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "hi"},
                              {"type": "tool_use", "input": {}}, {"type": "text", "text": " there"}]},
     _events({"type": "message_start", "message": {}},
             {"type": "content_block_delta", "delta": {"type": "thinking_delta", "thinking": "hmm"}},
             {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}},
             {"type": "content_block_delta", "delta": {"type": "text_delta", "text": " there"}},
             {"type": "message_stop"}, typed=True)),
])
def test_the_text_of_a_reply_in_each_apis_form(route, whole, stream):
    assert output_of(orjson.dumps(whole), False, BY_NAME[route]) == ("hi there", None)
    assert output_of(stream, True, BY_NAME[route]) == ("hi there", ["hi", " there"])


@pytest.mark.parametrize("data", [b"", b"[1, 2]", b'"x"', b"{not json", b'{"output": "x", "content": 3}'])
def test_a_reply_of_another_form_has_no_text(data):
    for route in ("chat", "responses", "messages"):
        assert output_of(data, False, BY_NAME[route]) == ("", None)
        assert output_of(b"data: " + data + b"\n\n", True, BY_NAME[route]) == ("", [])
