"""SSE relay: token detection, usage stripping, model rewrite, the added [DONE] and the truncation error."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest

from gateway.routing.relay import ModelRewrite, SSERelay, StreamMeter, is_token_event


class Sink:
    def __init__(self) -> None:
        self.out = b""
        self.eof = False

    async def write(self, data: bytes) -> None:
        assert not self.eof, "nothing is written after the end of the body"
        self.out += data

    async def write_eof(self, data: bytes = b"") -> None:
        if not self.eof:
            self.out += data
            self.eof = True


def ev(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


ROLE = ev({"model": "n", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
NULL = ev({"model": "n", "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]})
TOK = ev({"model": "n", "choices": [{"index": 0, "delta": {"content": "hi"}}]})
FIN = ev({"model": "n", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
USAGE = ev({"model": "n", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("event,token", [(ROLE, False), (NULL, False), (TOK, True), (FIN, False), (USAGE, False),
                                         (b'data: {"choices":[{"text": "x"}]}\n\n', True),
                                         (b'data: {"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}', True)])
def test_token_event_detection(event, token):
    assert is_token_event(event) is token


async def feed_all(relay, data: bytes, step: int) -> None:
    for i in range(0, len(data), step):
        await relay.feed(data[i:i + step])
    await relay.finish()


@pytest.mark.parametrize("step", [1, 7, 10_000])
async def test_relay_strips_usage_rewrites_model_any_chunking(step):
    sink, meter = Sink(), StreamMeter()
    relay = SSERelay(sink, meter, strip_usage=True, rename=ModelRewrite("public"))
    await feed_all(relay, ROLE + TOK + TOK + FIN + USAGE + DONE, step)
    assert b'"choices":[]' not in sink.out and b'"model":"public"' in sink.out and b'"model":"n"' not in sink.out
    assert sink.out.endswith(DONE) and sink.out.count(DONE) == 1
    assert meter.usage == {"prompt_tokens": 3, "completion_tokens": 2}
    assert meter.token_events == 2 and meter.t_first is not None and meter.saw_finish


async def test_a_burst_sends_its_first_token_before_the_rest():
    # A fast engine's whole reply in one read: the first token is written on its own, then the rest.
    writes: list[bytes] = []

    class Writes(Sink):
        async def write(self, data: bytes) -> None:
            writes.append(data)
            await super().write(data)

        async def write_eof(self, data: bytes = b"") -> None:
            writes.append(data)
            await super().write_eof(data)

    sink, meter = Writes(), StreamMeter()
    relay = SSERelay(sink, meter, strip_usage=True, rename=ModelRewrite("n"))
    burst = ROLE + TOK * 100 + FIN + USAGE + DONE
    await feed_all(relay, burst, len(burst))
    assert writes[0] == ROLE + TOK and len(writes) == 2
    assert sink.out == ROLE + TOK * 100 + FIN + DONE and meter.token_events == 100
    # A small first block is not split (one write is cheaper than two).
    writes.clear()
    relay = SSERelay(Writes(), StreamMeter(), strip_usage=True, rename=ModelRewrite("n"))
    await feed_all(relay, ROLE + TOK + TOK, 10_000)
    assert writes[0] == ROLE + TOK + TOK


KINDS = [ROLE, NULL, TOK, FIN, b'data: {"choices":[{"text": "x"}]}\n\n', b'data: {"choices":[{"text":""}]}\n\n',
         b'data: {"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}\n\n', b": keep-alive\n\n",
         ev({"choices": [{"delta": {"content": "", "reasoning": "r"}}]}), ev({"choices": [{"delta": {"content": "a"}}]})]


@pytest.mark.parametrize("seed", range(20))
async def test_token_events_of_a_block_are_those_of_its_events_one_by_one(seed):
    # Several events in one read are counted in one pass; the count must be what each event alone would give.
    rng = random.Random(seed)
    events = [rng.choice(KINDS) for _ in range(rng.randint(1, 40))]
    meter = StreamMeter()
    relay = SSERelay(Sink(), meter, strip_usage=False, rename=ModelRewrite("n"))
    await relay.feed(b"".join(events))
    assert meter.token_events == sum(is_token_event(e) for e in events)


async def test_relay_keeps_usage_when_asked_and_adds_done_after_error():
    sink, meter = Sink(), StreamMeter()
    relay = SSERelay(sink, meter, strip_usage=False, rename=ModelRewrite("n"))
    err = ev({"error": {"code": 500, "message": "slot died", "type": "server_error"}})
    await feed_all(relay, NULL + TOK + err, 10_000)
    assert sink.out.endswith(DONE)
    error_event = [line for line in sink.out.split(b"\n\n") if b'"error"' in line][0]
    payload = orjson.loads(error_event[6:])
    assert set(payload["error"]) >= {"message", "type", "param", "code"} and meter.error is not None


async def test_relay_reports_truncation_when_stream_ends_without_finish():
    sink, meter = Sink(), StreamMeter()
    relay = SSERelay(sink, meter, strip_usage=True, rename=ModelRewrite("n"))
    await feed_all(relay, ROLE + TOK, 10_000)
    assert b"upstream_truncated" in sink.out and sink.out.endswith(DONE)


@pytest.mark.parametrize("body,public", [
    (b'{"model":"alias","choices":[]}', "pub"),
    (b'{"model": "alias", "x": {"model": "alias"}}', "pub"),
    (b'{"model":"pub","choices":[]}', "pub"),
    (b'{"model":"a\\"b","choices":[]}', "p"),
])
def test_model_rewrite_whatever_the_engine_answered(body, public):
    out = ModelRewrite(public)(body)
    names = [v for k, v in _walk(orjson.loads(out)) if k == "model"]
    assert names and all(n == public for n in names)


def _walk(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k, v
            yield from _walk(v)


def sglang_ev(obj) -> bytes:
    """An SGLang chunk: "usage": null in every one but the usage chunk (spaced as Python's json writes it)."""
    return b"data: " + orjson.dumps({**obj, "usage": None}).replace(b'"usage":null', b'"usage": null') + b"\n\n"


SG_TOK = sglang_ev({"model": "n", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]})
SG_FIN = sglang_ev({"model": "n", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})


@pytest.mark.parametrize("step", [1, 7, 10_000])
@pytest.mark.parametrize("strip", [True, False])
async def test_null_usage_in_every_chunk_passes_unparsed_and_the_real_usage_is_still_found(step, strip):
    # Chunks that say "usage": null go out byte for byte; the usage chunk after them is still read (and dropped
    # when the gateway asked for it on its own account).
    sink, meter = Sink(), StreamMeter()
    relay = SSERelay(sink, meter, strip_usage=strip, rename=ModelRewrite("n"))
    tokens = SG_TOK.replace(b'"usage": null', b'"usage":null') + SG_TOK * 3
    await feed_all(relay, tokens + SG_FIN + USAGE + DONE, step)
    assert sink.out == tokens + SG_FIN + (b"" if strip else USAGE) + DONE
    assert meter.token_events == 4 and meter.saw_finish
    assert meter.usage == {"prompt_tokens": 3, "completion_tokens": 2}


class NowSink(Sink):
    """A client stream that also takes writes from a callback, as the front's does."""

    writable = True

    def write_now(self, data: bytes, last: bool = False) -> None:
        assert self.writable and not self.eof, "take() writes only when the client keeps up"
        self.out += data
        self.eof = self.eof or last


STREAM = [ROLE, TOK, TOK + TOK, NULL, TOK[:9], TOK[9:], TOK, FIN + USAGE, DONE]


@pytest.mark.parametrize("strip", [True, False])
async def test_take_relays_what_feed_would_and_leaves_it_what_it_must(strip):
    # Chunks offered to take() first, as the engine connection's read callback does, then to feed() when declined:
    # the client gets byte for byte what feed() alone gives, and the meter the same figures.
    alone_sink, alone = NowSink(), StreamMeter()
    relay = SSERelay(alone_sink, alone, strip_usage=strip, rename=ModelRewrite("public"))
    for c in STREAM:
        await relay.feed(c)
    await relay.finish()
    sink, meter = NowSink(), StreamMeter()
    relay = SSERelay(sink, meter, strip_usage=strip, rename=ModelRewrite("public"))
    taken = []
    for c in STREAM:
        if relay.take(c):
            taken.append(c)
        else:
            await relay.feed(c)
    await relay.finish()
    assert sink.out == alone_sink.out and sink.eof
    assert (meter.token_events, meter.usage, meter.saw_finish, meter.saw_done) == \
        (alone.token_events, alone.usage, alone.saw_finish, alone.saw_done) == (5, alone.usage, True, True)
    # Declined: before the first token (feed may split a burst there), a partial event, the event it ends.
    assert ROLE not in taken and TOK[:9] not in taken and TOK[9:] not in taken
    assert taken == [TOK + TOK, NULL, TOK, FIN + USAGE, DONE]


async def test_take_declines_while_the_client_lags_or_feed_waits_for_it():
    sink, meter = NowSink(), StreamMeter()
    relay = SSERelay(sink, meter, strip_usage=True, rename=ModelRewrite("n"))
    await relay.feed(ROLE + TOK)
    sink.writable = False  # the client stopped reading: the stream's task waits for it, in feed()
    assert not relay.take(TOK)
    sink.writable = True
    gate = asyncio.Event()

    class Waiting(NowSink):
        async def write(self, data: bytes) -> None:
            await super().write(data)
            await gate.wait()  # as a write that waits for the client to drain

    relay.resp = Waiting()
    feeding = asyncio.create_task(relay.feed(TOK))
    await asyncio.sleep(0)
    assert not relay.take(TOK), "a chunk must not overtake the one feed() is writing"
    gate.set()
    await feeding
    assert relay.take(TOK) and meter.token_events == 3
