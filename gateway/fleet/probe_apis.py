"""The support probe's API checks: each API the gateway serves, asked of one engine and model with a tiny request."""

from __future__ import annotations

import io
import math
import re
import secrets
import struct
import wave
from typing import Any

from gateway.fleet.probe_checks import MAX_TOKENS, PROMPT
from gateway.fleet.probe_target import (
    ERROR,
    GATEWAY,
    NO,
    PARTIAL,
    YES,
    Cell,
    CheckTable,
    Target,
    Verdict,
    refusal,
)

EMBEDDINGS, RESPONSES, MESSAGES = "/v1/embeddings", "/v1/responses", "/v1/messages"
RERANK, SCORE = "/v1/rerank", "/v1/score"
TRANSCRIPTIONS, TRANSLATIONS = "/v1/audio/transcriptions", "/v1/audio/translations"
# A stored response's id as the engines make them; anything else is not put in a path.
RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
DOCUMENTS = ["Rome is in Italy.", "Paris is in France."]


def tiny_wav(seconds: float = 0.25, rate: int = 16_000) -> bytes:
    """A short 440 Hz tone as 16-bit mono PCM WAV: audio any speech model reads, a few kilobytes."""
    frames = b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / rate)))
                      for i in range(int(seconds * rate)))
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return out.getvalue()


WAV = tiny_wav()


def form(fields: dict[str, str], audio: bytes) -> tuple[bytes, str]:
    """A multipart/form-data body with the fields and the audio as `file`, and its content type."""
    boundary = "shapegate-probe-" + secrets.token_hex(8)
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="probe.wav"\r\n'
                 f'Content-Type: audio/wav\r\n\r\n'.encode() + audio + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


async def check_embeddings(t: Target) -> Cell:
    reply = await t.post(EMBEDDINGS, {"model": t.model, "input": PROMPT})
    data = reply.get("data")
    first = data[0] if isinstance(data, list) and data else None
    vector = first.get("embedding") if isinstance(first, dict) else None
    if isinstance(vector, str) and vector:  # base64, when an engine defaults to it
        return Cell(YES)
    if not isinstance(vector, list) or not vector or not all(number(x) for x in vector):
        return Cell(NO, "no embedding vector in the reply")
    return Cell(YES)


def responses_body(t: Target, store: bool) -> dict[str, Any]:
    return {"model": t.model, "input": PROMPT, "max_output_tokens": MAX_TOKENS, "temperature": 0, "store": store}


async def check_responses(t: Target) -> Cell:
    """The Responses API: a Response object with output (not stored)."""
    reply = await t.post(RESPONSES, responses_body(t, store=False))
    if reply.get("object") != "response" or not isinstance(reply.get("output"), list):
        raise Verdict(NO, "the reply is not a Response object with output")
    return Cell(YES)


def refused(status: int, body: bytes, what: str, rid: str) -> Verdict:
    """A refusal of the stored id's routes, the id replaced (an engine quotes it; each run makes another)."""
    v = refusal(status, body, f"{what}: ")
    return Verdict(v.cell.verdict, v.cell.reason.replace(rid, "{id}"), status)


async def check_response_store(t: Target) -> Cell:
    """The engine's own store of responses: one made with `store: true`, then GET and DELETE of its id."""
    try:
        made = await t.post(RESPONSES, responses_body(t, store=True))
    except Verdict as v:
        raise Verdict(v.cell.verdict, f"POST {RESPONSES}: {v.cell.reason}", v.cell.status) from None
    rid = made.get("id")
    if not isinstance(rid, str) or not RESPONSE_ID.fullmatch(rid):
        return Cell(NO, "the created response has no usable id")
    path = f"{RESPONSES}/{rid}"
    status, body = await t.ask("GET", path)
    if status != 200:
        raise refused(status, body, "GET", rid)
    if f'"{rid}"'.encode() not in body:
        return Cell(NO, "GET answered without the stored response")
    status, body = await t.ask("DELETE", path)
    if status != 200:
        v = refused(status, body, "DELETE", rid)
        if v.cell.verdict == ERROR:
            raise v
        return Cell(PARTIAL, f"GET served; {v.cell.reason}", status=status)
    return Cell(YES)


async def check_messages(t: Target) -> Cell:
    """Anthropic's Messages API: a message with content."""
    body = {"model": t.model, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": PROMPT}]}
    reply = await t.post(MESSAGES, body)
    if reply.get("type") != "message" or not isinstance(reply.get("content"), list):
        raise Verdict(NO, "the reply is not a message with content")
    return Cell(YES)


async def check_rerank(t: Target) -> Cell:
    """Documents ranked against a query: `results` (vLLM, llama.cpp) or a bare list (SGLang), each with an index
    and a score."""
    reply = await t.post_json(RERANK, {"model": t.model, "query": "Which city is in Italy?", "documents": DOCUMENTS})
    results = reply.get("results") if isinstance(reply, dict) else reply
    if not isinstance(results, list) or not results:
        return Cell(NO, "no results in the reply")
    for r in results:
        if not (isinstance(r, dict) and isinstance(r.get("index"), int)
                and (number(r.get("relevance_score")) or number(r.get("score")))):
            return Cell(NO, "a result without an index and a score")
    return Cell(YES)


async def check_score(t: Target) -> Cell:
    reply = await t.post(SCORE, {"model": t.model, "text_1": "Which city is in Italy?", "text_2": DOCUMENTS[0]})
    data = reply.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or not number(data[0].get("score")):
        return Cell(NO, "no score in the reply")
    return Cell(YES)


async def audio(t: Target, path: str) -> Cell:
    body, ctype = form({"model": t.model, "response_format": "json"}, WAV)
    reply = await t.post_form(path, body, ctype)
    if not isinstance(reply.get("text"), str):
        return Cell(NO, "no text in the reply")
    return Cell(YES)


async def check_transcriptions(t: Target) -> Cell:
    return await audio(t, TRANSCRIPTIONS)


async def check_translations(t: Target) -> Cell:
    return await audio(t, TRANSLATIONS)


async def check_conversations(t: Target) -> Cell:
    """Not asked of the engine: the gateway keeps conversations itself and sends engines plain requests."""
    return Cell(GATEWAY, "served by the gateway itself, on every engine")


API_CHECKS: CheckTable = {
    "embeddings": check_embeddings, "responses": check_responses, "response_store": check_response_store,
    "messages": check_messages, "rerank": check_rerank, "score": check_score,
    "transcriptions": check_transcriptions, "translations": check_translations,
    "conversations": check_conversations,
}
# Checks that send nothing to the engine: they need no slot of the probe's concurrency.
LOCAL_CHECKS = frozenset({"conversations"})
