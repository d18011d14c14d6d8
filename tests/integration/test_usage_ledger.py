"""The usage ledger over two replicas on one Redis, in front of the three simulated engines: its tokens are the
engines' own counts (their /metrics), whatever the API, streamed or not, failed over or copied to a shadow arm."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator

import aiohttp
import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.runner import SimOptions, SimServer, start_sim
from tests import kit
from tests.gateway_harness import ADMIN_KEY, USER_KEY, RunningGateway, gateway_config, start_gateway
from tests.integration.replicas_kit import drop_keys, redis_client
from tests.needs import REDIS_URL
from tests.procs import shapegate

MODEL = "m"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GENERATING = ("chat", "completions", "responses", "messages")
# Each simulated engine's own counters of the prompt tokens it took in and of the tokens it generated.
ENGINE_COUNTERS = {"vllm": (("vllm:prompt_tokens_total",), "vllm:generation_tokens_total"),
                   "sglang": (("sglang:prompt_tokens_total",), "sglang:generation_tokens_total"),
                   # llama.cpp counts the prompt tokens it evaluated apart from those its slot cache held
                   "llamacpp": (("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),
                                "llamacpp:tokens_predicted_total")}


@pytest.fixture
async def sims() -> AsyncIterator[dict[str, SimServer]]:
    # (each with a model that embeds too: the simulators serve a text model's APIs alone otherwise)
    started = {e: await start_sim(SimOptions(engine=e, model=MODEL, seed=i, report_cached_tokens=True,
                                             serves=frozenset({"embeddings"})))
               for i, e in enumerate(("vllm", "sglang", "llamacpp"))}
    for s in started.values():
        await s.wait_ready(10)
    yield started
    for s in started.values():
        await s.close()


@pytest.fixture
async def replicas(sims: dict[str, SimServer]) -> AsyncIterator[list[RunningGateway]]:
    """Two gateways on one Redis: vLLM and llama.cpp serve the model, SGLang takes shadow copies of it."""
    client = await redis_client()
    prefix = f"shapegate-test:{secrets.token_hex(6)}:"
    backends = [{"id": e, "engine": e, "url": s.url, "models": [MODEL]} for e, s in sims.items()]
    cfg = gateway_config(backends, state={"backend": "redis", "redis_url": REDIS_URL, "key_prefix": prefix},
                         routing={"policy": "round_robin"}, usage={"flush_interval_s": 0.1},
                         health={"breaker_failures": 1000})
    cfg["experiments"] = [{"name": "sh", "model": MODEL, "mode": "shadow", "shadow_max_in_flight": 64,
                           "arms": [{"name": "candidate", "backends": ["sglang"]}]}]
    gws = [await start_gateway(cfg), await start_gateway(cfg)]
    yield gws
    for g in gws:
        await g.stop()
    await drop_keys(client, prefix)
    await client.aclose()


async def engine_counts(http: aiohttp.ClientSession, engine: str, url: str) -> tuple[int, int]:
    """(prompt tokens, generated tokens) an engine's /metrics says it processed."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    prompt_names, generated = ENGINE_COUNTERS[engine]
    return int(sum(values.get(n, 0) for n in prompt_names)), int(values.get(generated, 0))


async def usage(gw: RunningGateway, **query: str) -> dict:
    async with aiohttp.ClientSession(headers=ADMIN) as s, s.get(gw.url + "/admin/usage", params=query) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def ledger_counts(report: dict, backend: str) -> tuple[int, int]:
    """(prompt, completion) tokens the ledger holds for a backend: the keys' own and the shadow copies'."""
    prompt = completion = 0
    for row in report["rows"]:
        if row["backend"] == backend and row["api"] in GENERATING:
            prompt += row["prompt_tokens"] + row["shadow_prompt_tokens"]
            completion += row["completion_tokens"] + row["shadow_completion_tokens"]
    return prompt, completion


async def mixed_run(gw: RunningGateway, key: str, i: int) -> dict[str, int]:
    """One turn of every generating API, streamed and not, plus embeddings; the usage the client was told."""
    seen = {"prompt": 0, "completion": 0, "requests": 0}

    def add(prompt: int, completion: int) -> None:
        seen["prompt"] += prompt
        seen["completion"] += completion
        seen["requests"] += 1

    text = f"turn {i}: tell me about engines " * (1 + i % 3)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0) as oai:
        r = await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                              max_tokens=5 + i)
        add(r.usage.prompt_tokens, r.usage.completion_tokens)
        stream = await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                   max_tokens=7, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                add(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        c = await oai.completions.create(model=MODEL, prompt=text, max_tokens=4)
        add(c.usage.prompt_tokens, c.usage.completion_tokens)
        resp = await oai.responses.create(model=MODEL, input=text, max_output_tokens=6, store=False)
        add(resp.usage.input_tokens, resp.usage.output_tokens)
        rstream = await oai.responses.create(model=MODEL, input=text, max_output_tokens=6, store=False, stream=True)
        async for ev in rstream:
            if ev.type == "response.completed":
                add(ev.response.usage.input_tokens, ev.response.usage.output_tokens)
        e = await oai.embeddings.create(model=MODEL, input=text)
        seen["embedding_tokens"] = e.usage.prompt_tokens
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0) as claude:
        m = await claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": text}])
        add(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0), m.usage.output_tokens)
        async with claude.messages.stream(model=MODEL, max_tokens=5,
                                          messages=[{"role": "user", "content": text}]) as ms:
            final = await ms.get_final_message()
        add(final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0), final.usage.output_tokens)
    return seen


async def test_the_ledger_holds_the_engines_own_token_counts_across_replicas(sims, replicas):
    gws = replicas
    async with aiohttp.ClientSession() as http:
        before = {e: await engine_counts(http, e, s.url) for e, s in sims.items()}
        # Requests fail over: the next two on vLLM fail before their first byte and go to llama.cpp.
        sims["vllm"].set_faults(error_next=2)
        told = {"user": [], "ops": []}
        for i in range(6):
            for key, name in ((USER_KEY, "user"), (ADMIN_KEY, "ops")):
                told[name].append(await mixed_run(gws[i % 2], key, i))

        async def settled() -> dict | None:
            report = await usage(gws[0], by="key,api,backend")
            after = {e: await engine_counts(http, e, s.url) for e, s in sims.items()}
            engines = {e: (after[e][0] - before[e][0], after[e][1] - before[e][1]) for e in sims}
            ledger = {e: ledger_counts(report, e) for e in sims}
            return report if engines == ledger else None

        report = await kit.until(settled, "the ledger's tokens equal the engines' own counts", timeout=15.0)
    assert all(ledger_counts(report, e)[1] > 0 for e in sims)  # every engine took part (SGLang: shadow copies)
    shadow_only = [r for r in report["rows"] if r["backend"] == "sglang"]
    assert shadow_only and all(r["requests"] == 0 and r["shadow_requests"] > 0 for r in shadow_only)
    # Per key: what each client was told it used, and one request counted per request however many attempts.
    keys = report["keys"]
    for name in ("user", "ops"):
        generating = sum(t["requests"] for t in told[name])
        assert keys[name]["requests"] == generating + len(told[name])  # and one embeddings request each turn
        assert keys[name]["prompt_tokens"] == sum(t["prompt"] + t["embedding_tokens"] for t in told[name])
        assert keys[name]["completion_tokens"] == sum(t["completion"] for t in told[name])
    failed_over = sum(r["errors"] for r in report["rows"])
    assert failed_over == 0  # the two failures were failed over: the requests ended well
    # Both replicas read the same figures.
    other = await usage(gws[1], by="key,api,backend")
    assert other["keys"] == report["keys"] and other["store"] == "redis" and other["scope"] == "replicas"


async def test_a_stream_the_client_left_counts_the_tokens_relayed_until_then(sims, replicas):
    gw = replicas[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        before = {e: await engine_counts(http, e, s.url) for e, s in sims.items()}
        read = 0
        async with http.post(gw.url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
            async for line in r.content:
                read += b'"content":"' in line and b'"content":""' not in line  # (not the role's empty chunk)
                if read >= 5:
                    break
        report = await kit.until(lambda: _one_request(gw), "the stream counted", timeout=10.0)
        row = report["rows"][0]
        after = {e: await engine_counts(http, e, s.url) for e, s in sims.items()}
    generated = after[row["backend"]][1] - before[row["backend"]][1]
    assert row["requests"] == 1 and row["errors"] == 0
    # What was relayed before the gateway saw the client gone: at least what the client read, at most what the
    # engine made before it saw the abort.
    assert read <= row["completion_tokens"] <= generated < 400
    assert row["prompt_tokens"] > 0  # the gateway's estimate: the engine's usage never came


async def _one_request(gw: RunningGateway) -> dict | None:
    report = await usage(gw, by="key,api,backend", key="user")
    return report if report["totals"]["requests"] == 1 else None


async def test_shapegate_usage_reads_the_ledger_as_json_csv_and_a_table(sims, replicas):
    gw = replicas[1]
    async with aiohttp.ClientSession() as http:
        # A model nobody serves is the client's error before any engine: no row (a client's free text never is).
        for model in (MODEL, "nobody-serves-this"):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "ignore_eos": True}
            async with http.post(gw.url + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
                assert r.status == (200 if model == MODEL else 404)
    await kit.until(lambda: _one_request(gw), "the request counted", timeout=10.0)
    env = {"SHAPEGATE_ADMIN_KEY": ADMIN_KEY}
    code, out, err = await shapegate("usage", "--url", replicas[0].url, "--json", "--since", "1h", env=env)
    assert code == 0, err
    data = json.loads(out)
    assert data["keys"]["user"]["requests"] == 1 and data["keys"]["user"]["completion_tokens"] == 2
    code, out, _ = await shapegate("usage", "--url", replicas[0].url, "--csv", "--by", "key,model,api", env=env)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("key,model,api,requests,prompt_tokens,cached_tokens,completion_tokens,errors,refused")
    assert lines[1].startswith(f"user,{MODEL},chat,1,")
    code, out, err = await shapegate("usage", "--url", replicas[0].url, env=env)
    assert code == 0 and out.splitlines()[0].split()[:3] == ["key", "requests", "prompt_tokens"]
    code, _, err = await shapegate("usage", "--url", replicas[0].url, "--since", "yesterday-ish", env=env)
    assert code == 2 and "is not a time" in err


async def test_usage_needs_an_admin_key(replicas):
    async with aiohttp.ClientSession() as s:
        async with s.get(replicas[0].url + "/admin/usage", headers={"Authorization": f"Bearer {USER_KEY}"}) as r:
            assert r.status in (401, 403)
            assert "error" in await r.json()
        async with s.get(replicas[0].url + "/admin/usage", headers=ADMIN, params={"by": "colour"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "by"
