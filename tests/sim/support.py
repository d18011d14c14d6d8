"""Request bodies, SSE parsing and /metrics scraping for the simulator tests."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families


def chat_body(text: str = "Say something short.", **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], **extra}


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """Events of an SSE body: decoded JSON objects, or the string "[DONE]"."""
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def content_of(events: list[Any]) -> str:
    """Concatenated content (chat delta or text) of stream events."""
    out = []
    for event in events:
        if not isinstance(event, dict):
            continue
        for choice in event.get("choices", []):
            delta = choice.get("delta")
            piece = delta.get("content") if delta is not None else choice.get("text")
            if piece:
                out.append(piece)
    return "".join(out)


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """/metrics parsed with prometheus_client: family name -> family."""
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], family: str, sample_name: str | None = None,
           **labels: str) -> float:
    """The value of one sample of a family (first match on the given labels)."""
    for s in families[family].samples:
        if (sample_name is None or s.name == sample_name) and all(
                s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{family} {sample_name} {labels}")


async def read_events(resp: aiohttp.ClientResponse) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) pairs of an SSE body with `event:` lines (Responses, Messages)."""
    out: list[tuple[str | None, Any]] = []
    name = None
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            out.append((name, orjson.loads(line[len("data: "):])))
            name = None
    return out
