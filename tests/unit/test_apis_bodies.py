"""The further APIs' bodies as clients send them, hostile ones included: each refusal is a 400 (or the id's 404)
in words that name the field, and nothing of a client's text that is not of a safe form is echoed."""

from __future__ import annotations

import pytest

from gateway.apis import audio, conversations, messages, responses
from gateway.apis.registry import ALL, BY_NAME, ENGINE_APIS, api_of
from gateway.errors import GatewayError
from gateway.routing.relay import usage_of
from gateway.routing.shape import prompt_text, session_of
from gateway.routing.typed_relay import first_event_error

HOSTILE = [
    ("responses", b'{"model":"m"}', 400, "input"),
    ("responses", b'{"model":"m","input":5}', 400, "input"),
    ("responses", b'{"model":"m","input":"x","previous_response_id":"../x"}', 404, "previous_response_id"),
    ("responses", b'{"model":"m","input":"x","previous_response_id":7}', 404, "previous_response_id"),
    ("responses", b'{"model":"m","input":"x","instructions":[1]}', 400, "instructions"),
    ("responses", b'{"model":"m","input":"x","stream":"yes"}', 400, "stream"),
    ("messages", b'{"model":"m","messages":[{"role":"user","content":"x"}]}', 400, "max_tokens"),
    ("messages", b'{"model":"m","max_tokens":true,"messages":[{"role":"user","content":"x"}]}', 400, "max_tokens"),
    ("messages", b'{"model":"m","max_tokens":5,"messages":{}}', 400, "messages"),
    ("messages", b'{"model":"m","max_tokens":5,"messages":[{}],"system":5}', 400, "system"),
    ("count_tokens", b'{"model":"m"}', 400, "messages"),
    ("rerank", b'{"model":"m","query":"q","documents":"d"}', 400, "documents"),
    ("score", b'{"model":"m","text_1":"a"}', 400, "text_1"),
    ("messages", b'[1,2]', 400, None),
    ("responses", b'{"input":"x"}', 400, "model"),
    ("responses", b'{"model":"m","input":"x","previous_response_id":"resp_1","conversation":"conv_1"}', 400,
     "conversation"),
    ("responses", b'{"model":"m","input":"x","conversation":{"id":"../x"}}', 400, "conversation"),
    ("responses", b'{"model":"m","input":"x","conversation":5}', 400, "conversation"),
]


@pytest.mark.parametrize("route,raw,status,param", HOSTILE)
def test_hostile_bodies_are_refused_naming_the_field(route, raw, status, param):
    with pytest.raises(GatewayError) as e:
        BY_NAME[route].parse(raw, {})
    assert e.value.status == status and e.value.param == param
    assert "../x" not in e.value.message


def test_deeply_nested_tool_input_is_a_400():
    deep: dict = {}
    for _ in range(300):
        deep = {"a": deep}
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": deep}]}]}
    with pytest.raises(GatewayError) as e:
        prompt_text(messages.MESSAGES, body)
    assert e.value.status == 400 and e.value.param == "messages"
    with pytest.raises(GatewayError):
        prompt_text(responses.CREATE, {"model": "m", "input": "x", "tools": [deep]})


def test_routes_of_paths_and_ids():
    name = {p: (a.name if (a := api_of(p)) is not None else None) for p in (
        "/v1/responses", "/v1/responses/resp_ab-12", "/v1/responses/resp_ab/cancel", "/v1/responses/resp_ab/input_items",
        "/v1/responses/input_tokens", "/v2/rerank", "/rerank", "/v1/conversations", "/v1/conversations/conv_1",
        "/v1/conversations/conv_1/items", "/v1/conversations/conv_1/items/msg_2")}
    assert name == {"/v1/responses": "responses", "/v1/responses/resp_ab-12": "response",
                    "/v1/responses/resp_ab/cancel": "response_cancel",
                    "/v1/responses/resp_ab/input_items": "response_input_items",
                    "/v1/responses/input_tokens": "responses_input_tokens", "/v2/rerank": "rerank", "/rerank": "rerank",
                    "/v1/conversations": "conversations", "/v1/conversations/conv_1": "conversation",
                    "/v1/conversations/conv_1/items": "conversation_items",
                    "/v1/conversations/conv_1/items/msg_2": "conversation_item"}
    for bad in ("/v1/responses/a b", "/v1/responses/", "/v1/responses/x/y", "/v1/responses/" + "a" * 129,
                "/v1/responses/%2e%2e", "/v1/responses/x/cancel/more", "/v1/conversations/", "/v1/conversations/a/b",
                "/v1/conversations/c/items/i/more"):
        assert api_of(bad) is None, bad
    assert responses.RETRIEVE.allows("DELETE") and not responses.RETRIEVE.allows("POST")
    assert responses.CANCEL.response_id("/v1/responses/resp_1/cancel") == "resp_1"  # type: ignore[attr-defined]


def test_every_route_has_one_name_and_the_engine_routes_an_engine_path():
    assert len({a.name for a in ALL}) == len(ALL)
    assert {a.name for a in ALL if a.local} == {"response_input_items", "conversations", "conversation",
                                                "conversation_items", "conversation_item"}
    assert all(BY_NAME[n].upstream.startswith("/") for n in ENGINE_APIS)
    assert conversations.ITEM.allows("DELETE") and not conversations.CREATE.allows("GET")


def test_prompt_output_and_session_of_each_api():
    body = {"model": "m", "instructions": "be brief", "max_output_tokens": 40, "previous_response_id": "resp_1",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
                      {"type": "function_call_output", "call_id": "c", "output": "42"}]}
    text, n = prompt_text(responses.CREATE, body)
    assert "be brief" in text and "hello" in text and "42" in text and n == 2
    assert responses.CREATE.requested_output(body) == 40
    assert session_of(responses.CREATE, body, {}) == "resp_1"
    msg = {"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "sys"}], "metadata": {"user_id": "u"},
           "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                      {"type": "tool_result", "content": "res"}]}]}
    text, n = prompt_text(messages.MESSAGES, msg)
    assert "sys" in text and "hi" in text and "res" in text and n == 2
    assert messages.MESSAGES.requested_output(msg) == 9 and session_of(messages.MESSAGES, msg, {}) == "u"
    assert session_of(messages.MESSAGES, msg, {"x-session-id": "h"}) == "h"


def test_usage_in_each_apis_names():
    assert usage_of(b'{"usage":{"input_tokens":7,"input_tokens_details":{"cached_tokens":3},"output_tokens":5}}') \
        == {"prompt_tokens": 7, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}}
    assert usage_of(b'{"usage":{"input_tokens":9,"cache_read_input_tokens":2,"output_tokens":4}}') == \
        {"prompt_tokens": 9, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}


FORM = (b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        b'Content-Type: audio/wav\r\n\r\nRIFF\x00\x01name="model"\r\n--XyZ--\r\n')


def test_forms_read_only_their_small_fields():
    fields = audio.check('multipart/form-data; boundary=XyZ', FORM)
    assert {k: v for k, v in fields.items() if k != audio.FORM_KEY} == {"model": "whisper"}
    assert fields[audio.FORM_KEY].encode("native").count(b"native") == 1
    for ctype, raw in (("application/json", FORM), ("multipart/form-data", FORM),
                       ("multipart/form-data; boundary=XyZ", FORM.replace(b"whisper", b"")),
                       ("multipart/form-data; boundary=XyZ", FORM.split(b"--XyZ\r\nContent-Disposition: form-data; "
                                                                        b'name="file"')[0] + b"--XyZ--\r\n"),
                       ("multipart/form-data; boundary=Other", FORM)):
        with pytest.raises(GatewayError) as e:
            audio.check(ctype, raw)
        assert e.value.status == 400
    huge = FORM.replace(b"whisper", b"w" * (audio.FIELD_LIMIT + 1))
    with pytest.raises(GatewayError):
        audio.check("multipart/form-data; boundary=XyZ", huge)  # a model field past the limit is refused


def test_a_typed_stream_that_opens_with_an_error():
    e = first_event_error(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
                          b'"message":"busy"}}\n\n')
    assert e is not None and e.message == "busy"
    e = first_event_error(b"event: error\ndata: {not json\n\n")
    assert e is not None and e.status == 502
    assert first_event_error(b'event: response.created\ndata: {"type":"response.created"}\n\n') is None
