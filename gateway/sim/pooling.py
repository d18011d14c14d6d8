"""Embeddings, rerank, score and audio routes of a simulated engine, in its engine's shape or refused as it refuses."""

from __future__ import annotations

import math
import random
import re
import time
import uuid
import zlib
from typing import Any

import orjson
from aiohttp import web

from gateway.sim import pump
from gateway.sim.errors import ApiError
from gateway.sim.handlers import Handler, embeddings, error_response, generating, read_json
from gateway.sim.parse import check_model
from gateway.sim.state import SIM, SimState
from gateway.sim.tokens import VOCAB, encode, fixed_output, words

_WORD = re.compile(r"\w+")
# Audio as 16 kHz 16-bit mono: 32 000 bytes a second, and a Whisper-like 50 encoder tokens a second.
_BYTES_PER_SECOND = 32_000
_AUDIO_TOKENS_PER_SECOND = 50


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def relevance(query: str, doc: str) -> float:
    """A deterministic 0..1 relevance: cosine of the two texts' word sets."""
    q = set(_WORD.findall(query.lower()))
    d = set(_WORD.findall(doc.lower()))
    if not q or not d:
        return 0.0
    return len(q & d) / math.sqrt(len(q) * len(d))


def _logit(score: float) -> float:
    # llama-server returns the reranker's raw output, an unbounded logit, not a probability.
    p = min(max(0.02 + 0.96 * score, 1e-6), 1 - 1e-6)
    return round(math.log(p / (1 - p)), 6)


def _documents(body: dict[str, Any], key: str = "documents") -> list[str]:
    docs = body.get(key)
    if not isinstance(docs, list) or not docs:
        raise ApiError(400, f'"{key}" must be a non-empty string array', param=key)
    out = []
    for doc in docs:
        if isinstance(doc, dict) and isinstance(doc.get("text"), str):
            out.append(doc["text"])
        elif isinstance(doc, str):
            out.append(doc)
        else:
            raise ApiError(400, f'"{key}" must be a non-empty string array', param=key)
    return out


def _pair_tokens(query: str, doc: str) -> int:
    return len(encode(query)) + len(encode(doc)) + 3  # [BOS] query [EOS] [SEP] doc [EOS]


async def rerank(request: web.Request) -> web.Response:
    st = request.app[SIM]
    await st.ready.wait()
    try:
        body = await read_json(request)
        model = check_model(st.parse_ctx, body)
        if not isinstance(body.get("query"), str):
            raise ApiError(400, '"query" must be provided', param="query")
        query = body["query"]
        tei = st.engine_name == "llamacpp" and "texts" in body and "documents" not in body
        docs = _documents(body, "texts" if tei else "documents")
        top_n = body.get("top_n")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int)):
            raise ApiError(400, "'top_n' must be an integer", param="top_n")
    except ApiError as err:
        return error_response(st, err)
    scores = [relevance(query, d) for d in docs]
    order = sorted(range(len(docs)), key=lambda i: (-scores[i], i))
    if top_n is not None and top_n > 0:
        order = order[:top_n]
    n_tokens = sum(_pair_tokens(query, d) for d in docs)
    if st.engine_name == "sglang":
        # SGLang answers with a bare list, best first.
        return _json([{"score": round(scores[i], 6), "document": docs[i], "index": i,
                       "meta_info": {"id": uuid.uuid4().hex, "finish_reason": None,
                                     "prompt_tokens": _pair_tokens(query, docs[i])}}
                      for i in order])
    if st.engine_name == "llamacpp":
        if tei:
            return _json([{"index": i, "score": _logit(scores[i])} for i in order])
        return _json({"model": body.get("model", "gpt-3.5-turbo"), "object": "list",
                      "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
                      "results": [{"index": i, "relevance_score": _logit(scores[i])} for i in order]})
    return _json({"id": f"rerank-{uuid.uuid4().hex}", "model": model,
                  "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
                  "results": [{"index": i, "document": {"text": docs[i], "multi_modal": None},
                               "relevance_score": round(scores[i], 6)} for i in order]})


async def score(request: web.Request) -> web.Response:
    """vLLM /v1/score: text_1 against text_2, one to one, one to many or many to many."""
    st = request.app[SIM]
    await st.ready.wait()
    try:
        body = await read_json(request)
        model = check_model(st.parse_ctx, body)
        left, right = _texts(body, "text_1"), _texts(body, "text_2")
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise ApiError(400, "Input lengths must be either 1:1, 1:N or N:N")
    except ApiError as err:
        return error_response(st, err)
    data = [{"index": i, "object": "score", "score": round(relevance(a, b), 6)}
            for i, (a, b) in enumerate(zip(left, right))]
    n = sum(_pair_tokens(a, b) for a, b in zip(left, right))
    return _json({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                  "model": model, "data": data,
                  "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                            "prompt_tokens_details": None}})


def _texts(body: dict[str, Any], key: str) -> list[str]:
    value = body.get(key)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise ApiError(400, f"'{key}' must be a string or a non-empty list of strings", param=key)


# -- audio ------------------------------------------------------------------------------------
def transcript(size: int) -> str:
    """What the simulated model hears in `size` bytes of audio: the same size, the same words."""
    rng = random.Random(zlib.crc32(str(size).encode()))
    n = min(max(3, int(size / _BYTES_PER_SECOND * 2.5)), 200)
    text = words(rng, n)
    return text[:1].upper() + text[1:] + "."


def _audio_tokens(data: bytes, limit: int) -> list[int]:
    seconds = max(1.0, len(data) / _BYTES_PER_SECOND)
    n = max(1, min(int(seconds * _AUDIO_TOKENS_PER_SECOND), limit))
    step = max(1, len(data) // n)
    return [zlib.crc32(data[i * step:(i + 1) * step]) % VOCAB for i in range(n)]


@generating()
async def transcriptions(request: web.Request, st: SimState) -> web.Response:
    try:
        form = await _form(request)
        upload = form.get("file")
        data: bytes = upload.file.read() if isinstance(upload, web.FileField) else b""
        fmt = str(form.get("response_format", "json"))
        _check_transcription(st, form, upload, fmt)
    except ApiError as err:
        return error_response(st, err)
    room = st.profile.slot_ctx() if st.engine_name == "llamacpp" else st.profile.max_model_len
    tokens = _audio_tokens(data, room // 2)
    output = fixed_output(transcript(len(data)), max(room - len(tokens), 1))
    ticket = pump.submit(st, tokens, output)
    try:
        req = await pump.finish(ticket)
    finally:
        pump.release(st, ticket)
    text = output.text
    seconds = max(1, round(len(data) / _BYTES_PER_SECOND))
    if st.engine_name == "llamacpp":
        return _json({"type": "transcript.text.done", "text": text, "usage": {
            "type": "tokens", "input_tokens": len(tokens), "output_tokens": req.generated,
            "total_tokens": len(tokens) + req.generated,
            "input_tokens_details": {"cached_tokens": req.cached}}})
    if fmt == "text":
        return web.Response(text=text, content_type="text/plain")
    if fmt == "verbose_json":
        task = "translate" if request.path.endswith("/translations") else "transcribe"
        return _json({"task": task, "language": str(form.get("language") or "en"),
                      "duration": float(seconds), "text": text, "words": None,
                      "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": float(seconds),
                                    "text": text, "tokens": list(output.ids),
                                    "temperature": 0.0, "avg_logprob": 0.0,
                                    "compression_ratio": 1.0, "no_speech_prob": 0.0}]})
    return _json({"text": text, "usage": {"type": "duration", "seconds": seconds}})


async def _form(request: web.Request) -> Any:
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "The request must be multipart/form-data with a 'file' field",
                       param="file")
    return await request.post()


def _check_transcription(st: SimState, form: Any, upload: Any, fmt: str) -> None:
    if st.engine_name == "llamacpp":
        if not isinstance(upload, web.FileField):
            raise ApiError(400, "No input file found for transcription")
        if fmt != "json":
            raise ApiError(400, "Only 'json' response_format is supported for transcription")
        return
    if not isinstance(upload, web.FileField):
        raise ApiError(400, "[{'type': 'missing', 'loc': ('body', 'file'), 'msg': 'Field required'}]",
                       param="file")
    check_model(st.parse_ctx, {"model": form.get("model")} if form.get("model") else {})
    if fmt not in ("json", "text", "verbose_json"):
        raise ApiError(400, "Currently only support response_format `text`, `json` or `verbose_json`",
                       param="response_format")


# How an engine whose model does not serve an API refuses it, where it has the route. llama-server b11434 on a
# text model: tests/e2e/OBSERVED.md. SGLang's tokenizer manager refuses an embedding request (rerank is one) to a
# generation model with this ValueError, which its OpenAI layer answers as a 400. vLLM mounts no route (a 404).
_NOT_EMBEDDING = ("This model does not appear to be an embedding model by default. Please add `--is-embedding` "
                  "when launching the server or try another model.")
REFUSALS: dict[tuple[str, str], tuple[int, str]] = {
    ("llamacpp", "embeddings"): (501, "This server does not support embeddings. Start it with `--embeddings`"),
    ("llamacpp", "rerank"): (501, "This server does not support reranking. Start it with `--reranking`"),
    ("llamacpp", "transcriptions"): (501, "The current model does not support audio input."),
    ("sglang", "embeddings"): (400, _NOT_EMBEDDING),
    ("sglang", "rerank"): (400, _NOT_EMBEDDING),
}


def served(engine: str, api: str, handler: Handler, serves: frozenset[str]) -> Handler | None:
    """The route's handler: the API's own when the model serves it, else the engine's refusal (None: no route)."""
    if api in serves:
        return handler
    refusal = REFUSALS.get((engine, api))
    if refusal is None:
        return None

    async def refuse(request: web.Request) -> web.Response:
        st = request.app[SIM]
        await st.ready.wait()
        return error_response(st, ApiError(*refusal))

    return refuse


# Each engine's paths of each API it has routes for.
PATHS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {"embeddings": ("/v1/embeddings",), "rerank": ("/rerank", "/v1/rerank", "/v2/rerank"),
             "score": ("/score", "/v1/score"), "transcriptions": ("/v1/audio/transcriptions",),
             "translations": ("/v1/audio/translations",)},
    "sglang": {"embeddings": ("/v1/embeddings",), "rerank": ("/v1/rerank",)},
    "llamacpp": {"embeddings": ("/v1/embeddings", "/embeddings"),
                 "rerank": ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"),
                 "transcriptions": ("/v1/audio/transcriptions", "/audio/transcriptions")},
}


def routes(engine: str, serves: frozenset[str]) -> list[web.RouteDef]:
    """The engine's paths for each API, with the handler `served` gives (none where it mounts no route)."""
    paths = PATHS[engine]
    handlers: dict[str, Handler] = {"embeddings": embeddings, "rerank": rerank, "score": score,
                                    "transcriptions": transcriptions, "translations": transcriptions}
    out = []
    for api, api_paths in paths.items():
        handler = served(engine, api, handlers[api], serves)
        if handler is not None:
            out += [web.post(p, handler) for p in api_paths]
    return out
