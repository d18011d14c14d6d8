"""Embeddings, rerank, score, audio and unknown routes, in each engine's shape; refused as each engine refuses them
for a text model."""

import io

import aiohttp
import openai
import pytest

from gateway.sim.options import EXTRA_APIS, SimOptions

QUERY = "fast data node"
DOCS = ["the slow cold path", "data node is fast", {"text": "a fast node"}]


async def _post(http, url, body):
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def test_vllm_rerank_routes_and_score(sim, http):
    server = await sim("vllm", serves=frozenset({"rerank", "score"}))
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
    server = await sim("sglang", serves=frozenset({"rerank"}))
    status, out = await _post(http, server.url + "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert status == 200 and isinstance(out, list)
    assert [r["index"] for r in out] == [1, 2, 0] and out[0]["document"] == "data node is fast"
    server = await sim("llamacpp", serves=frozenset({"rerank"}))
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
    server = await sim(engine, serves=frozenset({"transcriptions"}))
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


LLAMA_NO_EMBEDDINGS = "This server does not support embeddings. Start it with `--embeddings`"
LLAMA_NO_RERANK = "This server does not support reranking. Start it with `--reranking`"
SGLANG_NOT_EMBEDDING = ("This model does not appear to be an embedding model by default. Please add `--is-embedding` "
                        "when launching the server or try another model.")
VLLM_NOT_FOUND = (404, {"detail": "Not Found"})
LLAMA_NOT_FOUND = (404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})


def llama_501(message):
    return 501, {"error": {"code": 501, "message": message, "type": "not_supported_error"}}


# A text model (the default, as the e2e tests' tiny models): each engine's answer to the APIs it serves only with
# another model or a flag. llama-server and vLLM as seen on the real b11434 and 0.32 (tests/e2e/OBSERVED.md).
TEXT_MODEL_REFUSALS = {
    "vllm": {path: VLLM_NOT_FOUND for path in (
        "/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score", "/v1/audio/transcriptions",
        "/v1/audio/translations")},
    "llamacpp": {"/v1/embeddings": llama_501(LLAMA_NO_EMBEDDINGS), "/embeddings": llama_501(LLAMA_NO_EMBEDDINGS),
                 "/v1/rerank": llama_501(LLAMA_NO_RERANK), "/reranking": llama_501(LLAMA_NO_RERANK),
                 "/v1/audio/transcriptions": llama_501("The current model does not support audio input."),
                 "/v1/score": LLAMA_NOT_FOUND, "/v1/audio/translations": LLAMA_NOT_FOUND},
    "sglang": {"/v1/embeddings": (400, {"object": "error", "message": SGLANG_NOT_EMBEDDING, "type": "BadRequestError",
                                        "param": None, "code": 400}),
               "/v1/rerank": (400, {"object": "error", "message": SGLANG_NOT_EMBEDDING, "type": "BadRequestError",
                                    "param": None, "code": 400})},
}


@pytest.mark.parametrize("engine", sorted(TEXT_MODEL_REFUSALS))
async def test_a_text_model_refuses_the_other_apis_as_its_engine_does(sim, http, engine):
    server = await sim(engine)
    for path, expected in TEXT_MODEL_REFUSALS[engine].items():
        async with http.post(server.url + path, json={"model": "sim-model", "input": "hi"}) as resp:
            assert (resp.status, await resp.json()) == expected, path
    # The same flavour with a model that serves them: every path answers.
    server = await sim(engine, serves=frozenset(EXTRA_APIS[engine]))
    for path in TEXT_MODEL_REFUSALS[engine]:
        async with http.post(server.url + path, json={}) as resp:
            assert resp.status in ((400, 404) if path in ("/v1/score", "/v1/audio/translations") and
                                   engine == "llamacpp" else (400,)), path  # the empty body's own refusal


def test_a_flavour_serves_only_the_apis_its_engine_has():
    with pytest.raises(ValueError, match="the llamacpp flavour does not simulate score, translations"):
        SimOptions(engine="llamacpp", serves=frozenset({"score", "translations", "rerank"}))
    with pytest.raises(ValueError, match="the sglang flavour does not simulate transcriptions"):
        SimOptions(engine="sglang", serves=frozenset({"transcriptions"}))
    # llama-server --reranking serves embeddings too
    assert SimOptions(engine="llamacpp", serves=frozenset({"rerank"})).serves == {"rerank", "embeddings"}


def wav_form(audio: bytes, **fields: str) -> aiohttp.FormData:
    form = aiohttp.FormData()
    for k, v in {"model": "sim-model", **fields}.items():
        form.add_field(k, v)
    form.add_field("file", audio, filename="a.wav", content_type="audio/wav")
    return form


async def test_vllm_translations(sim, http):
    # (not with the SDK: its translations call is deprecated)
    server = await sim("vllm", serves=frozenset({"translations"}))
    audio = b"RIFF" + b"\0" * 64_000
    async with http.post(server.url + "/v1/audio/translations", data=wav_form(audio)) as resp:
        out = await resp.json()
    assert resp.status == 200 and out["text"].endswith(".")
    async with http.post(server.url + "/v1/audio/translations",
                         data=wav_form(audio, response_format="verbose_json")) as resp:
        verbose = await resp.json()
    assert verbose["text"] == out["text"] and verbose["task"] == "translate"
    # a model that translates does not transcribe here unless it says so
    async with http.post(server.url + "/v1/audio/transcriptions", data=wav_form(audio)) as resp:
        assert resp.status == 404
