"""Responses API over real HTTP and the official openai SDK: objects, streams, storage, chains, per engine."""

import asyncio

import openai
import pytest

from tests.kit import until
from tests.sim.support import read_events

ENGINES = ["vllm", "sglang", "llamacpp"]
MESSAGE_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added"]
CLOSING_EVENTS = ["response.output_text.done", "response.content_part.done",
                  "response.output_item.done", "response.completed"]


@pytest.mark.parametrize("engine", ENGINES)
async def test_create_returns_a_full_response_object(sim, sdk, engine):
    server = await sim(engine)
    client = sdk("openai", server)
    resp = await client.responses.create(model="sim-model", input="Tell me about gateways.",
                                         instructions="Be brief.", max_output_tokens=200)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.status == "completed"
    assert resp.model == "sim-model"
    (item,) = resp.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert item.status == "completed" and item.content[0].type == "output_text"
    assert item.content[0].annotations == [] and resp.output_text == item.content[0].text
    usage = resp.usage
    assert usage.input_tokens > 0 and usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens == len(resp.output_text.split())  # one token per simulated word
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    again = await client.responses.create(model="sim-model", input="Tell me about gateways.",
                                          instructions="Be brief.", max_output_tokens=200)
    assert again.output_text == resp.output_text and again.id != resp.id


async def test_vllm_marks_a_reply_cut_by_max_output_tokens_incomplete(sim, sdk):
    server = await sim("vllm")
    resp = await sdk("openai", server).responses.create(model="sim-model", input="hi",
                                                        max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.max_output_tokens == 3


@pytest.mark.parametrize("engine", ENGINES)
async def test_stream_events_in_order_with_sequence_numbers(sim, sdk, engine):
    server = await sim(engine)
    stream = await sdk("openai", server).responses.create(model="sim-model", input="Stream it.",
                                                          max_output_tokens=12, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == MESSAGE_EVENTS + ["response.output_text.delta"] * len(deltas) + CLOSING_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens == len(deltas)
    text = "".join(d.delta for d in deltas)
    assert events[-4].text == text and done.output_text == text
    assert {d.item_id for d in deltas} == {events[2].item.id}
    assert events[0].response.status == "in_progress" and events[0].response.output == []


@pytest.mark.parametrize("engine", ENGINES)
async def test_sdk_stream_helper_accumulates_the_response(sim, sdk, engine):
    server = await sim(engine)
    client = sdk("openai", server)
    async with client.responses.stream(model="sim-model", input="Stream it.") as stream:
        texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(texts)


async def test_stream_wire_format_has_event_lines_and_no_done(sim, http):
    server = await sim("vllm")
    async with http.post(server.url + "/v1/responses",
                         json={"model": "sim-model", "input": "hi", "stream": True}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    assert b"[DONE]" not in raw
    blocks = [b for b in raw.split(b"\n\n") if b]
    assert all(b.startswith(b"event: response.") for b in blocks)


async def test_deltas_follow_the_scheduler_timing(sim, http):
    server = await sim("vllm", profile="mi350x-vllm")
    body = {"model": "sim-model", "input": "hi", "stream": True, "max_output_tokens": 16,
            "ignore_eos": True}
    async with http.post(server.url + "/v1/responses", json=body) as resp:
        stamps = []
        async for line in resp.content:
            if line.startswith(b"data: {\"type\":\"response.output_text.delta\""):
                stamps.append(asyncio.get_running_loop().time())
    assert len(stamps) == 16
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert sum(gaps) / len(gaps) > 0.002  # decode steps of the profile, not one burst
    assert server.state.tel.itl.count >= 15


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_previous_response_id_chain_retrieve_and_delete(sim, sdk, engine):
    server = await sim(engine, responses_store=True)
    client = sdk("openai", server)
    first = await client.responses.create(model="sim-model", input="My name is Ada.")
    second = await client.responses.create(model="sim-model", input="What is my name?",
                                           previous_response_id=first.id)
    # the stored conversation (input and output) is part of the second prompt
    alone = await client.responses.create(model="sim-model", input="What is my name?", store=False)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    got = await client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.retrieve(alone.id)  # store=False
    assert missing.value.body["message"] == f"Response with id '{alone.id}' not found."
    # neither engine serves DELETE on a response: FastAPI's 405 for a path it knows
    with pytest.raises(openai.APIStatusError) as deleted:
        await client.responses.delete(second.id)
    assert deleted.value.status_code == 405 and deleted.value.body == {"detail": "Method Not Allowed"}


async def test_vllm_stores_nothing_by_default(sim, sdk):
    server = await sim("vllm")  # VLLM_ENABLE_RESPONSES_API_STORE unset: store is silently off
    client = sdk("openai", server)
    first = await client.responses.create(model="sim-model", input="hi", store=True)
    with pytest.raises(openai.NotFoundError) as err:
        await client.responses.create(model="sim-model", input="again", previous_response_id=first.id)
    assert err.value.body == {"message": f"Response with id '{first.id}' not found.",
                              "type": "invalid_request_error", "param": "response_id", "code": 404}
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as bg:
        await client.responses.create(model="sim-model", input="hi", background=True)
    assert "VLLM_ENABLE_RESPONSES_API_STORE" in bg.value.body["message"]


async def test_sglang_checks_the_id_prefix(sim, http):
    server = await sim("sglang")
    async with http.get(server.url + "/v1/responses/abc") as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["object"] == "error" and "Expected an ID that begins with 'resp'" in body["message"]
    async with http.get(server.url + "/v1/responses/resp_unknown") as resp:
        assert resp.status == 404 and (await resp.json())["param"] == "response_id"


async def test_llamacpp_keeps_no_state(sim, sdk, http):
    server = await sim("llamacpp")
    client = sdk("openai", server)
    first = await client.responses.create(model="sim-model", input="hi")
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="sim-model", input="hi", previous_response_id=first.id)
    assert err.value.body == {"code": 400, "type": "invalid_request_error",
                              "message": "llama.cpp does not support 'previous_response_id'."}
    async with http.get(server.url + f"/v1/responses/{first.id}") as resp:
        assert resp.status == 404
        assert await resp.json() == {"error": {"code": 404, "message": "File Not Found",
                                               "type": "not_found_error"}}
    count = await client.responses.input_tokens.count(model="sim-model", input="hi")
    assert count.input_tokens == first.usage.input_tokens


async def test_input_items_and_engine_specific_refusals(sim, sdk):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
             {"role": "user", "content": "And now?"}]
    for engine in ENGINES:
        server = await sim(engine)
        resp = await sdk("openai", server).responses.create(model="sim-model", input=items)
        assert resp.status == "completed" and resp.usage.input_tokens > 10, engine
    server = await sim("llamacpp")
    with pytest.raises(openai.BadRequestError) as err:
        await sdk("openai", server).responses.create(
            model="sim-model", input=[{"role": "assistant", "content": [
                {"type": "output_text", "text": "untyped"}]}])
    assert err.value.body["message"] == "Cannot determine type of 'item'"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_cancel_background_and_synchronous_responses(sim, sdk, engine):
    server = await sim(engine, profile="mi350x-vllm" if engine == "vllm" else None,
                       responses_store=True)
    client = sdk("openai", server)
    done = await client.responses.create(model="sim-model", input="hi")
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.cancel(done.id)
    assert "Cannot cancel a synchronous response." in str(err.value.body)
    queued = await client.responses.create(model="sim-model", input="hi", background=True,
                                           max_output_tokens=4000, extra_body={"ignore_eos": True})
    assert queued.status == "queued" and queued.output == []
    await until(lambda: server.state.sched.running, "the background request running")
    cancelled = await client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    await until(lambda: not server.state.sched.running, "the cancelled request released")
    assert (await client.responses.retrieve(queued.id)).status == "cancelled"
    finished = await client.responses.create(model="sim-model", input="hi", background=True)
    got = await until(lambda: _completed(client, finished.id), "the background response done")
    assert got.output_text and got.usage.output_tokens > 0


async def _completed(client, rid):
    resp = await client.responses.retrieve(rid)
    return resp if resp.status == "completed" else None


async def test_context_and_model_errors(sim, http):
    server = await sim("vllm", max_model_len=64)
    async with http.post(server.url + "/v1/responses",
                         json={"model": "sim-model", "input": "word " * 100}) as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
    assert err["param"] == "input" and "exceeds the max_model_len 64" in err["message"]
    async with http.post(server.url + "/v1/responses", json={"model": "nope", "input": "x"}) as resp:
        assert resp.status == 404
    events = None
    async with http.post(server.url + "/v1/responses",
                         json={"model": "sim-model", "input": "x", "stream": True}) as resp:
        events = await read_events(resp)
    assert events[-1][0] == "response.completed"
