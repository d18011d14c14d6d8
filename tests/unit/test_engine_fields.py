"""Engine-private reply fields (llama.cpp's `timings`): dropped by the relay unless the configuration keeps them,
at no cost to the engines that have none."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest

from backends import REGISTRY
from gateway.config import parse_config
from gateway.fleet.pool import BackendState
from gateway.routing.relay import DroppingModelRewrite, ModelRewrite, SSERelay, StreamMeter, drop_member
from gateway.runtime import build_policy
from tests.unit.test_relay import DONE, Sink, ev, feed_all

T = b'"timings"'
TIMINGS = {"prompt_n": 5, "prompt_ms": 3.5, "predicted_n": 8, "predicted_ms": 20.25, "predicted_per_second": 395.1}


@pytest.mark.parametrize("data,want", [
    (b'{"a":1,"timings":{"x":1.5,"y":2},"b":2}', b'{"a":1,"b":2}'),
    (b'{"timings":{"x":1},"b":2}', b'{"b":2}'),
    (b'{"a": 1, "timings": {"x": 1}}', b'{"a": 1}'),
    (b'{"timings":{"x":1}}', b'{}'),
    (b'{"a":1,"timings":null}', b'{"a":1}'),
    # nested values and strings holding braces are walked, not cut short
    (b'{"a":1,"timings":{"n":[1,{"q":"}"}]},"b":"\\"timings\\": 2"}', b'{"a":1,"b":"\\"timings\\": 2"}'),
    # the same word as a value, or inside a string, is no member
    (b'{"content":"timings","x":1}', b'{"content":"timings","x":1}'),
    (b'{"content":"say \\"timings","x":1}', b'{"content":"say \\"timings","x":1}'),
    # a member cut off at the end of the data is left alone
    (b'{"a":1,"timings":{"x":1', b'{"a":1,"timings":{"x":1'),
])
def test_drop_member(data, want):
    assert drop_member(data, T) == want


def test_every_event_of_a_block_loses_it():
    block = ev({"model": "m", "choices": [{"delta": {}, "finish_reason": "stop"}], "timings": TIMINGS}) + \
        ev({"model": "m", "choices": [], "usage": {"prompt_tokens": 5}, "timings": TIMINGS}) + DONE
    out = drop_member(block, T)
    events = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(events) == 2 and not any("timings" in e for e in events) and out.endswith(DONE)


@pytest.mark.parametrize("step", [1, 9, 10_000])
async def test_a_llamacpp_stream_reaches_the_client_without_timings(step):
    """As llama.cpp sends it: content chunks, a finish chunk, the usage chunk with its timings, [DONE]."""
    body = (ev({"model": "q.gguf", "choices": [{"delta": {"content": "hi"}}]}) * 3
            + ev({"model": "q.gguf", "choices": [{"delta": {}, "finish_reason": "stop"}], "timings": TIMINGS})
            + ev({"model": "q.gguf", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3},
                  "timings": TIMINGS}) + DONE)
    for strip_usage in (True, False):
        sink, meter = Sink(), StreamMeter()
        relay = SSERelay(sink, meter, strip_usage=strip_usage, rename=DroppingModelRewrite("pub", (T,)))
        await feed_all(relay, body, step)
        assert b"timings" not in sink.out and b'"model":"q.gguf"' not in sink.out, sink.out
        assert meter.usage == {"prompt_tokens": 5, "completion_tokens": 3} and meter.token_events == 3
        assert (b'"usage":{"prompt_tokens":5' in sink.out) is not strip_usage
    sink = Sink()
    await feed_all(SSERelay(sink, StreamMeter(), strip_usage=False, rename=ModelRewrite("pub")), body, step)
    assert sink.out.count(b'"timings"') == 2  # kept: the plain rewrite, as before


def state(engine: str, server: bool | None = None, own: bool | None = None) -> BackendState:
    b = {"id": "b", "engine": engine, "url": "http://127.0.0.1:1", "models": ["m"]}
    if own is not None:
        b["engine_private_fields"] = own
    cfg = parse_config({"auth": {"enabled": False}, "backends": [b],
                        **({"server": {"engine_private_fields": server}} if server is not None else {})},
                       build_policy)
    adapter = SimpleNamespace(private_fields=REGISTRY[engine].private_fields)
    return BackendState(cfg.backends[0], adapter, cfg)


def test_which_backends_drop_what():
    assert state("llamacpp").private_fields == (T,)  # the default: dropped
    assert state("llamacpp", server=True).private_fields == ()
    assert state("llamacpp", server=True, own=False).private_fields == (T,)  # the backend's own setting wins
    assert state("llamacpp", own=True).private_fields == ()
    for engine in ("vllm", "sglang", "openai"):  # nothing of their own: the plain rewrite, whatever the setting
        assert state(engine).private_fields == ()
    b = state("llamacpp", server=True)
    b.cfg = b.cfg.model_copy(update={"engine_private_fields": None})
    b.apply_settings(parse_config({"auth": {"enabled": False}, "backends": [
        {"id": "b", "engine": "llamacpp", "url": "http://127.0.0.1:1", "models": ["m"]}]}, build_policy))
    assert b.private_fields == (T,)  # a reload applies the new setting


def test_other_engines_keep_the_plain_rewrite():
    """A block of another engine goes through the plain ModelRewrite, exactly as before (the choice is made once per
    request); llama.cpp's through the dropping one, which adds one search of a block without the field."""
    token = ev({"id": "c", "model": "pub", "choices": [{"index": 0, "delta": {"content": "hello"}}]})
    plain, dropping = ModelRewrite("pub"), DroppingModelRewrite("pub", (T,))
    assert type(plain) is ModelRewrite and plain(token) is token and dropping(token) is token  # nothing copied
