"""The least a Python gateway that reads what it routes can spend per request: llhttp on both sides, the key
checked, the body's JSON parsed, a reply head of its own; uvloop protocol callbacks, and with --tasks a task per
request that awaits the engine's reply (the coroutine style's own cost)."""

from __future__ import annotations

import argparse
import asyncio
import socket
from typing import cast

import httptools
import orjson
import uvloop

STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _reply(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
        status, len(body), body)


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Upstream(asyncio.Protocol):
    """The engine's side of one client connection: its reply parsed by llhttp; a stream relayed read by read,
    re-framed; a whole reply sent on with a head of the proxy's own."""

    def __init__(self, client: "Client") -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.body: list[bytes] = []
        self.stream = False
        self.done: asyncio.Future | None = None  # --tasks: the request's task waits on it for the reply

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.client.fail()
            return
        if self.stream and self.body:  # all the events of one read as one chunk
            part = b"".join(self.body)
            self.body.clear()
            self.client.transport.write(b"%x\r\n%b\r\n" % (len(part), part))

    def on_headers_complete(self) -> None:
        self.stream = self.parser.get_status_code() == 200 and self.client.stream
        if self.stream:
            self.client.transport.write(STREAM_HEAD)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.stream:
            part = b"".join(self.body)
            self.body.clear()
            self.client.transport.write((b"%x\r\n%b\r\n" % (len(part), part) if part else b"") + b"0\r\n\r\n")
            reply = None
        else:
            reply = _reply(self.parser.get_status_code(), b"".join(self.body))
            self.body.clear()
        done, self.done = self.done, None
        if done is not None:
            done.set_result(reply)  # the request's task writes it
        elif reply is not None:
            self.client.transport.write(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.fail()


class Client(asyncio.Protocol):
    """One client connection, tied to one engine connection (engines taken in turn, connection by connection).
    A reference for cost only: one request at a time, no limits or timeouts; never a proxy to serve anyone."""

    def __init__(self, engine: tuple[str, int], auth: bytes, tasks: bool) -> None:
        self.engine = engine
        self.auth = auth
        self.tasks = tasks
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.upstream: Upstream | None = None
        self.waiting: bytes | None = None  # a request that came before the engine connection was up
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.url = b""
        self.stream = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        _nodelay(transport)
        asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        _, self.upstream = await loop.create_connection(lambda: Upstream(self), *self.engine)
        if self.waiting is not None:
            self._send(self.waiting)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(_reply(400, b'{"error": {"message": "malformed request"}}'))
            self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        headers, body = self.headers, b"".join(self.body)
        self.headers, self.body = {}, []
        if self.tasks:
            asyncio.get_running_loop().create_task(self._handle(headers, body))
        else:
            self._route(headers, body)

    async def _handle(self, headers: dict[bytes, bytes], body: bytes) -> None:
        upstream = self._route(headers, body)
        if upstream is not None:
            upstream.done = done = asyncio.get_running_loop().create_future()
            reply = await done
            if reply is not None:
                self.transport.write(reply)

    def _route(self, headers: dict[bytes, bytes], body: bytes) -> Upstream | None:
        """Check the request and send it on: the engine's side it went to (None: answered here already)."""
        if self.parser.get_method() == b"GET":
            self.transport.write(_reply(200, b"{}"))  # its own liveness: every GET
            return None
        if headers.get(b"authorization") != self.auth:
            self.transport.write(_reply(401, b'{"error": {"message": "invalid API key"}}'))
            return None
        try:
            req = orjson.loads(body)
        except orjson.JSONDecodeError:
            self.transport.write(_reply(400, b'{"error": {"message": "invalid JSON"}}'))
            return None
        if not isinstance(req, dict) or not isinstance(req.get("model"), str):
            self.transport.write(_reply(400, b'{"error": {"message": "no model"}}'))
            return None
        self.stream = req.get("stream") is True
        head = b"POST %b HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
            self.url, self.engine[0].encode(), self.engine[1], len(body))
        if self.upstream is None or self.upstream.transport is None:
            self.waiting = head + body
        else:
            self._send(head + body)
        return self.upstream

    def on_message_begin(self) -> None:
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url  # (a long target may come in pieces)

    def _send(self, request: bytes) -> None:
        assert self.upstream is not None and self.upstream.transport is not None
        self.waiting = None
        self.upstream.transport.write(request)

    def fail(self) -> None:
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()


async def serve(port: int, engines: list[tuple[str, int]], key: str, tasks: bool) -> None:
    turn = iter(range(1 << 62))
    auth = b"Bearer " + key.encode()
    server = await asyncio.get_running_loop().create_server(
        lambda: Client(engines[next(turn) % len(engines)], auth, tasks), "127.0.0.1", port, backlog=1024)
    await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine", action="append", required=True, help="http://host:port (repeat for several)")
    ap.add_argument("--key", required=True, help="the one API key it accepts (Authorization: Bearer KEY)")
    ap.add_argument("--tasks", action="store_true", help="a task per request, awaiting the engine's reply")
    args = ap.parse_args()
    engines = []
    for url in args.engine:
        host, _, port = url.removeprefix("http://").partition(":")
        engines.append((host, int(port)))
    uvloop.run(serve(args.port, engines, args.key, args.tasks))


if __name__ == "__main__":
    main()
