"""What the gateway reads from a whole reply without parsing it: its token counts, and its model name (a byte
scan, checked against the regular expression it stands for on chosen replies and on generated ones)."""

from __future__ import annotations

import re

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.relay import model_value, usage_of

# What the model scan must find, said as a regular expression (slower: a search costs instructions per byte).
MODEL = re.compile(rb'"model":\s*("(?:[^"\\]|\\.)*")', re.DOTALL)


def model_by_regex(data: bytes) -> bytes | None:
    m = MODEL.search(data)
    return m.group(1) if m else None


def test_usage_of_a_real_reply():
    reply = orjson.dumps({"id": "x", "model": "m", "choices": [{"message": {"content": '"usage": "prompt_tokens": 9'}}],
                          "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19,
                                    "prompt_tokens_details": {"cached_tokens": 4}}})
    assert usage_of(reply) == {"prompt_tokens": 12, "completion_tokens": 7,
                               "prompt_tokens_details": {"cached_tokens": 4}}


def test_usage_of_spacing_nulls_and_absence():
    assert usage_of(b'{"usage" : { "prompt_tokens" :\n 3 , "completion_tokens":5}}') == {
        "prompt_tokens": 3, "completion_tokens": 5}
    assert usage_of(b'{"usage": {"prompt_tokens": null, "completion_tokens": 2}}') == {"completion_tokens": 2}
    assert usage_of(b'{"usage": null}') is None
    assert usage_of(b'{"choices": []}') is None
    assert usage_of(b'{"usage": {"prompt_tokens": 1, "prompt_tokens": 8}}') == {"prompt_tokens": 8}


def test_model_value_finds_the_first_string():
    assert model_value(b'{"id":1,"model":"llama-3","x":{"model":"other"}}') == b'"llama-3"'
    assert model_value(b'{"model": null, "m": {"model":  "b\\"c"}}') == b'"b\\"c"'
    assert model_value(b'{"model":"a\\\\","z":1}') == b'"a\\\\"'
    assert model_value(b'{"model":"unclosed') is None
    assert model_value(b'{"models":["a"]}') is None


# Replies made of the pieces the scan looks for, in any order: keys, quotes, escapes, spaces, digits.
PIECES = [b'"model":', b'"usage"', b'"prompt_tokens"', b'"completion_tokens"', b'"cached_tokens"', b'"', b"\\",
          b":", b" ", b"\n", b"\t", b"7", b"42", b"null", b"{", b"}", b",", b"a", b"\xc3\xa9"]
replies = st.lists(st.sampled_from(PIECES), max_size=40).map(b"".join)


@settings(max_examples=3000, deadline=None)
@given(replies)
def test_model_value_agrees_with_the_regex(data):
    assert model_value(data) == model_by_regex(data)
