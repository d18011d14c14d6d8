"""One engine loop under load: 64 concurrent streams, batch limits, and aborts on client disconnect."""

import asyncio

import aiohttp

from tests.kit import until
from tests.sim.support import chat_body, content_of, read_sse, sample, scrape


async def test_64_concurrent_streams_complete(sim, http):
    server = await sim("vllm")

    async def one(i: int) -> tuple[str, int]:
        body = chat_body(f"stream number {i}", max_tokens=24, ignore_eos=True, stream=True,
                         stream_options={"include_usage": True})
        async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
            events = await read_sse(resp)
        return content_of(events), events[-2]["usage"]["completion_tokens"]

    results = await asyncio.gather(*(one(i) for i in range(64)))
    assert all(n == 24 and text for text, n in results)
    assert len({text for text, _ in results}) > 32  # outputs depend on the prompt
    fam = await scrape(http, server.url)
    assert sample(fam, "vllm:generation_tokens", model_name="sim-model") == 64 * 24
    assert server.state.sched.counters.steps < 64 * 24 / 4  # batched, not one step per token


async def test_max_running_makes_requests_wait(sim, http):
    server = await sim("vllm", profile="mi350x-vllm", slots=2)
    body = chat_body(max_tokens=80, ignore_eos=True)
    tasks = [asyncio.create_task(http.post(server.url + "/v1/chat/completions", json=body))
             for _ in range(4)]
    async def two_run_two_wait() -> bool:
        fam = await scrape(http, server.url)
        return (sample(fam, "vllm:num_requests_running", model_name="sim-model"),
                sample(fam, "vllm:num_requests_waiting", model_name="sim-model")) == (2, 2)

    await until(two_run_two_wait)  # never more than two running, the others queued
    for task in tasks:
        resp = await task
        assert resp.status == 200
        resp.release()


async def test_stream_disconnect_frees_the_slot(sim, http):
    server = await sim("llamacpp", profile="r9700-llamacpp-vulkan", slots=1)
    body = chat_body(max_tokens=500, ignore_eos=True, stream=True)
    resp = await http.post(server.url + "/v1/chat/completions", json=body)
    seen = 0
    async for line in resp.content:
        seen += line.startswith(b"data: ")
        if seen >= 3:
            break
    resp.close()  # the client goes away mid-stream
    for _ in range(50):
        if not server.state.sched.running:
            break
        await asyncio.sleep(0.02)
    async with http.get(server.url + "/slots") as slots:
        assert not (await slots.json())[0]["is_processing"]
    fam = await scrape(http, server.url)
    assert sample(fam, "llamacpp:tokens_predicted") < 100
    async with http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=2)) as r:
        assert r.status == 200


async def test_non_stream_disconnect_aborts_the_request(sim, http):
    server = await sim("sglang", profile="mi350x-sglang")
    try:
        async with http.post(server.url + "/v1/chat/completions",
                             json=chat_body(max_tokens=1000, ignore_eos=True),
                             timeout=aiohttp.ClientTimeout(total=0.2)):
            pass
    except asyncio.TimeoutError:
        pass  # the client gave up
    for _ in range(50):
        if not server.state.sched.running:
            break
        await asyncio.sleep(0.02)
    assert not server.state.sched.running
    fam = await scrape(http, server.url)
    assert sample(fam, "sglang:num_aborted_requests", model_name="sim-model") == 1
