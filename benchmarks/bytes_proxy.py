"""The least a Python process can spend per proxied request: bytes passed on unread, uvloop, one upstream each."""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import uvloop


class Upstream(asyncio.Protocol):
    """The engine's side of one client connection: whatever it sends goes to the client as it comes."""

    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class Client(asyncio.Protocol):
    """One client connection, tied to one engine connection opened when it arrives. Nothing is parsed, checked
    or bounded: a reference for cost only, never a proxy to serve anyone."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream_addr = upstream
        self.upstream: asyncio.Transport | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports do not subclass asyncio's)
        asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        self.upstream, _ = await loop.create_connection(lambda: Upstream(self.transport), *self.upstream_addr)
        for data in self.early:
            self.upstream.write(data)
        self.early = []

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.early.append(data)
        else:
            self.upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


async def serve(port: int, upstream: tuple[str, int]) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: Client(upstream), "127.0.0.1", port)
    await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream-port", type=int, required=True)
    args = ap.parse_args()
    uvloop.run(serve(args.port, ("127.0.0.1", args.upstream_port)))


if __name__ == "__main__":
    main()
