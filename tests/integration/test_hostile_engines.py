"""Hostile engines on a bare socket: broken framing and odd replies, what the client sees, failover, pool hygiene."""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass

import openai
import orjson
import pytest

from tests.fake_engine import FakeEngine
from tests.gateway_harness import gateway_config, start_gateway
from tests.kit import until
from tests.raw_engine import (CONTENT, JSON_BODY, MSG, RawEngine, Reply, assert_clean_head, bad_chunk, body_of, chat_ok,
                              chunk, cl_reply, empty_then_close, error_event, first_event_then_bad_chunk, good,
                              good_then_late_reply, head, head_over_limit_in_pieces, head_trickled_forever,
                              huge_chunk_size_then_close, oai, raw_chat, stream_ending, with_fields)


@dataclass(frozen=True)
class Row:
    id: str
    reply: Reply
    status: int = 502  # what the client gets; 200: the reply works
    code: str | None = "upstream_error"
    stream_status: int | None = None  # for a stream, when it differs (200: output went out, then the error event)
    reuse: bool = False  # the engine connection may carry the next request
    hung: bool = False  # a first-byte timeout: the gateway holds the engine off at once (breaker_open_s)

    def expect(self, stream: bool) -> int:
        return self.stream_status if stream and self.stream_status is not None else self.status


ROWS = [
    # chunk framing
    Row("chunk-size-negative", bad_chunk(b"-6")),
    Row("chunk-size-0x-prefix", bad_chunk(b"0x10")),
    Row("chunk-size-plus-sign", bad_chunk(b"+0")),
    Row("chunk-size-leading-space", bad_chunk(b" 5")),
    Row("chunk-size-trailing-space", bad_chunk(b"5 ")),
    Row("chunk-size-huge-hex", bad_chunk(b"f" * 24)),
    Row("chunk-size-huge-hex-then-close", huge_chunk_size_then_close),
    # Data, then broken framing in the same read: nothing has reached the client, so a stream fails over too.
    Row("chunk-data-without-crlf", lambda s: head(s, b"Transfer-Encoding: chunked") + b"5\r\nhelloXX0\r\n\r\n"),
    Row("chunk-extension-control-char", bad_chunk(b"%x;\x01" % len(JSON_BODY))),
    Row("chunk-extension-spaces", bad_chunk(b"%x; a b" % len(JSON_BODY))),
    Row("chunk-extension-open-quote", bad_chunk(b'%x;a="' % len(JSON_BODY))),
    # Output went out before the framing broke: the stream ends with an error event and [DONE] (200).
    Row("first-event-then-bad-chunk", first_event_then_bad_chunk, stream_status=200),
    # length and transfer coding
    Row("content-length-abc", lambda s: head(s, b"Content-Length: abc") + body_of(s)),
    Row("content-length-negative", lambda s: head(s, b"Content-Length: -1") + body_of(s)),
    Row("content-length-twice", lambda s: head(s, b"Content-Length: 2", b"Content-Length: 3") + body_of(s)),
    Row("content-length-and-chunked", lambda s: head(s, b"Content-Length: 5", b"Transfer-Encoding: chunked")
        + chunk(body_of(s)) + b"0\r\n\r\n"),
    Row("transfer-encoding-gzip", lambda s: head(s, b"Transfer-Encoding: gzip") + body_of(s)),
    # the head
    Row("header-value-cr", with_fields(b"X-Engine: a\rX-Injected: cr")),
    Row("header-value-lf", with_fields(b"X-Engine: a\nX-Injected: lf")),
    Row("header-value-nul", with_fields(b"X-Engine: a\x00b")),
    Row("content-type-with-cr", lambda s: cl_reply(s).replace(
        b"\r\nContent-Type: ", b"\r\nContent-Type: text/html\rX-Injected: ct\r\nX-Was: ")),
    Row("bare-lf-line-ends", lambda s: cl_reply(s).replace(b"\r\n", b"\n")),
    Row("101-switching-protocols", lambda s: b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                                             b"Connection: Upgrade\r\n\r\n" + body_of(s)),
    Row("status-999", lambda s: cl_reply(s, status=b"999 X")),
    Row("empty-reply-then-close", empty_then_close),
    # A sound head and an empty body: no output, so still a failure the next backend could take; well framed, so
    # the connection may carry the next request.
    Row("head-then-empty-chunked-body", lambda s: head(s, b"Transfer-Encoding: chunked") + b"0\r\n\r\n", reuse=True),
    Row("head-never-ends-trickled", head_trickled_forever, status=504, code="upstream_timeout", hung=True),
    Row("head-100kb", lambda s: cl_reply(s, b"X-Big: " + b"a" * 100_000)),
    Row("head-100kb-in-pieces", head_over_limit_in_pieces),
    Row("head-200-lines", lambda s: cl_reply(s, *(b"X-Line-%d: v" % i for i in range(200)))),
    Row("garbage-status-line", lambda s: b"HELLO THERE\r\n\r\n" + body_of(s)),
    # replies that must work
    Row("100-continue-then-200", lambda s: b"HTTP/1.1 100 Continue\r\n\r\n" + good(s), 200, None, reuse=True),
    Row("103-early-hints-then-200", lambda s: b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"
        + good(s), 200, None, reuse=True),
    Row("extra-bytes-after-reply", lambda s: good(s) + b"GARBAGE\r\n\r\n", 200, None),
    Row("second-reply-50ms-later", good_then_late_reply, 200, None),
]
FAILING = [r for r in ROWS if r.status != 200]


# -- the table: one hostile engine behind the gateway ----------------------------------------------------

HOLD_S = 0.2  # the breaker's hold after a hung engine: short, so the next request soon finds it again


async def after_hostile(engine: RawEngine, row: Row) -> None:
    if inspect.iscoroutinefunction(row.reply):
        await engine.settled()
    if row.hung:
        await asyncio.sleep(HOLD_S + 0.05)


@pytest.fixture
async def env():
    engine = await RawEngine().start()
    # A short first-byte deadline, so the row whose head never ends fails in a second, not in two minutes.
    gw = await start_gateway(gateway_config([{"id": "raw", "engine": "openai", "url": engine.url, "models": ["m"]}],
                                            upstream={"first_byte_timeout_s": 1.0}, health={"breaker_open_s": HOLD_S}))
    yield engine, gw
    await gw.stop()
    await engine.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
async def test_hostile_reply(env, row: Row, stream: bool):
    engine, gw = env
    async with oai(gw.url) as client:
        # A good exchange first, so the hostile reply comes on a pooled, reused connection.
        assert await chat_ok(client, stream) == CONTENT
        engine.set(row.reply)
        want = row.expect(stream)

        t0 = time.monotonic()
        a = await raw_chat(gw.url, stream)
        assert a.status == want, (a.status, a.body[:300])
        assert_clean_head(a.head)
        if want != 200:
            err = a.error()
            assert err["code"] == row.code and err["type"] == {502: "upstream_error", 504: "timeout_error"}[want]
        elif not stream:
            assert orjson.loads(a.body)["choices"][0]["message"]["content"] == CONTENT
        elif row.code is None:
            assert stream_ending(a.body) == "done" and CONTENT.encode() in a.body, a.body
        else:
            assert stream_ending(a.body) == "error", a.body
            assert error_event(a.body)["code"] == row.code
        assert time.monotonic() - t0 < 5, "an answer at once (the trickled head: the 1 s deadline)"
        await after_hostile(engine, row)

        # The same through the openai client: an exception it understands, with the gateway's code.
        if want != 200:
            with pytest.raises(openai.APIStatusError) as ei:
                await chat_ok(client, stream)
            assert ei.value.status_code == want and ei.value.code == row.code
        elif stream and row.code is not None:
            with pytest.raises(openai.APIError, match="upstream"):
                await chat_ok(client, stream)
        else:
            assert await chat_ok(client, stream) == CONTENT

        await after_hostile(engine, row)
        hostile = engine.post_conns("hostile")
        if not row.reuse:
            # The gateway drops an engine connection that broke framing or sent bytes nobody asked for.
            await until(lambda: all(c.closed.is_set() for c in hostile),
                        "the engine connection closed after a broken reply", timeout=2.0)

        # The next requests, with the engine behaving, work: nothing of the hostile exchange is left in the pool.
        engine.set(good, hostile=False)
        for s in (stream, not stream, stream):
            assert await chat_ok(client, s) == CONTENT
        reused = any(c.answers[c.answers.index("hostile") + 1:] for c in hostile)
        if row.reuse:
            assert reused, "a sound keep-alive connection is reused"
        else:
            assert not reused, "a request went on a connection that broke framing or sent bytes nobody asked for"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("row", FAILING, ids=[r.id for r in FAILING])
async def test_failover_to_a_good_engine(row: Row, stream: bool):
    """A reply broken before anything reached the client: the next backend answers, the client sees 200."""
    bad = await RawEngine().start()
    fine = await FakeEngine().start()
    # Round robin starts at the first backend listed: the hostile one.
    gw = await start_gateway(gateway_config([
        {"id": "hostile", "engine": "openai", "url": bad.url, "models": ["m"]},
        {"id": "good", "engine": "openai", "url": fine.url, "models": ["m"]}],
        routing={"policy": "round_robin"}, upstream={"first_byte_timeout_s": 1.0}))
    try:
        # /readyz needs one ready backend; this test needs both.
        await until(lambda: all(b.usable(time.monotonic()) for b in gw.state.pool.all()), "both backends usable")
        bad.set(row.reply)
        if not stream:
            async with oai(gw.url) as client:
                raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=3)
            assert raw.status_code == 200 and raw.parse().choices[0].message.content == "w0 w1 w2"
            headers = raw.headers
        else:
            a = await raw_chat(gw.url, stream=True)
            headers = a.headers
            if row.stream_status == 200:
                # The hostile engine's output reached the client before it broke: no failover, a clean error ending.
                assert a.status == 200 and stream_ending(a.body) == "error"
                assert headers["x-shapegate-backend"] == "hostile"
                return
            assert a.status == 200 and stream_ending(a.body) == "done", a.body[:300]
        assert headers["x-shapegate-backend"] == "good", "the hostile engine's reply was taken as an answer"
        assert "failover from hostile" in headers["x-shapegate-reason"] and bad.post_conns("hostile")
    finally:
        await gw.stop()
        await fine.stop()
        await bad.stop()
