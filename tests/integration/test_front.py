"""The gateway's own HTTP/1.1 front, on the wire: keep-alive, pipelining, 100-continue, split bodies, limits,
half-close, idle connections, and what it hands to aiohttp (other routes, HTTP/1.0, chunked bodies)."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest

from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import USER_KEY, gateway_config, start_gateway
from tests.kit import until

BODY = orjson.dumps({"model": "m2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def post(body: bytes = BODY, path: str = "/v1/chat/completions", extra: str = "", version: str = "1.1",
         length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nAuthorization: Bearer {USER_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {n}\r\n{extra}\r\n").encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response off the wire: Content-Length, chunked, or until the connection closes."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            parts.append(await reader.readexactly(size + 2))
            if size == 0:
                break
        body = b"".join(p[:-2] for p in parts)
    else:
        body = await reader.read()
    return status, headers, body


@pytest.fixture
async def conn(gateway):
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    yield reader, writer
    writer.close()


async def test_keep_alive_and_pipelined_requests_answer_in_order(conn):
    reader, writer = conn
    ids = [f"pipelined-{i}" for i in range(3)]
    writer.write(b"".join(post(extra=f"x-request-id: {i}\r\n") for i in ids))  # three requests in one write
    for i in ids:
        status, headers, body = await read_response(reader)
        assert status == 200 and headers["x-request-id"] == i
        assert orjson.loads(body)["model"] == "m2"
        assert "connection" not in headers  # still open
    writer.write(post())
    assert (await read_response(reader))[0] == 200


async def test_body_split_across_packets_and_expect_continue(conn):
    reader, writer = conn
    writer.write(post(extra="Expect: 100-continue\r\n")[:-len(BODY)])
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert interim.startswith(b"HTTP/1.1 100")
    for i in range(0, len(BODY), 7):  # the body in small pieces
        writer.write(BODY[i:i + 7])
        await writer.drain()
        await asyncio.sleep(0.005)
    status, _, body = await read_response(reader)
    assert status == 200 and orjson.loads(body)["choices"]


async def test_large_body_in_one_burst_then_a_pipelined_request(conn):
    """A body of several MB written at once (more than is ever buffered for pipelined requests) is read
    whole, and the request behind it on the same connection is served next."""
    reader, writer = conn
    big = orjson.dumps({"model": "m2", "messages": [{"role": "user", "content": "x" * 3_000_000}],
                        "max_tokens": 2})
    writer.write(post(big) + post())
    for _ in range(2):
        status, _, body = await read_response(reader)
        assert status == 200 and orjson.loads(body)["model"] == "m2"


async def test_query_string_and_connection_close(conn):
    reader, writer = conn
    writer.write(post(path="/v1/chat/completions?trace=1", extra="Connection: close\r\n"))
    status, headers, _ = await read_response(reader)
    assert status == 200 and headers.get("connection") == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the gateway closed it


async def test_too_large_body_is_refused_unread_and_the_connection_ends(gateway, conn):
    reader, writer = conn
    limit = gateway.state.cfg.server.max_body_bytes
    writer.write(post(b"{", length=limit + 1))  # announces more than the limit, sends one byte
    status, headers, body = await read_response(reader)
    assert status == 413 and orjson.loads(body)["error"]["code"] == "request_too_large"
    assert headers.get("connection") == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""


async def test_refused_request_with_its_whole_body_keeps_the_connection(conn):
    reader, writer = conn
    bad = post().replace(f"Bearer {USER_KEY}".encode(), b"Bearer sk-wrong")
    writer.write(bad + post())  # a 401 whose body was sent, then a good request on the same connection
    status, headers, body = await read_response(reader)
    assert status == 401 and orjson.loads(body)["error"]["type"] == "authentication_error"
    assert "connection" not in headers
    assert (await read_response(reader))[0] == 200


async def test_a_client_that_closes_its_side_has_left():
    """End of input from the client ends its request, like a disconnect (as aiohttp treats it): the
    engine's request is aborted at once, not after later writes bounce."""
    slow = await FakeEngine(Knobs(chunk_delay=0.05, stream_chunks=200)).start()
    gw = await start_gateway(gateway_config([{"id": "s", "engine": "vllm", "url": slow.url, "models": ["m2"]}]))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        body = orjson.dumps({"model": "m2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                             "stream": True})
        writer.write(post(body))
        await asyncio.wait_for(reader.readuntil(b"data: "), 5)  # the stream has started
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 5)  # the gateway closes the connection
        writer.close()
        for _ in range(100):
            if slow.knobs.aborted:
                break
            await asyncio.sleep(0.01)
        assert slow.knobs.aborted == 1 and gw.state.pool.get("s").in_flight == 0
    finally:
        await gw.stop()
        await slow.stop()


async def test_stream_is_chunked_and_ends_with_done(conn):
    reader, writer = conn
    body = orjson.dumps({"model": "m2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                         "stream": True})
    writer.write(post(body))
    status, headers, data = await read_response(reader)
    assert status == 200 and headers["content-type"] == "text/event-stream"
    events = [e for e in data.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) >= 5
    writer.write(post())  # the connection is reusable after a stream
    assert (await read_response(reader))[0] == 200


@pytest.mark.parametrize("request_bytes,expected", [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + USER_KEY.encode() + b"\r\n\r\n", 200),
    (b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n", 200),
    (b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 404),
    (b"BROKEN\r\n\r\n", 400),
])
async def test_other_requests_are_served_by_aiohttp_on_the_same_connection(conn, request_bytes, expected):
    reader, writer = conn
    writer.write(request_bytes)
    status, _, body = await read_response(reader)
    assert status == expected
    if status in (404, 405):
        assert orjson.loads(body)["error"]["code"] in ("not_found", "method_not_allowed")
    if status != 400:  # after a hand-over, API requests on that connection still work
        writer.write(post())
        status, _, body = await read_response(reader)
        assert status == 200 and orjson.loads(body)["model"] == "m2"


async def test_http10_and_chunked_request_bodies_are_served(conn, gateway):
    reader, writer = conn
    writer.write(post(version="1.0"))
    status, _, body = await read_response(reader)
    assert status == 200 and orjson.loads(body)["model"] == "m2"
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    chunked = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {USER_KEY}\r\n"
               f"Transfer-Encoding: chunked\r\n\r\n").encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    writer.write(chunked)
    status, _, body = await read_response(reader)
    assert status == 200 and orjson.loads(body)["model"] == "m2"
    writer.close()


async def test_idle_connections_are_closed_after_keepalive(engines):
    cfg = gateway_config([{"id": "e", "engine": "vllm", "url": engines[0].url, "models": ["m2"]}],
                         server={"access_log": False, "keepalive_s": 0.3, "head_timeout_s": 0.3})
    gw = await start_gateway(cfg)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(post())
        assert (await read_response(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed once idle for 0.3 s
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(post()[:20])  # a head that never completes
        status, headers, body = await read_response(reader)
        assert status == 408 and headers["connection"] == "close"
        assert orjson.loads(body)["error"]["code"] == "request_timeout"
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)  # a connection that says nothing
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await gw.stop()


async def test_mangled_requests_never_break_the_server(gateway):
    """Random damage to a valid request: every connection gets an answer or a close, and the server
    keeps serving."""
    rng = random.Random(7)
    good = post()
    for _ in range(150):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(data))
            op = rng.random()
            if op < 0.4:
                data[i] = rng.choice(b"\r\n :\x00\xb2\xff0123456789abcXYZ")
            elif op < 0.7:
                del data[i:i + rng.randint(1, 8)]
            else:
                data[i:i] = rng.choice([b"\r\n", b"Content-Length: 99999999999\r\n", b"\xb2", b" ", b":", b"\r\n\r\n"])
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        writer.write(bytes(data))
        writer.write_eof()
        try:
            reply = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
        assert reply == b"" or reply.startswith(b"HTTP/1.")
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(post())
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_engine_breaking_after_done_leaves_one_clean_ending():
    """The engine sends [DONE], then drops the connection before ending its chunked body: the client's
    stream still ends exactly once, and its connection stays usable."""
    event = orjson.dumps({"id": "x", "object": "chat.completion.chunk", "model": "m2",
                          "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]})

    async def engine(reader, writer):
        try:
            await serve(reader, writer)
        finally:
            writer.close()

    async def serve(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            if head.startswith(b"GET"):  # health and load probes
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                continue
            n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
            body = orjson.loads(await reader.readexactly(n))
            if body.get("stream"):
                data = b"data: " + event + b"\n\ndata: [DONE]\n\n"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
                return  # the connection closes with no terminating chunk
            reply = orjson.dumps({"id": "y", "object": "chat.completion", "model": "m2", "choices": []})
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(reply), reply))
            await writer.drain()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    gw = await start_gateway(gateway_config([{"id": "e", "engine": "vllm", "url": url, "models": ["m2"]}]))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        stream = orjson.dumps({"model": "m2", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        writer.write(post(stream))
        status, _, data = await read_response(reader)
        assert status == 200 and data.count(b"data: [DONE]") == 1 and data.endswith(b"data: [DONE]\n\n")
        writer.write(post())
        status, _, body = await read_response(reader)
        assert status == 200 and orjson.loads(body)["model"] == "m2"
        writer.close()
    finally:
        await gw.stop()
        server.close()


@pytest.mark.parametrize("ending", ["idle", "client closes", "malformed next"])
async def test_one_task_serves_a_connection_and_ends_with_it(engines, ending):
    cfg = gateway_config([{"id": "e", "engine": "vllm", "url": engines[0].url, "models": ["m2"]}],
                         server={"access_log": False, "keepalive_s": 0.3})
    gw = await start_gateway(cfg)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(post())
        assert (await read_response(reader))[0] == 200
        (c,) = gw.front.conns
        task = c.task
        assert task is not None and not task.done()  # waiting for the next request
        writer.write(post())
        assert (await read_response(reader))[0] == 200
        assert c.task is task  # the same task took the second request
        if ending == "idle":
            assert await asyncio.wait_for(reader.read(), 5) == b""
        elif ending == "client closes":
            writer.close()
        else:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
            assert (await read_response(reader))[0] == 400
        # (after a refusal, before the connection closes: no request follows; the task ends in the loop turn after
        # its connection)
        await until(task.done, "the connection's task done")
        writer.close()
    finally:
        await gw.stop()
