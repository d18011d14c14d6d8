"""Forced tool calls and structured output on chat and Responses, checked with the openai SDK and jsonschema."""

import json
import random

import jsonschema
import openai
import pydantic
import pytest

from gateway.sim.instances import instance

ENGINES = ["vllm", "sglang", "llamacpp"]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hourly": {"type": "boolean"},
        "limits": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}, "minItems": 2},
        "note": {"type": "string"},
    },
    "required": ["city", "unit", "days", "hourly", "limits"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "strict": True}}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "address": {"$ref": "#/$defs/address"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "address", "tags"],
    "additionalProperties": False,
    "$defs": {"address": {"type": "object", "properties": {"zip": {"type": "string"},
                                                         "city": {"anyOf": [{"type": "string"},
                                                                            {"type": "null"}]}},
                          "required": ["zip", "city"], "additionalProperties": False}},
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("schema", [WEATHER, PERSON, {"type": "array", "items": {"enum": [1, "a"]}},
                                    {"type": ["integer", "null"], "multipleOf": 7, "minimum": 8}])
def test_generated_instances_validate(schema):
    for seed in range(50):
        jsonschema.validate(instance(schema, random.Random(seed)), schema)


@pytest.mark.parametrize("engine", ENGINES)
async def test_required_tool_call(sim, sdk, engine):
    server = await sim(engine)
    client = sdk("openai", server)
    resp = await client.chat.completions.create(model="sim-model", messages=MESSAGES, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "lookup"
    assert isinstance(json.loads(call.function.arguments), dict)
    assert resp.usage.completion_tokens > 0


@pytest.mark.parametrize("engine,finish", [("vllm", "stop"), ("sglang", "tool_calls"),
                                           ("llamacpp", "tool_calls")])
async def test_named_tool_call_streamed_and_not(sim, sdk, engine, finish):
    server = await sim(engine)
    client = sdk("openai", server)
    choice_ = {"type": "function", "function": {"name": "get_weather"}}
    resp = await client.chat.completions.create(model="sim-model", messages=MESSAGES, tools=TOOLS,
                                                tool_choice=choice_)
    call = resp.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    # vLLM keeps "stop" for a call forced by name, as its serving code does
    assert resp.choices[0].finish_reason == finish
    assert resp.usage.completion_tokens > 5
    prefix = {"vllm": "chatcmpl-tool-", "sglang": "call_", "llamacpp": ""}[engine]
    assert call.id.startswith(prefix)

    stream = await client.chat.completions.create(model="sim-model", messages=MESSAGES, tools=TOOLS,
                                                  tool_choice=choice_, stream=True,
                                                  stream_options={"include_usage": True})
    parts, names, ids, finishes, usage = [], [], set(), [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.add(tc.id)
                if tc.function and tc.function.name:
                    names.append(tc.function.name)
                parts.append(tc.function.arguments or "")
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert names == ["get_weather"] and len(ids) == 1 and finishes == [finish]
    assert json.loads("".join(parts)) == args  # the same prompt, the same call
    assert usage.completion_tokens == len(parts)  # one delta per generated token


@pytest.mark.parametrize("engine", ENGINES)
async def test_strict_json_schema_and_json_object(sim, sdk, engine):
    server = await sim(engine)
    client = sdk("openai", server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    resp = await client.chat.completions.create(model="sim-model", messages=MESSAGES,
                                                response_format=fmt)
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.tool_calls in (None, [])
    jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)
    stream = await client.chat.completions.create(model="sim-model", messages=MESSAGES,
                                                  response_format=fmt, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == resp.choices[0].message.content
    obj = await client.chat.completions.create(model="sim-model", messages=MESSAGES,
                                               response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


async def test_max_tokens_cuts_a_forced_answer(sim, sdk):
    server = await sim("vllm")
    resp = await sdk("openai", server).chat.completions.create(
        model="sim-model", messages=MESSAGES, tools=TOOLS[1:], tool_choice="required", max_tokens=3)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 3


async def test_tool_choice_errors(sim, sdk):
    server = await sim("vllm")
    client = sdk("openai", server)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="sim-model", messages=MESSAGES,
                                             tool_choice="required")
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "missing"}})
    assert "missing" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="sim-model", input="x", tool_choice="required")
    assert err.value.body["message"] == "Tool choice 'required' must be specified with 'tools' parameter."


def _response_tools():
    return [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]


@pytest.mark.parametrize("engine", ENGINES)
async def test_responses_function_call_streamed_and_not(sim, sdk, engine):
    server = await sim(engine)
    client = sdk("openai", server)
    resp = await client.responses.create(model="sim-model", input="Weather in Oslo?",
                                         tools=_response_tools(), tool_choice="required")
    (item,) = resp.output
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id
    jsonschema.validate(json.loads(item.arguments), WEATHER)

    stream = await client.responses.create(
        model="sim-model", input="Weather in Oslo?", tools=_response_tools(),
        tool_choice={"type": "function", "name": "get_weather"}, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    n = kinds.count("response.function_call_arguments.delta")
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added"]
                     + ["response.function_call_arguments.delta"] * n
                     + ["response.function_call_arguments.done", "response.output_item.done",
                        "response.completed"])
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.status == "in_progress" and added.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments == done.arguments == item.arguments
    assert events[-1].response.output[0].arguments == args


@pytest.mark.parametrize("engine", ENGINES)
async def test_responses_text_format_json_schema(sim, sdk, engine):
    server = await sim(engine)
    resp = await sdk("openai", server).responses.create(
        model="sim-model", input="Describe a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), PERSON)


class Person(pydantic.BaseModel):
    name: str
    age: int
    tags: list[str]


@pytest.mark.parametrize("engine", ENGINES)
async def test_sdk_parse_and_stream_helpers(sim, sdk, engine):
    server = await sim(engine)
    client = sdk("openai", server)
    parsed = await client.chat.completions.parse(model="sim-model", messages=MESSAGES,
                                                 response_format=Person)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    via_responses = await client.responses.parse(model="sim-model", input="Who?", text_format=Person)
    assert isinstance(via_responses.output_parsed, Person)
    tool = openai.pydantic_function_tool(Person, name="save_person")
    async with client.chat.completions.stream(model="sim-model", messages=MESSAGES, tools=[tool],
                                              tool_choice="required") as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    assert isinstance(final.choices[0].message.tool_calls[0].function.parsed_arguments, Person)
