"""The prompt-size bounds a context fit uses, and what engines' context errors say of the prompt."""

from __future__ import annotations

import pytest

from gateway.contracts import RequestShape
from gateway.errors import normalize_engine_error
from gateway.routing.context import START_HIGH, START_LOW, PromptSizer, prompt_tokens_of


def shape(prompt: int, out: int | None = None, model: str = "m") -> RequestShape:
    return RequestShape(model, "chat", False, prompt, out or 256, "default", max_output=out)


def test_need_is_the_prompt_at_its_high_bound_plus_the_output_asked_for():
    s = PromptSizer()
    assert s.need(shape(1000)) == (round(1000 * START_HIGH), int(1000 * START_LOW))
    assert s.need(shape(1000, out=200)) == (round(1000 * START_HIGH) + 200, int(1000 * START_LOW))


def test_bounds_jump_towards_a_worse_ratio_and_drift_back_slowly():
    s = PromptSizer()
    s.observe("m", 100, 200)  # the engine counted twice the estimate
    low, high = s.bounds("m")
    assert high >= 2.0 and START_LOW < low < 0.6  # up at once; the low bound moves only a little
    for _ in range(200):
        s.observe("m", 100, 100)  # then estimates are right again
    low, high = s.bounds("m")
    assert 1.0 <= high < 1.2 and 0.9 < low <= 1.0
    assert s.bounds("other") == (START_LOW, START_HIGH)  # per model


def test_a_refusal_without_a_count_raises_the_high_bound_past_the_window():
    s = PromptSizer()
    err = normalize_engine_error(400, b'{"error":{"message":"too long, sorry","type":"invalid_request_error"}}')
    s.learn_refusal(shape(500, out=100), err, window=1024)
    assert s.need(shape(500, out=100))[0] > 1024


@pytest.mark.parametrize("body,tokens,exact", [
    (b'{"error":{"code":400,"message":"request (1300 tokens) exceeds the available context size (1024 tokens), '
     b'try increasing it","type":"exceed_context_size_error","n_prompt_tokens":1300,"n_ctx":1024}}', 1300, True),
    (b'{"error":{"message":"This model\'s maximum context length is 4096 tokens. However, your prompt contains '
     b'at least 4097 input tokens, which exceeds this limit","type":"BadRequestError","param":"input_tokens",'
     b'"code":400}}', 4097, False),
    (b'{"error":{"message":"This model\'s maximum context length is 4096 tokens. However, your request has 5000 '
     b'input tokens.","type":"BadRequestError","code":400}}', 5000, True),
    (b'{"object":"error","message":"The input (3000 tokens) is longer than the model\'s context length (2048 '
     b'tokens).","type":"BadRequestError","code":400}', 3000, True),
    (b'{"object":"error","message":"Requested token count exceeds the model\'s maximum context length of 2048 '
     b'tokens. You requested a total of 2100 tokens: 1900 tokens from the input messages and 200 tokens for the '
     b'completion.","code":400}', 1900, True),
    (b'{"error":{"message":"nothing countable"}}', None, False),
])
def test_what_an_engines_context_error_says_of_the_prompt(body, tokens, exact):
    err = normalize_engine_error(400, body)
    assert prompt_tokens_of(err) == (tokens, exact)
    if tokens is not None:
        assert err.code == "context_length_exceeded"
