"""Anthropic Messages API with the official anthropic SDK: vLLM and llama-server serve it, SGLang does not."""

import jsonschema
import pytest

from tests.sim.support import read_events

anthropic = pytest.importorskip("anthropic")

ENGINES = ["vllm", "llamacpp"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "days": {"type": "integer", "minimum": 1}},
          "required": ["city", "days"]}
TOOLS = [{"name": "other", "description": "x", "input_schema": {"type": "object"}},
         {"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}]


@pytest.mark.parametrize("engine", ENGINES)
async def test_create_with_system_blocks_and_count_tokens(sim, sdk, engine):
    server = await sim(engine)
    client = sdk("anthropic", server)
    kwargs = dict(model="sim-model", system=[{"type": "text", "text": "You are terse."}],
                  messages=[{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
                            {"role": "user", "content": "Tell me more."}])
    msg = await client.messages.create(max_tokens=200, **kwargs)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "sim-model"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    (block,) = msg.content
    assert block.type == "text" and block.text
    assert msg.usage.output_tokens == len(block.text.split())
    count = await client.messages.count_tokens(**kwargs)
    assert count.input_tokens == msg.usage.input_tokens
    short = await client.messages.create(max_tokens=2, **kwargs)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


@pytest.mark.parametrize("engine", ENGINES)
async def test_stream_with_the_sdk_helper(sim, sdk, engine):
    server = await sim(engine)
    client = sdk("anthropic", server)
    texts = []
    async with client.messages.stream(model="sim-model", max_tokens=50,
                                      messages=[{"role": "user", "content": "Stream please"}]) as stream:
        async for text in stream.text_stream:
            texts.append(text)
        final = await stream.get_final_message()
    assert final.content[0].text == "".join(texts) and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(texts) and final.usage.input_tokens > 0
    plain = await client.messages.create(model="sim-model", max_tokens=50,
                                         messages=[{"role": "user", "content": "Stream please"}])
    assert plain.content[0].text == final.content[0].text


@pytest.mark.parametrize("engine", ENGINES)
async def test_stream_wire_events(sim, http, engine):
    server = await sim(engine)
    body = {"model": "sim-model", "max_tokens": 5, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(server.url + "/v1/messages", json=body,
                         headers={"anthropic-version": "2023-06-01"}) as resp:
        assert resp.status == 200
        events = await read_events(resp)
    names = [name for name, _ in events]
    assert names == (["message_start", "content_block_start"] + ["content_block_delta"] * 5
                     + ["content_block_stop", "message_delta", "message_stop"])
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["usage"]["output_tokens"] == 0 and start["content"] == []
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 5


@pytest.mark.parametrize("engine", ENGINES)
async def test_forced_tool_use(sim, sdk, engine):
    server = await sim(engine)
    client = sdk("anthropic", server)
    msg = await client.messages.create(model="sim-model", max_tokens=100, tools=TOOLS,
                                       tool_choice={"type": "any"},
                                       messages=[{"role": "user", "content": "Weather?"}])
    (block,) = msg.content
    assert block.type == "tool_use" and block.name == "other" and msg.stop_reason == "tool_use"
    named = await client.messages.create(model="sim-model", max_tokens=100, tools=TOOLS,
                                         tool_choice={"type": "tool", "name": "get_weather"},
                                         messages=[{"role": "user", "content": "Weather?"}])
    block = named.content[0]
    if engine == "vllm":
        # a named choice keeps finish_reason "stop" in vLLM's chat layer: end_turn
        assert block.name == "get_weather" and named.stop_reason == "end_turn"
        jsonschema.validate(block.input, SCHEMA)
    else:
        # llama-server maps {"type": "tool"} to "required": the name is not honoured
        assert block.name == "other" and named.stop_reason == "tool_use"
    async with client.messages.stream(model="sim-model", max_tokens=100, tools=TOOLS[1:],
                                      tool_choice={"type": "any"},
                                      messages=[{"role": "user", "content": "Weather?"}]) as stream:
        final = await stream.get_final_message()
    jsonschema.validate(final.content[0].input, SCHEMA)


async def test_vllm_errors_in_anthropic_shape(sim, sdk, http):
    server = await sim("vllm")
    client = sdk("anthropic", server)
    with pytest.raises(anthropic.NotFoundError) as err:
        await client.messages.create(model="nope", max_tokens=5,
                                     messages=[{"role": "user", "content": "hi"}])
    assert err.value.body == {"type": "error", "error": {
        "type": "NotFoundError", "message": "The model `nope` does not exist."}}
    # a body the request model rejects is answered before the handler, in vLLM's OpenAI shape
    async with http.post(server.url + "/v1/messages",
                         json={"model": "sim-model", "messages": []}) as resp:
        assert resp.status == 400
        assert "max_tokens" in (await resp.json())["error"]["message"]


async def test_llamacpp_fills_in_max_tokens_and_needs_messages(sim, http):
    server = await sim("llamacpp")
    async with http.post(server.url + "/v1/messages",
                         json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["stop_sequence"] is None and body["stop_reason"] == "end_turn"
    async with http.post(server.url + "/v1/messages", json={"max_tokens": 5}) as resp:
        assert resp.status == 500
        assert await resp.json() == {"error": {"code": 500, "message": "'messages' is required",
                                               "type": "server_error"}}


async def test_stop_sequences(sim, http):
    for engine, reason in (("vllm", "stop_sequence"), ("llamacpp", "end_turn")):
        server = await sim(engine)
        body = {"model": "sim-model", "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(server.url + "/v1/messages", json=body) as resp:
            text = (await resp.json())["content"][0]["text"]
        word = text.split()[3]
        async with http.post(server.url + "/v1/messages",
                             json={**body, "stop_sequences": [word]}) as resp:
            msg = await resp.json()
        assert msg["stop_reason"] == reason and msg["stop_sequence"] == word
        assert word not in msg["content"][0]["text"] and text.startswith(msg["content"][0]["text"])


async def test_sglang_does_not_serve_messages(sim, http):
    server = await sim("sglang")
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        async with http.post(server.url + path, json={}) as resp:
            assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}
