"""Hostile audio forms through a real gateway to a fake engine that records what it received: the model routing and
the rate limits read is the model the engine reads, or the form is refused with OpenAI's 400."""

from __future__ import annotations

import aiohttp
import openai

from gateway.apis import audio
from tests.gateway_harness import USER_KEY, gateway_config, start_gateway
from tests.unit.test_audio_forms import ACCEPTED, CT, FILE, REFUSED, field, form, part

PATH = "/v1/audio/transcriptions"


def _native(model: str) -> str:
    return model + "-native"


async def _post(s: aiohttp.ClientSession, url: str, ctype: str, body: bytes) -> tuple[int, dict]:
    async with s.post(url + PATH, data=body, headers={"Content-Type": ctype,
                                                      "Authorization": f"Bearer {USER_KEY}"}) as r:
        return r.status, await r.json(content_type=None)


async def test_what_the_gateway_limits_is_what_the_engine_serves(api_engines):
    engine = api_engines[0]
    cfg = gateway_config([{"id": "b0", "engine": "vllm", "url": engine.url,
                           "models": {"mk": _native("mk"), "free": _native("free")}}],
                         limits={"models": {"mk": {"rpm": 1}}})
    g = await start_gateway(cfg)
    try:
        async with aiohttp.ClientSession() as s:
            honest = form(field("model", b"mk"), FILE)
            assert (await _post(s, g.url, CT, honest))[0] == 200
            status, body = await _post(s, g.url, CT, honest)
            assert status == 429, body
            # Every way of slipping `mk` past the limit: the engine serves what the gateway counted, or nothing.
            tries = [
                part(b'Content-Disposition: form-data; xname="model"; name="note"', b"mk") + field("model", b"free"),
                field("model", b"free") + field("model", b"mk"),
                field("notes", b"n" * 100_000) + field("model", b"mk"),
                part(b'Content-Disposition: form-data; name="note"\r\nContent-Disposition: form-data; name="model"',
                     b"mk") + field("model", b"free"),
                part(b'Content-Disposition: form-data; NAME="model"', b"mk"),
            ]
            for fields in tries:
                status, body = await _post(s, g.url, CT, form(fields, FILE))
                assert status in (400, 429) or body["text"].endswith("via free-native"), (fields[:80], body)
            status, body = await _post(s, g.url, CT, form(field("model", b"free"), FILE) + field("model", b"mk") + END)
            assert body["text"].endswith("via free-native")
        served = [dict((n, v) for n, _, v in f).get("model") for f in engine.knobs.forms]
        assert served.count(b"mk-native") == 1  # the honest request the limit let through, and no other
    finally:
        await g.stop()


END = b"--XyZ--\r\n"


async def test_every_form_reaches_the_engine_as_the_gateway_read_it_or_is_refused(api_engines):
    engine = api_engines[0]
    models = {m: _native(m) for m in ("free", "m")}
    g = await start_gateway(gateway_config([{"id": "b0", "engine": "vllm", "url": engine.url, "models": models}]))
    try:
        async with aiohttp.ClientSession() as s:
            for what, ctype, body, model in ACCEPTED:
                before = len(engine.knobs.forms)
                status, reply = await _post(s, g.url, ctype, body)
                assert status == 200, (what, reply)
                assert reply["text"] == f"heard a via {_native(model)}", what
                got = engine.knobs.forms[before]
                read = audio.check(ctype, body)[audio.FORM_KEY]
                # field for field, in order, what the gateway read; the model under the engine's own name
                assert [(n, v) for n, _, v in got] == [
                    (p.name, _native(model).encode() if p.name == "model" else p.value()) for p in read.parts], what
                sent = [seen for seen in engine.knobs.seen if seen[1] == PATH][-1][2]["Content-Type"]
                assert sent == audio.forwarded_content_type(ctype)
            for what, ctype, body, code in REFUSED:
                status, reply = await _post(s, g.url, ctype, body)
                assert status == 400 and reply["error"]["code"] == code, (what, reply)
            forms = [seen for seen in engine.knobs.seen if seen[1] == PATH]
            assert len(forms) == len(ACCEPTED)  # nothing of a refused form reached the engine
        async with openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=USER_KEY, max_retries=0) as c:
            t = await c.audio.transcriptions.create(model="m", file=("a.wav", b"RIFF" + b"\0" * 2000, "audio/wav"),
                                                    language="en", timestamp_granularities=["word", "segment"],
                                                    response_format="verbose_json")
            assert t.text == "heard a via m-native"
        names = [n for n, _, _ in engine.knobs.forms[-1]]
        assert names.count("timestamp_granularities[]") == 2 and "language" in names
    finally:
        await g.stop()
