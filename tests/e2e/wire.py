"""Raw HTTP/SSE helpers for talking to an engine byte-for-byte (no client library smoothing)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Reply:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class Stream:
    """A parsed SSE body: JSON events in order, whether `data: [DONE]` ended it, stray lines."""

    events: list[dict[str, Any]]
    done: bool
    other: list[str]

    @property
    def content_chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("choices")]


def parse_sse(raw: bytes) -> Stream:
    events: list[dict[str, Any]] = []
    other: list[str] = []
    done = False
    for block in raw.decode().split("\n\n"):
        for line in block.splitlines():
            if not line:
                continue
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(orjson.loads(line[len("data: "):]))
            else:
                other.append(line)
    return Stream(events, done, other)


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Reply:
    async with http.post(url, data=orjson.dumps(body), headers={"content-type": "application/json"}) as resp:
        return Reply(resp.status, resp.headers.get("content-type", ""), await resp.read())


async def get(http: aiohttp.ClientSession, url: str) -> Reply:
    async with http.get(url) as resp:
        return Reply(resp.status, resp.headers.get("content-type", ""), await resp.read())


async def metric_families(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    """Name -> family, parsed with prometheus_client's own text parser."""
    reply = await get(http, base + "/metrics")
    assert reply.status == 200, reply.body[:300]
    return {f.name: f for f in text_string_to_metric_families(reply.body.decode())}


def sample_value(families: dict[str, Any], family: str, sample: str | None = None) -> float:
    """Sum of a family's samples with the given sample name (labels, e.g. per-engine index, summed)."""
    fam = families[family]
    name = sample or fam.name
    return sum(s.value for s in fam.samples if s.name == name)


def chat_body(model: str, content: str = "Say something.", **extra: Any) -> dict[str, Any]:
    # explicit sampling: the engines' defaults differ (llama.cpp 0.8/top-k 40, vLLM 1.0)
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}],
                            "max_tokens": 8, "temperature": 0.7, "top_p": 1.0}
    body.update(extra)
    return body


def completion_body(model: str, prompt: str = "The gateway", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.7, "top_p": 1.0}
    body.update(extra)
    return body


def overlong_text(n_words: int = 6000) -> str:
    """Roughly 2 tokens per word in the tiny vocabulary: past both engines' limits (2,048 / 4,096)."""
    return " ".join("zq" for _ in range(n_words))


def new_session(**kwargs: Any) -> aiohttp.ClientSession:
    # force_close: the llama server may close a keep-alive connection after a stream, and a
    # reused connection then fails on its next write; raw tests want the engine's answer only.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=60), **kwargs)


async def raw_exchange(port: int, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[bytes, bool]:
    """One HTTP/1.1 request on a fresh socket; returns (head, whether the server then closed the connection)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        payload = orjson.dumps(body)
        writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)}
        if b"content-length" in headers:
            await reader.readexactly(int(headers[b"content-length"]))
        else:  # chunked: the terminating zero-length chunk ends the body
            await reader.readuntil(b"\r\n0\r\n\r\n")
        try:
            closed = await asyncio.wait_for(reader.read(1), timeout=1.0) == b""
        except TimeoutError:
            closed = False
        return head, closed
    finally:
        writer.close()
        await writer.wait_closed()


async def wait_quiet(http: aiohttp.ClientSession, base: str, running_gauge: str, timeout: float = 30.0) -> None:
    """Until the engine answers /metrics at once and runs nothing: a vLLM still busy with earlier work
    (an aborted stream's backlog) can leave /metrics unanswered for seconds, and a load test started
    then would see nothing of its own load."""
    loop_time = asyncio.get_running_loop().time
    deadline = loop_time() + timeout
    while True:
        started = loop_time()
        fams = await metric_families(http, base)
        if sample_value(fams, running_gauge) == 0 and loop_time() - started < 0.1:
            return
        if loop_time() > deadline:
            raise TimeoutError(f"{base} still busy after {timeout} s")
        await asyncio.sleep(0.1)
