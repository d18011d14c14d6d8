"""Classification of request bodies: token estimates, expected output, session, class and prefix hashes."""

from __future__ import annotations

import pytest

from gateway.config import ShapeConfig
from gateway.contracts import DEFAULT, INTERACTIVE, LONG_OUTPUT, LONG_PROMPT
from gateway.apis.chat import CHAT
from gateway.apis.completions import COMPLETIONS
from gateway.apis.registry import BY_NAME
from gateway.routing.shape import classify, prefix_hashes, prompt_size, prompt_text, session_key, session_of

CFG = ShapeConfig()  # long_prompt 768 tokens (and 2x the output), long_output 512, default output 256


def chat(text: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


def shape_of(body: dict, route: str = "chat", headers: dict | None = None, **kw):
    api = BY_NAME[route]
    return classify(api=api, body=body, session=session_of(api, body, headers or {}), principal="p", cfg=CFG, **kw)


WORDS_1000 = "abc " * 1000  # ~1,000 tokens at four characters each


@pytest.mark.parametrize("case,body,headers,kw,klass,output", [
    ("short chat, defaults", chat("hi"), {}, {}, DEFAULT, 256),
    ("asked for a long output", chat("hi", max_tokens=1000), {}, {}, LONG_OUTPUT, 1000),
    ("max_completion_tokens wins over max_tokens", chat("hi", max_completion_tokens=600, max_tokens=10), {}, {},
     LONG_OUTPUT, 600),
    ("long prompt, short output", chat(WORDS_1000, max_tokens=100), {}, {}, LONG_PROMPT, 100),
    ("long prompt but longer output: decode dominates", chat(WORDS_1000, max_tokens=800), {}, {}, LONG_OUTPUT, 800),
    ("long prompt, output not far below it", chat(WORDS_1000, max_tokens=600), {}, {}, LONG_OUTPUT, 600),
    ("streaming session, nothing else in flight", chat("hi", stream=True, max_tokens=100),
     {"x-session-id": "s1"}, {}, INTERACTIVE, 100),
    ("streaming session with a long prompt is still interactive", chat(WORDS_1000, stream=True, max_tokens=100),
     {"x-session-id": "s1"}, {}, INTERACTIVE, 100),
    ("session already has a request in flight", chat("hi", stream=True, max_tokens=100),
     {"x-session-id": "s1"}, {"session_in_flight": 1}, DEFAULT, 100),
    ("not streaming: not interactive", chat("hi", max_tokens=100), {"x-session-id": "s1"}, {}, DEFAULT, 100),
    ("session asking for a long output", chat("hi", stream=True, max_tokens=2000), {"x-session-id": "s"}, {},
     LONG_OUTPUT, 2000),
    ("prompt_cache_key is a session", chat("hi", stream=True, prompt_cache_key="k", max_tokens=50), {}, {},
     INTERACTIVE, 50),
    ("learned expectation when nothing is asked", chat("hi"), {}, {"learned_output": 700.4}, LONG_OUTPUT, 700),
    ("ignores a bool max_tokens", chat("hi", max_tokens=True), {}, {}, DEFAULT, 256),
    ("embeddings have no output", {"model": "m", "input": WORDS_1000}, {}, {"route": "embeddings"}, DEFAULT, 0),
])
def test_classify(case, body, headers, kw, klass, output):
    route = kw.pop("route", "chat")
    s = shape_of(body, route, headers, **kw)
    assert (s.klass, s.output_tokens) == (klass, output), case


@pytest.mark.parametrize("body,expected", [
    (chat("a" * 400), (len("<user>") + 400) // 4 + 4 + 1),  # chars / 4 + one message's template overhead + 1
    ({"model": "m", "messages": [{"role": "system", "content": "a" * 40},
                                 {"role": "user", "content": [{"type": "text", "text": "b" * 40},
                                                              {"type": "image_url", "image_url": {"url": "x"}}]}]},
     (len("<system>") + 40 + len("<user>") + 40) // 4 + 8 + 1),
])
def test_prompt_token_estimate(body, expected):
    assert shape_of(body).prompt_tokens == expected


@pytest.mark.parametrize("body", [
    chat("hello"),
    {"model": "m", "messages": [{"role": "system", "content": "s" * 33}, "not a message",
                                {"role": None, "content": None}, {"content": [{"text": "x"}, {"text": 5}, "y"]},
                                {"role": 7, "content": "z"}], "tools": [{"type": "function", "name": "f"}]},
    {"model": "m", "messages": []},
])
def test_prompt_size_matches_prompt_text(body):
    """Without prefix hashing the prompt is only measured; the estimate must not change with that."""
    text, n = prompt_text(CHAT, body)
    assert prompt_size(CHAT, body) == (len(text), n)
    assert shape_of(body, want_prefix=False).prompt_tokens == shape_of(body, want_prefix=True).prompt_tokens


def test_completions_prompt_and_list_prompt():
    assert prompt_text(COMPLETIONS, {"prompt": "hello"}) == ("hello", 0)
    assert prompt_text(COMPLETIONS, {"prompt": ["ab", "cd", 3]}) == ("abcd", 0)


@pytest.mark.parametrize("body,headers,expected", [
    ({"user": "u", "prompt_cache_key": "k"}, {"x-session-id": "h"}, "h"),
    ({"user": "u", "prompt_cache_key": "k"}, {}, "k"),
    ({"user": "u"}, {}, "u"),
    ({"user": ""}, {}, None),
    ({}, {}, None),
])
def test_session_precedence(body, headers, expected):
    assert session_of(CHAT, body, headers) == expected


def test_requested_output_ignores_non_positive():
    assert CHAT.requested_output({"max_tokens": 0, "n_predict": 5}) == 5
    assert CHAT.requested_output({"max_tokens": -1}) is None


# -- prefix hashes -------------------------------------------------------------------------------------------
def test_prefix_hashes_are_chained_block_hashes():
    a = prefix_hashes("m", "", "x" * 256 + "y" * 256 + "z" * 100, 256, 64)
    b = prefix_hashes("m", "", "x" * 256 + "y" * 256 + "w" * 300, 256, 64)
    c = prefix_hashes("m", "", "x" * 256 + "q" * 256, 256, 64)
    assert len(a) == 2 and len(b) == 3  # only whole blocks
    assert a == b[:2]  # shared prefix, shared hashes
    assert c[0] == a[0] and c[1] != a[1]
    assert all(0 <= h < 2 ** 63 for h in b)


@pytest.mark.parametrize("other", [("m2", ""), ("m", "tenant-b")])
def test_prefix_hashes_differ_per_model_and_salt(other):
    text = "x" * 1024
    assert set(prefix_hashes("m", "", text, 256, 64)).isdisjoint(prefix_hashes(*other, text, 256, 64))


def test_prefix_hashes_are_stable_across_processes_and_split_by_characters():
    # Fixed values: replicas on other hosts must compute the same keys (no salted hash()).
    assert prefix_hashes("m", "", "a" * 32, 16, 8) == prefix_hashes("m", "", "a" * 32, 16, 8)
    assert prefix_hashes("m", "", "a" * 16, 16, 8) == (2720984430103627390,)
    ascii_ = prefix_hashes("m", "", "é" * 32, 16, 8)
    assert len(ascii_) == 2  # 32 characters = two 16-character blocks, though 64 bytes
    assert len(prefix_hashes("m", "", "a" * 10_000, 16, 8)) == 8  # capped at max_blocks


def test_chat_hashes_cover_roles_and_skip_embeddings():
    s1 = shape_of(chat("x" * 2000))
    s2 = shape_of({"model": "m", "messages": [{"role": "system", "content": "x" * 2000}]})
    assert s1.prefix_hashes and s1.prefix_hashes[0] != s2.prefix_hashes[0]  # the role is part of the text
    assert shape_of({"model": "m", "input": "x" * 2000}, "embeddings").prefix_hashes == ()
    assert shape_of(chat("x" * 2000), want_prefix=False).prefix_hashes == ()


def test_session_key_is_per_model_and_not_a_prefix_hash():
    assert session_key("m", "s") != session_key("m2", "s")
    assert session_key("m", "s") == session_key("m", "s")
    assert 0 <= session_key("m", "s") < 2 ** 63
