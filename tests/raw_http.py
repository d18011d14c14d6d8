"""Raw HTTP for hostile-client tests: requests written byte by byte, replies read off the wire, a gateway rig."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import orjson

from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import (USER_KEY, RunningGateway, gateway_config, start_gateway)

KEY = USER_KEY.encode()
# Prompts that tell the engine's requests apart: which request of a test, if any, reached it.
WARMUP, AFTER, OUTER = "warmup-prompt", "after-prompt", "outer-prompt"
PIPELINED, SMUGGLED = "pipelined-prompt", "smuggled-prompt"
ERROR_FIELDS = {"message", "type", "param", "code"}
BAD = "bad_http_request"


# -- building requests byte by byte ------------------------------------------------------------------
def chat(prompt: str, **extra) -> bytes:
    return orjson.dumps({"model": "m2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 3, **extra})


def req(*lines: bytes, body: bytes = b"", start: bytes = b"POST /v1/chat/completions HTTP/1.1") -> bytes:
    """A request exactly as written: the start line, header lines, CRLF line ends, the body."""
    return start + b"\r\n" + b"".join(ln + b"\r\n" for ln in lines) + b"\r\n" + body


HOST, AUTH, CT = b"Host: x", b"Authorization: Bearer " + KEY, b"Content-Type: application/json"
CHUNKED_HEAD = req(HOST, AUTH, CT, b"Transfer-Encoding: chunked")


def cl(n: int) -> bytes:
    return b"Content-Length: %d" % n


def post(prompt: str, *extra: bytes, version: bytes = b"1.1") -> bytes:
    body = chat(prompt)
    return req(HOST, AUTH, CT, cl(len(body)), *extra, body=body,
               start=b"POST /v1/chat/completions HTTP/" + version)


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)


SMUG = post(SMUGGLED)  # a whole request hidden in another: the engine seeing its prompt is a smuggled request
END_SMUG = b"0\r\n\r\n" + SMUG  # a chunked body that ends at once, then SMUG: its length as a Content-Length


def te_cl(te_line: bytes, *, start: bytes = b"POST /v1/chat/completions HTTP/1.1", first: bytes | None = None) -> bytes:
    """The classic desync: a Transfer-Encoding (obfuscated) beside a Content-Length that covers SMUG. A
    server reading the length passes SMUG on as body; one reading the chunks runs SMUG as the next request."""
    lines = (first, HOST, AUTH, CT) if first is not None else (HOST, AUTH, CT)
    return req(*lines, cl(len(END_SMUG)), te_line, body=END_SMUG, start=start)


def te_only(*te_lines: bytes, start: bytes = b"POST /v1/chat/completions HTTP/1.1") -> bytes:
    """A Transfer-Encoding without Content-Length, carrying a chunked body and SMUG behind it."""
    return req(HOST, AUTH, CT, *te_lines, body=chunked(chat(OUTER)) + SMUG, start=start)


def cl_body(*cl_lines: bytes) -> bytes:
    """Content-Length lines that are duplicated or malformed; the body is OUTER, then SMUG."""
    return req(HOST, AUTH, CT, *cl_lines, body=chat(OUTER) + SMUG)


def chunk_body(chunks: bytes) -> bytes:
    """A chunked request whose body framing is broken; SMUG follows."""
    return req(HOST, AUTH, CT, b"Transfer-Encoding: chunked", body=chunks + SMUG)


# -- reading replies ----------------------------------------------------------------------------------
class Reply(NamedTuple):
    status: int
    headers: dict[str, str]
    body: bytes


async def read_response(reader: asyncio.StreamReader, timeout: float = 10.0) -> Reply:
    """One response off the wire: interim (no body), Content-Length, chunked, or until the connection closes."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for k, _, v in (ln.partition(":") for ln in lines[1:] if ln):
        assert k.strip().lower() not in headers, f"the reply repeats {k}"
        headers[k.strip().lower()] = v.strip()
    if status < 200:
        return Reply(status, headers, b"")
    if "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout)
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout)).strip(), 16)
            parts.append(await asyncio.wait_for(reader.readexactly(size + 2), timeout))
            if size == 0:
                break
        body = b"".join(p[:-2] for p in parts)
    else:
        body = await asyncio.wait_for(reader.read(), timeout)
    return Reply(status, headers, body)


async def rest_of_connection(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Whatever the gateway still sends until it closes the connection (a reset counts as closed)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    except ConnectionResetError:
        return b""


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass  # the gateway reset it first: closed all the same


def assert_error(reply: Reply, status: int, code: str) -> None:
    assert reply.status == status, (reply.status, reply.body[:300])
    assert reply.headers.get("content-type") == "application/json"
    err = orjson.loads(reply.body)["error"]
    assert set(err) == ERROR_FIELDS and isinstance(err["message"], str) and isinstance(err["type"], str)
    assert err["code"] == code, err
    # Like every reply: a request id and why; no x-shapegate-backend (no backend was tried: never an empty header).
    assert reply.headers.get("x-request-id") and "x-shapegate-backend" not in reply.headers, reply.headers
    assert reply.headers.get("x-shapegate-reason"), reply.headers


def prompts(knobs: Knobs) -> list[str]:
    return [b["messages"][0]["content"] for b in knobs.seen]


# -- a gateway in front of one fake engine -----------------------------------------------------------
class Rig(NamedTuple):
    gw: RunningGateway
    engine: FakeEngine

    @property
    def pool(self):
        """The gateway's pooled connections to the engine (backends/http1.HostPool)."""
        return self.gw.state.pool.get("e").adapter._pool


async def rig(server: dict | None = None, knobs: Knobs | None = None) -> Rig:
    engine = await FakeEngine(knobs or Knobs()).start()
    try:
        gw = await start_gateway(gateway_config([{"id": "e", "engine": "vllm", "url": engine.url, "models": ["m2"]}],
                                                server={"access_log": False, **(server or {})}))
    except BaseException:
        await engine.stop()
        raise
    return Rig(gw, engine)


async def stop(r: Rig) -> None:
    await r.gw.stop()
    await r.engine.stop()


async def exchange(port: int, data: bytes) -> Reply:
    """One request on a new connection; its reply."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await read_response(reader)
    finally:
        await close(writer)


# ===================================================================================================
# 1. Requests the front must refuse: smuggling, broken framing, broken heads.
