"""One attempt meter: a shadow copy is measured by the rule a client's attempt is (gateway/routing/attempt.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gateway.config import UpstreamConfig
from gateway.contracts import CLIENT_ERROR, CLIENT_LEFT, ENGINE_ERROR, OK, RequestShape, UpstreamCall
from gateway.experiments.shadow import _measure
from gateway.routing.attempt import measured, request_at_fault
from gateway.routing.relay import ModelRewrite, SSERelay, StreamMeter

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'
DONE = b"data: [DONE]\n\n"


def token(text: str, finish: str | None = None) -> bytes:
    end = f',"finish_reason":"{finish}"' if finish else ""
    return ('data: {"choices":[{"index":0,"delta":{"content":"%s"}%s}]}\n\n' % (text, end)).encode()


def shape(stream: bool) -> RequestShape:
    return RequestShape(model="m", route="chat", stream=stream, prompt_tokens=10, output_tokens=5, klass="default",
                        principal="p")


class Reply:
    """An engine's reply: chunks handed out one by one, `pause` seconds before the one at `slow`."""

    def __init__(self, status: int, chunks: list[bytes], slow: int = -1, pause: float = 0.0) -> None:
        self.status, self.headers, self.broken = status, {}, False
        self.chunks, self.slow, self.pause, self.i = chunks, slow, pause, 0

    async def next_chunk(self, by: float = 0.0) -> bytes | None:
        if self.i == self.slow:
            await asyncio.sleep(self.pause)
        if self.i >= len(self.chunks):
            return None
        self.i += 1
        return self.chunks[self.i - 1]

    async def read(self, limit: int, *, truncate: bool = False) -> bytes:
        return b"".join(self.chunks)

    def close(self) -> None:
        pass


def backend(reply: Reply) -> SimpleNamespace:
    async def forward(call, timeout):
        return reply
    return SimpleNamespace(id="cand", adapter=SimpleNamespace(forward=forward))


async def copy(reply: Reply, stream: bool = True):
    call = UpstreamCall("/v1/chat/completions", b"{}", {}, stream)
    return await _measure(backend(reply), call, shape(stream), UpstreamConfig(), None)  # type: ignore[arg-type]


async def relayed(chunks: list[bytes]) -> StreamMeter:
    """The same stream through the relay as the pipeline has it (the client's side)."""
    class Sink:
        writable = False

        async def write(self, data: bytes) -> None:
            pass

        async def write_eof(self, data: bytes = b"") -> None:
            pass
    meter = StreamMeter()
    relay = SSERelay(Sink(), meter, strip_usage=True, rename=ModelRewrite("m"))
    for c in chunks:
        await relay.feed(c)
    await relay.finish()
    return meter


async def test_a_copy_counts_tokens_and_times_its_first_one_as_a_client_stream_does():
    # The role-only first event is no token: the copy's TTFT waits for the first output, as the primary's does.
    chunks = [ROLE, token("a"), token("b"), token("c", "stop"), DONE]
    o, data = await copy(Reply(200, chunks, slow=1, pause=0.05))
    assert data == b"".join(chunks)
    meter = await relayed(chunks)
    assert (o.result, o.ok, o.status) == (OK, True, 200)
    assert o.completion_tokens == meter.token_events == 3 and o.prompt_tokens == 10  # no usage: the estimate
    assert o.ttft is not None and o.ttft >= 0.05 and o.itl is not None
    o2, _ = await copy(Reply(200, [ROLE, token("a"), token("b", "stop"), USAGE, DONE]))
    assert (o2.prompt_tokens, o2.completion_tokens) == (7, 3)  # the engine's usage when it reports it


@pytest.mark.parametrize("chunks", [[ROLE, token("a")],  # ended early: no finish, no [DONE]
                                    [ROLE, token("a"), b'data: {"error":{"message":"boom","code":500}}\n\n', DONE],
                                    []])  # nothing at all
async def test_a_copy_that_did_not_serve_is_the_engines_failure(chunks):
    o, _ = await copy(Reply(200, chunks))
    assert (o.result, o.ok) == (ENGINE_ERROR, False) and o.status >= 500


@pytest.mark.parametrize("status, result", [(400, CLIENT_ERROR), (404, CLIENT_ERROR), (501, CLIENT_ERROR),
                                            (429, ENGINE_ERROR), (500, ENGINE_ERROR), (503, ENGINE_ERROR)])
async def test_an_engine_error_is_judged_as_failover_judges_it(status, result):
    assert request_at_fault(status) == (result == CLIENT_ERROR)
    o, _ = await copy(Reply(status, [b'{"error":{"message":"no"}}']), stream=False)
    assert (o.result, o.status) == (result, status)


async def test_a_plain_reply_is_served_unless_it_is_empty():
    o, _ = await copy(Reply(200, [b'{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}']), stream=False)
    assert (o.result, o.status, o.prompt_tokens, o.completion_tokens) == (OK, 200, 4, 2)
    o, _ = await copy(Reply(200, []), stream=False)
    assert (o.result, o.status) == (ENGINE_ERROR, 502)


def test_results_and_fallbacks():
    s = shape(True)
    assert measured("b", s, 0.0, 200, True, False, False, None, None).result == OK
    assert measured("b", s, 0.0, 400, False, True, False, None, None).result == CLIENT_ERROR
    assert measured("b", s, 0.0, 499, False, False, True, None, None).result == CLIENT_LEFT
    assert measured("b", s, 0.0, 502, False, False, False, None, None).result == ENGINE_ERROR
    meter = StreamMeter()
    meter.t_first, meter.t_last, meter.token_events = 1.0, 3.0, 5
    o = measured("b", s, 0.5, 200, True, False, False, meter, {"prompt_tokens_details": {"cached_tokens": 3}}, 2)
    assert (o.ttft, o.itl, o.prompt_tokens, o.completion_tokens, o.cached_tokens, o.running_at_start) == (
        0.5, 0.5, 10, 5, 3, 2)
