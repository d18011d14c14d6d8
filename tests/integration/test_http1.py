"""The lean upstream HTTP/1.1 client against real servers: framing, keep-alive, stale connections, timeouts."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from backends.http1 import HostPool
from benchmarks.loopback import free_port
from gateway.contracts import UpstreamConnectError, UpstreamDisconnected
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import USER_KEY, gateway_config, start_gateway


async def raw_server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def pool(url: str, **kw) -> HostPool:
    return HostPool(url, limit=kw.get("limit", 8), connect_timeout=1.0, keepalive_s=30.0,
                    idle_timeout=kw.get("idle", 5.0))


async def test_content_length_chunked_and_keepalive_reuse():
    e = await FakeEngine(Knobs()).start()
    try:
        p = pool(e.url)
        r = await p.request("POST", "/v1/chat/completions", {"Content-Type": "application/json"},
                            b'{"model":"m","messages":[],"max_tokens":3}', 5)
        assert r.status == 200 and b'"w0 w1 w2"' in await r.read(1 << 20)
        r.close()
        first = p.idle[0]
        r = await p.request("POST", "/v1/chat/completions", {"Content-Type": "application/json"},
                            b'{"model":"m","messages":[],"max_tokens":3,"stream":true}', 5)
        assert r.headers["content-type"].startswith("text/event-stream")
        body = b"".join([c async for c in r.iter_chunks()])
        assert body.count(b"data: ") == 6 and body.endswith(b"data: [DONE]\n\n")
        r.close()
        assert p.idle[0] is first and first.used == 2, "the connection was kept alive and reused"
        p.close()
    finally:
        await e.stop()


@pytest.mark.parametrize("seed", range(4))
async def test_chunked_body_split_anywhere_decodes_exactly(seed):
    """Many chunks (one with an extension, then trailers), written in random pieces: the body comes out
    whole, and the connection stays reusable."""
    rng = random.Random(seed)
    parts = [bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))) for _ in range(60)]
    wire = b"".join(b"%x%s\r\n%s\r\n" % (len(c), b";ext=1" if i == 7 else b"", c) for i, c in enumerate(parts))
    wire += b"0\r\nX-Trailer: yes\r\n\r\n"

    async def handler(reader, writer):
        for _ in range(2):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            i = 0
            while i < len(wire):
                n = rng.choice([1, 2, 3, 5, 64, 700, 4096])
                writer.write(wire[i:i + n])
                await writer.drain()
                if rng.random() < 0.3:
                    await asyncio.sleep(0)
                i += n
        writer.close()

    server, url = await raw_server(handler)
    p = pool(url)
    try:
        for _ in range(2):
            r = await p.request("POST", "/x", {}, b"{}", 5)
            assert b"".join([c async for c in r.iter_chunks()]) == b"".join(parts)
            r.close()
        assert p.idle and p.idle[0].used == 2
    finally:
        p.close()
        server.close()


@pytest.mark.parametrize("framing", ["chunked", "until-close"])
async def test_a_whole_stream_in_one_read_comes_out_whole_first_part_first(framing):
    """Head and 800 events in one write (a zero-delay engine's whole reply): the first part of that read is
    parsed before the rest, and nothing is lost or reordered, also when the engine closes right after."""
    events = [b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i for i in range(800)] + [b"data: [DONE]\n\n"]
    if framing == "chunked":
        reply = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")
    else:
        reply = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + b"".join(events)
    assert len(reply) > 4 * 4096

    async def handler(reader, writer):
        for _ in range(2 if framing == "chunked" else 1):
            await read_request(reader)
            writer.write(reply)  # one write: one read on the gateway's side
            await writer.drain()
        writer.close()

    server, url = await raw_server(handler)
    p = pool(url)
    try:
        for _ in range(2 if framing == "chunked" else 1):
            r = await p.request("POST", "/x", {}, b"{}", 5)
            first = await anext(r.iter_chunks())
            assert first.startswith(events[0]) and len(first) <= 4096
            rest = b"".join([c async for c in r.iter_chunks()])
            assert first + rest == b"".join(events)
            r.close()
        if framing == "chunked":
            assert p.idle and p.idle[0].used == 2, "the connection was reused after the split read"
    finally:
        p.close()
        server.close()


async def test_stale_keepalive_connection_is_retried_on_a_fresh_one():
    served = []

    async def handler(reader, writer):
        await read_request(reader)
        served.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # closes the keep-alive connection right after answering

    server, url = await raw_server(handler)
    async with server:
        p = pool(url)
        for _ in range(3):
            r = await p.request("POST", "/x", {}, b"{}", 5)
            assert await r.read(1 << 20) == b"ok"
            r.close()
        assert len(served) == 3
        p.close()


async def test_until_close_body_and_connection_refused():
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    server, url = await raw_server(handler)
    async with server:
        p = pool(url)
        r = await p.request("POST", "/x", {}, b"", 5)
        assert await r.read(1 << 20) == b"all of it"
        r.close()
        assert not p.idle
    with pytest.raises(UpstreamConnectError):
        await pool(f"http://127.0.0.1:{free_port()}").request("POST", "/x", {}, b"", 5)


async def test_disconnect_mid_body_and_idle_timeout():
    async def cut(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.transport.abort()

    server, url = await raw_server(cut)
    async with server:
        p = pool(url)
        r = await p.request("POST", "/x", {}, b"", 5)
        with pytest.raises(UpstreamDisconnected):
            await r.read(1 << 20)
        r.close()

    writers = []

    async def stall(reader, writer):
        writers.append(writer)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()

    server, url = await raw_server(stall)
    async with server:
        p = pool(url, idle=0.2)
        r = await p.request("POST", "/x", {}, b"", 5)
        chunks = r.iter_chunks()
        assert await chunks.__anext__() == b"abc"
        with pytest.raises(TimeoutError):
            await chunks.__anext__()
        r.close()
        assert p.in_use == 0, "every slot given back"
        for w in writers:
            w.close()


async def test_the_idle_timeout_counts_from_each_wait_not_from_the_first():
    # One timer serves all of a stream's waits: bytes that keep coming, each within the idle timeout, never time
    # out however long the stream lasts; a stall after them does, and a closed reply leaves no timer behind.
    writers = []

    async def trickle(reader, writer):
        writers.append(writer)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(6):
            await asyncio.sleep(0.12)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()

    server, url = await raw_server(trickle)
    async with server:
        p = pool(url, idle=0.3)
        r = await p.request("POST", "/x", {}, b"", 5)
        got = b""
        with pytest.raises(TimeoutError):
            while True:
                chunk = await r.next_chunk()
                assert chunk is not None
                got += chunk
        assert got == b"x" * 6  # 0.72 s of bytes, more than twice the idle timeout, then the stall
        r.close()
        assert r._idle_timer is None
        for w in writers:
            w.close()


async def _pieces_server(n: int, gap: float):
    """An engine writing n one-byte chunked pieces ("0", "1", ...) `gap` seconds apart, then the end."""
    writers = []

    async def pieces(reader, writer):
        writers.append(writer)
        try:
            while await read_request(reader):  # one request after another on a keep-alive connection
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i in range(n):
                    await asyncio.sleep(gap)
                    writer.write(b"1\r\n%d\r\n" % i)
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the client closed the connection

    server, url = await raw_server(pieces)
    return server, url, writers


async def test_a_sink_takes_pieces_as_they_come_and_what_it_leaves_keeps_its_place():
    # A piece the sink takes goes nowhere else, and it counts as the engine sending something: a consumer whose
    # own wait lasts longer than the idle timeout (pieces 3 and 4 taken) is not timed out. One the sink leaves
    # waits for next_chunk, and every later piece queues behind it, sink or not.
    server, url, writers = await _pieces_server(8, 0.12)
    async with server:
        p = pool(url, idle=0.3)
        r = await p.request("POST", "/x", {}, b"", 5)
        taken: list[bytes] = []
        r.hand_to(lambda d: int(d) % 3 != 2 and not taken.append(d))
        left = [c async for c in r.iter_chunks()]
        assert taken == [b"0", b"1", b"3", b"4", b"6", b"7"] and left == [b"2", b"5"]
        r.close()
        assert p.in_use == 0 and len(p.idle) == 1, "a whole reply frees its connection for the next request"

        r = await p.request("POST", "/x", {}, b"", 5)
        taken.clear()
        r.hand_to(lambda d: d != b"2" and not taken.append(d))
        await asyncio.sleep(1.3)  # the whole reply arrives before the consumer looks
        assert taken == [b"0", b"1"] and [c async for c in r.iter_chunks()] == [b"2", b"3", b"4", b"5", b"6", b"7"]
        r.close()
        for w in writers:
            w.close()


async def test_a_sink_that_fails_fails_the_consumer_and_drops_the_connection():
    server, url, writers = await _pieces_server(4, 0.05)
    async with server:
        p = pool(url)
        r = await p.request("POST", "/x", {}, b"", 5)

        def sink(data: bytes) -> bool:
            if data == b"1":
                raise KeyError("the consumer's own bug")
            return True

        r.hand_to(sink)
        with pytest.raises(KeyError):
            await r.next_chunk()
        r.close()
        assert p.in_use == 0 and not p.idle, "an unfinished reply's connection is never reused"
        for w in writers:
            w.close()


async def test_a_wait_with_its_own_deadline_ends_there_and_the_idle_timeout_still_holds_after():
    # A stream's first byte has a deadline sooner than the idle timeout (next_chunk(by)): the wait ends there.
    server, url, writers = await _pieces_server(3, 0.5)
    async with server:
        p = pool(url, idle=5.0)
        r = await p.request("POST", "/x", {}, b"", 5)
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await r.next_chunk(loop.time() + 0.2)
        assert time.monotonic() - t0 < 0.45, "the first piece comes at 0.5 s: the deadline ended the wait before it"
        r.close()
        assert not p.idle and p.in_use == 0
        r = await p.request("POST", "/x", {}, b"", 5)
        assert await r.next_chunk(loop.time() + 3) == b"0"  # in time: the later waits have the idle timeout
        assert [c async for c in r.iter_chunks()] == [b"1", b"2"]
        r.close()
        for w in writers:
            w.close()


async def test_a_stream_does_not_keep_its_head_timer_and_a_whole_reply_leaves_it_for_the_next_request():
    server, url, writers = await _replying([(0.0, OK_REPLY), (0.0, STREAM_HEAD)])
    async with server:
        p = pool(url)
        r = await p.request("POST", "/x", {}, b"", 30)
        conn = r._conn
        assert await r.read(10) == b"ok" and conn._head_timer is not None  # lapses at its time, or serves the next
        r.close()
        r = await p.request("POST", "/x", {}, b"", 30)
        assert r._conn is conn and conn._head_timer is None, "a stream holds no timer for its head once it came"
        r.close()
        for w in writers:
            w.close()


async def test_head_timeout_aborts_connection():
    e = await FakeEngine(Knobs(hang=True)).start()
    try:
        p = pool(e.url)
        with pytest.raises(TimeoutError):
            await p.request("POST", "/v1/chat/completions", {}, b'{"model":"m"}', 0.2)
        deadline = time.monotonic() + 5
        while e.knobs.aborted != 1:  # the engine sees the connection go and cancels the request
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert not p.idle and p.in_use == 0
    finally:
        await e.stop()


OK_REPLY = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


async def _replying(replies: list[tuple[float | None, bytes]]):
    """An engine answering the i-th request on a connection with replies[i]: (delay in seconds, None: never; bytes)."""
    writers = []

    async def answer(reader, writer):
        writers.append(writer)
        try:
            for delay, reply in replies:
                await read_request(reader)
                if delay is None:
                    await asyncio.sleep(3600)
                await asyncio.sleep(delay)
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    server, url = await raw_server(answer)
    return server, url, writers


@pytest.mark.parametrize("case", ["sooner deadline", "later deadline", "after a lapse"])
async def test_each_request_on_a_connection_keeps_its_own_head_deadline(case):
    # One timer serves the requests of a keep-alive connection one after another (Connection._head_check). Whatever
    # the deadlines of the requests before, each reply head is awaited until its own deadline and no longer.
    first_timeout, second_timeout, second_delay = {
        "sooner deadline": (30.0, 0.3, None),  # the timer, set for 30 s, is set again for 0.3 s
        "later deadline": (0.3, 1.5, 0.6),  # the timer fires at 0.3 s with a head awaited that is due later
        "after a lapse": (0.3, 0.3, None),  # the timer fired with nothing awaited and lapsed; it is set again
    }[case]
    server, url, writers = await _replying([(0.0, OK_REPLY), (second_delay, OK_REPLY)])
    async with server:
        p = pool(url)
        r = await p.request("POST", "/x", {}, b"", first_timeout)
        assert await r.read(10) == b"ok"
        r.close()
        if case == "after a lapse":
            await asyncio.sleep(0.5)
        assert len(p.idle) == 1
        t0 = time.monotonic()
        if second_delay is None:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(p.request("POST", "/x", {}, b"", second_timeout), 5)
            assert time.monotonic() - t0 < 2, "timed out by the request's own deadline, not the outer guard"
            assert not p.idle and p.in_use == 0, "a timed-out connection is never reused"
        else:
            r = await p.request("POST", "/x", {}, b"", second_timeout)
            assert await r.read(10) == b"ok" and time.monotonic() - t0 >= second_delay
            r.close()
        for w in writers:
            w.close()


@pytest.mark.parametrize("name,value", [("x-request-id", "a\r\nGET / HTTP/1.1"), ("x-request-id", "a\nb"),
                                        ("traceparent", "a\rb"), ("x-a", "a\x00b"), ("x\r\nInjected", "v")])
async def test_a_header_field_with_a_line_end_is_never_written(name, value):
    """The last guard against smuggling: whatever reaches the client code, no CR, LF or NUL of a field goes on
    the wire, and the request is refused before a byte of it is written."""
    received = []

    async def handler(reader, writer):
        received.append(await reader.read(65536))
        writer.close()

    server, url = await raw_server(handler)
    async with server:
        p = pool(url)
        with pytest.raises(ValueError):
            await p.request("POST", "/x", {"Content-Type": "application/json", name: value}, b"{}", 2)
        assert p.in_use == 0
        await asyncio.sleep(0.1)
        assert received in ([], [b""]), "nothing was written"
        p.close()


async def test_pool_limit_bounds_requests_to_all_engines_together():
    gate = asyncio.Event()
    es = [await FakeEngine(Knobs(gate=gate)).start() for _ in range(2)]
    cfg = gateway_config([{"id": f"e{i}", "engine": "vllm", "url": e.url, "models": ["m"]} for i, e in enumerate(es)],
                         upstream={"pool_limit": 2}, routing={"policy": "round_robin"})
    gw = await start_gateway(cfg)
    try:
        async with aiohttp.ClientSession() as s:
            async def one():
                async with s.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {USER_KEY}"},
                                  json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                        "max_tokens": 2}) as r:
                    return r.status
            tasks = [asyncio.create_task(one()) for _ in range(4)]
            held = lambda: sum(e.knobs.active for e in es)  # noqa: E731
            deadline = time.monotonic() + 5
            while held() < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            # Watch for a while: the other two wait for a slot instead of reaching an engine.
            seen = 0
            for _ in range(30):
                seen = max(seen, held())
                await asyncio.sleep(0.01)
            gate.set()
            assert await asyncio.gather(*tasks) == [200] * 4
            assert seen == 2 and sum(len(e.knobs.seen) for e in es) == 4
    finally:
        await gw.stop()
        for e in es:
            await e.stop()
