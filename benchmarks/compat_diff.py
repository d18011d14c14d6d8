"""Replies to the same compatibility probe, straight from an engine and through the gateway, compared field by field
and event by event (ids and clock times aside)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from benchmarks import kit

# Reply fields that differ between any two requests (ids, clock seconds): left out of the comparison.
VOLATILE = {"id", "created", "created_at", "completed_at", "item_id", "call_id"}
# Response headers of the connection rather than the reply.
TRANSPORT = {"date", "server", "content-length", "transfer-encoding", "connection", "keep-alive"}

def sse_events(text: str) -> list[tuple[str, Any]]:
    """(event name, data: parsed JSON where it parses) of each event of an SSE body."""
    out = []
    for frame in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in frame.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip() or "message"
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if data:
            raw = "\n".join(data)
            try:
                out.append((name, json.loads(raw)))
            except ValueError:
                out.append((name, raw))
    return out


def json_diff(a: Any, b: Any, path: str = "") -> list[tuple[str, str, Any, Any]]:
    """(kind, path, direct, gateway) for each place where b differs from a; VOLATILE members are not compared. A
    member missing on one side is reported once, whatever it holds."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in [*a, *(k for k in b if k not in a)]:
            if k in VOLATILE:
                continue
            p = f"{path}.{k}" if path else k
            if k not in b:
                out.append(("absent through the gateway", p, a[k], None))
            elif k not in a:
                out.append(("added by the gateway", p, None, b[k]))
            else:
                out += json_diff(a[k], b[k], p)
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = [("length", path, len(a), len(b))] if len(a) != len(b) else []
        for i, (x, y) in enumerate(zip(a, b)):
            out += json_diff(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [("value", path, a, b)]


def _body(text: str, streamed: bool) -> Any:
    if streamed:
        return sse_events(text)
    try:
        return json.loads(text)
    except ValueError:
        return text


def compare_exchange(d: dict, g: dict) -> dict:
    """How the gateway's reply differs from the engine's to the same request: status, content type, headers the
    engine sent and the gateway did not (and those the gateway adds), and the body's differences. A streamed
    body is compared event by event: each difference is listed once with the events it was found in."""
    out: dict = {"request_same": d.get("requestBody") == g.get("requestBody"), "differences": []}
    if "error" in d or "error" in g:
        out["differences"].append({"kind": "transport", "path": "", "direct": d.get("error"),
                                   "gateway": g.get("error"), "events": []})
        return out
    diffs: dict[tuple, dict] = {}

    def note(kind: str, path: str, a: Any, b: Any, event: int | None = None) -> None:
        entry = diffs.setdefault((kind, path, json.dumps(a, default=str), json.dumps(b, default=str)),
                                 {"kind": kind, "path": path, "direct": a, "gateway": b, "events": []})
        if event is not None:
            entry["events"].append(event)

    if d["status"] != g["status"]:
        note("status", "", d["status"], g["status"])
    dh, gh = d.get("headers", {}), g.get("headers", {})
    if dh.get("content-type") != gh.get("content-type"):
        note("content type", "", dh.get("content-type"), gh.get("content-type"))
    out["headers_dropped"] = sorted(h for h in dh if h not in gh and h not in TRANSPORT)
    out["headers_added"] = sorted(h for h in gh if h not in dh and h not in TRANSPORT)
    streamed = "text/event-stream" in dh.get("content-type", "")
    a, b = _body(d.get("body", ""), streamed), _body(g.get("body", ""), streamed)
    if streamed and isinstance(b, list):
        out["events"] = [len(a), len(b)]
        if len(a) != len(b):
            note("event count", "", len(a), len(b))
        for i, ((an, ad), (bn, bd)) in enumerate(zip(a, b)):
            if an != bn:
                note("event name", "", an, bn, i)
            for kind, path, x, y in json_diff(ad, bd):
                note(kind, path, x, y, i)
    else:
        for kind, path, x, y in json_diff(a, b):
            note(kind, path, x, y)
    out["differences"] = list(diffs.values())
    return out


def replay_with_usage(ex: dict) -> dict | None:
    """A streamed chat request of the scanner's that did not ask for usage, sent to the engine directly again with
    `stream_options.include_usage` (as the gateway sends it, for its own token count): the top-level members of
    the usage chunk (no choices, usage set) and those of the other chunks. None for any other request."""
    try:
        body = json.loads(ex.get("requestBody") or "")
    except ValueError:
        return None
    opts = body.get("stream_options") if isinstance(body, dict) else None
    if (not isinstance(body, dict) or body.get("stream") is not True or "messages" not in body
            or (isinstance(opts, dict) and opts.get("include_usage") is True)):
        return None
    body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    req = urllib.request.Request(ex["url"], data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {kit.KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [data for _, data in sse_events(r.read().decode()) if isinstance(data, dict)]
    except (OSError, ValueError):
        return None
    usage = [e for e in events if e.get("choices") == [] and e.get("usage") is not None]
    return {"usage_chunk_members": sorted({k for e in usage for k in e}),
            "other_chunk_members": sorted({k for e in events if e not in usage for k in e})}


def compare_runs(direct: dict, gateway: dict) -> list[dict | None]:
    """Per probe (the scanner makes one request per probe, in its order): the comparison of the two replies, or
    None where the two scans' requests cannot be paired."""
    dx, gx, n = direct["exchanges"], gateway["exchanges"], len(direct["results"])
    if len(dx) != n or len(gx) != n:
        return [None] * n
    return [compare_exchange(a, b) for a, b in zip(dx, gx)]
