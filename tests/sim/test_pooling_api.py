"""Rerank, score, transcriptions and unknown routes, in each engine's shape."""

import io

import openai
import pytest

QUERY = "fast data node"
DOCS = ["the slow cold path", "data node is fast", {"text": "a fast node"}]


async def _post(http, url, body):
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def test_vllm_rerank_routes_and_score(sim, http):
    server = await sim("vllm")
    body = {"model": "sim-model", "query": QUERY, "documents": DOCS, "top_n": 2}
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, out = await _post(http, server.url + path, body)
        assert status == 200 and out["id"].startswith("rerank-") and out["model"] == "sim-model"
        assert [r["index"] for r in out["results"]] == [1, 2]
        assert out["results"][0]["document"]["text"] == "data node is fast"
        assert out["results"][0]["relevance_score"] > out["results"][1]["relevance_score"] > 0
        assert out["usage"]["total_tokens"] > 0
    status, out = await _post(http, server.url + "/v1/rerank", {**body, "top_n": 0})
    assert len(out["results"]) == 3 and out["results"][-1]["index"] == 0  # top_n 0: all
    status, out = await _post(http, server.url + "/v1/score",
                              {"model": "sim-model", "text_1": QUERY, "text_2": ["fast", "nothing"]})
    assert status == 200 and out["object"] == "list"
    assert [d["object"] for d in out["data"]] == ["score", "score"]
    assert out["data"][0]["score"] > out["data"][1]["score"] == 0.0
    status, out = await _post(http, server.url + "/v1/score",
                              {"model": "sim-model", "text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert status == 400


async def test_sglang_and_llamacpp_rerank_shapes(sim, http):
    server = await sim("sglang")
    status, out = await _post(http, server.url + "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert status == 200 and isinstance(out, list)
    assert [r["index"] for r in out] == [1, 2, 0] and out[0]["document"] == "data node is fast"
    server = await sim("llamacpp")
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        status, out = await _post(http, server.url + path,
                                  {"model": "m", "query": QUERY, "documents": DOCS, "top_n": 1})
        assert status == 200 and out["object"] == "list" and out["model"] == "m"
        (best,) = out["results"]
        assert best["index"] == 1 and best["relevance_score"] > 0 and "document" not in best
    status, out = await _post(http, server.url + "/v1/rerank", {"query": QUERY, "documents": []})
    assert status == 400 and out["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
async def test_transcriptions_with_the_sdk(sim, sdk, engine):
    server = await sim(engine)
    client = sdk("openai", server)
    audio = b"RIFF" + b"\0" * 96_000  # three seconds of 16 kHz 16-bit mono
    first = await client.audio.transcriptions.create(model="sim-model",
                                                     file=("a.wav", io.BytesIO(audio), "audio/wav"))
    again = await client.audio.transcriptions.create(model="sim-model",
                                                     file=("b.wav", io.BytesIO(audio), "audio/wav"))
    assert first.text and first.text == again.text and first.text.endswith(".")
    other = await client.audio.transcriptions.create(model="sim-model",
                                                     file=("c.wav", io.BytesIO(audio * 2), "audio/wav"))
    assert other.text != first.text
    if engine == "vllm":
        assert first.usage.type == "duration" and first.usage.seconds == 3
        text = await client.audio.transcriptions.create(
            model="sim-model", file=("a.wav", io.BytesIO(audio), "audio/wav"), response_format="text")
        assert text.strip() == first.text
    else:
        assert first.usage.type == "tokens" and first.usage.output_tokens > 0
        with pytest.raises(openai.BadRequestError) as err:
            await client.audio.transcriptions.create(
                model="sim-model", file=("a.wav", io.BytesIO(audio), "audio/wav"),
                response_format="text")
        assert "Only 'json' response_format" in str(err.value.body)
    # every transcription ran through the scheduler, and the engine metrics saw it
    assert server.state.tel.ttft.count == (4 if engine == "vllm" else 3)


@pytest.mark.parametrize("engine,paths", [
    ("vllm", ["/v1/responses/input_tokens", "/reranking"]),
    ("sglang", ["/v1/score", "/v1/audio/transcriptions", "/v1/messages", "/rerank",
                "/v1/responses/input_tokens"]),
    ("llamacpp", ["/v1/score", "/v2/rerank", "/v1/responses/resp_x/cancel"]),
])
async def test_routes_an_engine_does_not_serve(sim, http, engine, paths):
    server = await sim(engine)
    for path in paths:
        async with http.post(server.url + path, json={}) as resp:
            body = await resp.json()
        if engine == "llamacpp":
            assert resp.status == 404 and body == {"error": {
                "code": 404, "message": "File Not Found", "type": "not_found_error"}}, path
        elif path == "/v1/responses/input_tokens":
            # a POST on the path of GET /v1/responses/{response_id}
            assert resp.status == 405 and body == {"detail": "Method Not Allowed"}, path
        else:
            assert resp.status == 404 and body == {"detail": "Not Found"}, path
