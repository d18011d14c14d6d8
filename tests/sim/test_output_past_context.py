"""An output cap past the context window, on every generating route and under each of its names: SGLang refuses it
with its own 400 and words (which the gateway reads as context_length_exceeded); vLLM 0.32 refuses a cap past its
whole window naming the field (and caps one past the room a prompt leaves at that room); llama-server caps the
output at the room left and answers 200, as the real engines were seen to (tests/e2e/OBSERVED.md)."""

from __future__ import annotations

import pytest

from gateway.errors import normalize_engine_error

CONTEXT = 256
BIG = 10_000  # far past the context
MSGS = [{"role": "user", "content": "hello there"}]
CASES = [
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": BIG}),
    ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": BIG}),
    ("/v1/completions", {"prompt": "hello there", "max_tokens": BIG}),
    ("/v1/responses", {"input": "hello there", "max_output_tokens": BIG}),
    ("/v1/messages", {"messages": MSGS, "max_tokens": BIG}),
]


@pytest.mark.parametrize("path,body", CASES, ids=[f"{p}:{next(k for k in b if k.startswith('max'))}"
                                                    for p, b in CASES])
@pytest.mark.parametrize("engine", ["sglang", "vllm", "llamacpp"])
async def test_an_output_cap_past_the_context(sim, http, engine, path, body):
    server = await sim(engine, max_model_len=CONTEXT)
    async with http.post(server.url + path, json={"model": server.model, **body}) as r:
        raw = await r.read()
        status = r.status
    if engine == "llamacpp":
        assert status == 200, raw  # capped at the room left
        return
    if engine == "vllm":
        named = {"/v1/messages": "max_completion_tokens", "/v1/responses": "max_output_tokens"}.get(
            path, next(k for k in body if k.startswith("max")))
        assert status == 400, raw
        assert f"{named}={BIG} cannot be greater than max_model_len={CONTEXT}" in raw.decode()
        return
    if path == "/v1/messages":
        assert status == 404  # the SGLang it imitates has no Messages API
        return
    assert status == 400, raw
    text = raw.decode()
    assert f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens" in text
    assert f"tokens from the input messages and {BIG} tokens for the completion" in text
    assert normalize_engine_error(status, raw).code == "context_length_exceeded"


async def test_a_cap_that_fits_is_served_everywhere(sim, http):
    for engine in ("sglang", "vllm", "llamacpp"):
        server = await sim(engine, max_model_len=CONTEXT)
        async with http.post(server.url + "/v1/responses",
                             json={"model": server.model, "input": "hi", "max_output_tokens": 8}) as r:
            assert r.status == 200, await r.text()


async def test_vllm_caps_a_cap_within_its_window_at_the_room_left(sim, http):
    server = await sim("vllm", max_model_len=CONTEXT)
    async with http.post(server.url + "/v1/chat/completions",
                         json={"model": server.model, "messages": MSGS, "max_tokens": CONTEXT}) as r:
        assert r.status == 200, await r.text()
