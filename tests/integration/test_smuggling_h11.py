"""Request smuggling through the gateway to an engine whose parser is lenient (uvicorn on h11), on the wire."""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter

import orjson
import pytest
import uvicorn

from benchmarks.loopback import free_port
from tests.gateway_harness import USER_KEY, gateway_config, start_gateway
from tests.http_replies import parse_replies

ENGINE_KEY = "sk-engine-key-only-the-gateway-has"
KEY_ENV = "SHAPEGATE_TEST_H11_ENGINE_KEY"
SAFE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,200}")
TP = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
USER_AUTH = b"Bearer " + USER_KEY.encode()
CHAT = b"/v1/chat/completions"
SIZE = 200  # every hostile and smuggled body is padded to this length (the split attack needs equal lengths)
# What the gateway may put in the head of a completion it forwards; a smuggled header line would add another.
FORWARDED = {b"host", b"content-length", b"content-type", b"authorization", b"x-request-id", b"traceparent",
             b"tracestate"}


# -- the lenient engine ------------------------------------------------------------------------------
class H11Engine:
    """A minimal OpenAI-compatible ASGI engine on uvicorn's h11 parser that records every request it runs.

    Completions echo the last message ("echo:<prompt>"), so a client can tell its own answer from another's.
    """

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.port = free_port()
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.seen.append({"method": scope["method"], "path": scope["raw_path"], "headers": list(scope["headers"]),
                          "body": body, "client": scope["client"][1]})
        if scope["method"] == "GET" and scope["path"] == "/v1/models":
            await self._send(send, 200, b"application/json",
                             orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}))
            return
        try:
            req = orjson.loads(body)
            text = "echo:" + req["messages"][-1]["content"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            await self._send(send, 400, b"application/json", b'{"error":{"message":"bad request"}}')
            return
        if not req.get("stream"):
            await self._send(send, 200, b"application/json", orjson.dumps({
                "id": "c", "object": "chat.completion", "created": 1, "model": req.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}))
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for piece, finish in ((text[:6], None), (text[6:], None), ("", "stop")):
            event = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": req.get("model"),
                     "choices": [{"index": 0, "delta": {"content": piece} if piece else {}, "finish_reason": finish}]}
            await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(event) + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    @staticmethod
    async def _send(send, status: int, ctype: bytes, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def start(self) -> H11Engine:
        config = uvicorn.Config(self, host="127.0.0.1", port=self.port, http="h11", lifespan="off",
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.task = asyncio.create_task(self.server.serve())
        for _ in range(500):
            if self.server.started:
                return self
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.01)
        raise TimeoutError("uvicorn did not start")

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 10)


@pytest.fixture
async def engine():
    e = await H11Engine().start()
    yield e
    await e.stop()


# -- requests and replies on raw sockets -------------------------------------------------------------
def chat_body(prompt: str, stream: bool = False, size: int | None = None) -> bytes:
    """A completion request; with `size`, padded with JSON whitespace to exactly that many bytes."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": stream})
    if size is not None:
        assert len(body) <= size
        body = body[:-1] + b" " * (size - len(body)) + b"}"
    return body


def head(fields: list[tuple[bytes, bytes]], method: bytes = b"POST", target: bytes = CHAT,
         version: bytes = b"HTTP/1.1") -> bytes:
    return b"%s %s %s\r\n" % (method, target, version) + b"".join(b"%s: %s\r\n" % f for f in fields) + b"\r\n"


def post(body: bytes, *extra: tuple[bytes, bytes], close: bool = False) -> bytes:
    fields = [(b"Host", b"gw"), (b"Authorization", USER_AUTH), (b"Content-Type", b"application/json"),
              (b"Content-Length", b"%d" % len(body)), *extra]
    if close:
        fields.append((b"Connection", b"close"))
    return head(fields) + body


def echoed(status: int, fields: list[tuple[str, str]], body: bytes) -> str | None:
    """The prompt a 200 completion echoes (the engine answers "echo:<prompt>"), or None for any other reply."""
    if status != 200:
        return None
    h = dict(fields)
    if h.get("content-type", "").startswith("text/event-stream"):
        text = ""
        for line in body.split(b"\n"):
            if line.startswith(b"data: {"):
                for c in orjson.loads(line[6:])["choices"]:
                    text += c.get("delta", {}).get("content") or ""
    else:
        text = orjson.loads(body)["choices"][0]["message"]["content"]
    assert text.startswith("echo:"), text
    return text[5:]


async def exchange(port: int, data: bytes, deadline: float = 8.0) -> bytes:
    """Send `data` on a new connection and read until the gateway closes it (no half-close from this side:
    the front takes end of input as the client leaving)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(-1), deadline)
    finally:
        writer.close()


# -- the hostile table ---------------------------------------------------------------------------------
def smuggled_request(row: str) -> bytes:
    """A whole authorized request the client hides somewhere; it must never run as one of its own."""
    return post(chat_body(f"SMUGGLED-{row}", size=SIZE))


# A valid value per header; the injection is appended to it.
INJECTED_HEADERS = {
    b"x-request-id": b"req-1",
    b"traceparent": TP,
    b"tracestate": b"vendor=v1",
    b"x-session-id": b"sess-1",
    b"authorization": USER_AUTH,
    b"content-type": b"application/json",
    b"x-custom": b"c",
}
SEPARATORS = {
    "LF": b"\n",
    "CR": b"\r",
    "LFCR": b"\n\r",
    "NUL": b"\x00",
    "VT": b"\x0b",
    "FF": b"\x0c",
    "obs-fold-SP": b"\r\n ",
    "obs-fold-HT": b"\r\n\t",
    "U+2028-utf8": "\u2028".encode(),
    "U+0085-latin1": b"\x85",
    "U+0085-utf8": b"\xc2\x85",
    "CRLF-pct": b"%0D%0A",
    "CRLF-escaped": b"\\r\\n",
}
# Separators strict llhttp refuses in a field value: CR, LF, NUL and the other controls are never valid
# there, and obs-fold is obsolete (RFC 9110 5.5, RFC 9112 5.2). U+2028 and U+0085 are obs-text bytes.
MUST_REFUSE = {"LF", "CR", "LFCR", "NUL", "VT", "FF", "obs-fold-SP", "obs-fold-HT"}


def injection(name: bytes, sep: bytes, shape: str, row: str, stream: bool) -> bytes:
    """A hostile request whose `name` header hides a second request behind `sep`.

    split: the shape that works on h11 through a gateway copying the value (see the sanity test): a blank
    line ends the engine's head inside the value, the hidden body fills the gateway's Content-Length, and
    the hidden head is completed by the gateway's own Authorization line and body.
    inline: the textbook shape, a request line right after the separator.
    """
    hidden = chat_body(f"SMUGGLED-{row}", size=SIZE)
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: e", b"Content-Length: %d" % SIZE]
    if shape == "split":
        value = INJECTED_HEADERS[name] + sep + sep + hidden + sep.join(lines + [b"x-pad: z"])
    else:
        value = INJECTED_HEADERS[name] + sep + sep.join(lines) + sep + sep + hidden
    body = chat_body(f"HOSTILE-{row}", stream=stream, size=SIZE)
    fields = [(b"Host", b"gw"), (b"Authorization", USER_AUTH), (b"Content-Type", b"application/json"),
              (b"Connection", b"close")]
    if name == b"tracestate":
        fields.append((b"traceparent", TP))
    fields = [f for f in fields if f[0].lower() != name]
    fields.insert(1, (name, value))
    fields.append((b"Content-Length", b"%d" % SIZE))
    return head(fields) + body


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def desync_rows() -> dict[str, bytes]:
    """CL.TE, TE.CL and framing ambiguities: each hides a whole authorized request in the body's framing."""
    rows: dict[str, bytes] = {}

    def h(*fields: tuple[bytes, bytes], version: bytes = b"HTTP/1.1") -> bytes:
        return head([(b"Host", b"gw"), (b"Authorization", USER_AUTH), (b"Content-Type", b"application/json"),
                     *fields], version=version)

    def add(row: str, make) -> None:
        rows[row] = make(row, smuggled_request(row))

    te = (b"Transfer-Encoding", b"chunked")
    add("CL.TE", lambda r, s: h((b"Content-Length", b"%d" % (5 + len(s))), te) + b"0\r\n\r\n" + s)
    add("TE.CL", lambda r, s: h(te, (b"Content-Length", b"4")) + chunked(s))
    add("TE.CL-small", lambda r, s: h(te, (b"Content-Length", b"0")) + chunked(s))
    for label, field in [
        ("TE-dup-identity", b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity"),
        ("TE-xchunked", b"Transfer-Encoding: xchunked"),
        ("TE-space-before-colon", b"Transfer-Encoding : chunked"),
        ("TE-tab", b"Transfer-Encoding:\tchunked"),
        ("TE-list", b"Transfer-Encoding: chunked, identity"),
        ("TE-identity-chunked", b"Transfer-Encoding: identity, chunked"),
        ("TE-VT", b"Transfer-Encoding: \x0bchunked"),
        ("TE-obs-fold", b"Transfer-Encoding:\r\n chunked"),
        ("TE-LF-in-name", b"Transfer-Encoding\n: chunked"),
        ("TE-underscore", b"Transfer_Encoding: chunked"),
        ("TE-quoted", b'Transfer-Encoding: "chunked"'),
        ("TE-bare-LF-line", b"X: y\nTransfer-Encoding: chunked"),
    ]:
        rows[f"CL.{label}"] = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: " + USER_AUTH + b"\r\n"
            + b"Content-Length: %d\r\n" % (5 + len(smuggled_request(label))) + field + b"\r\n\r\n"
            + b"0\r\n\r\n" + smuggled_request(label))
    for label, value in [("CL-plus", b"+%d"), ("CL-list", b"%d, %d"), ("CL-space", b"%d 0"),
                         ("CL-hex", b"0x%x"), ("CL-negative", b"-%d"), ("CL-VT", b"%d\x0b"),
                         ("CL-overflow", b"9999999999999999999999%d")]:
        s = smuggled_request(label)
        n = value.count(b"%")
        rows[label] = h((b"Content-Length", value % ((5,) * n))) + b"hello" + s
    s = smuggled_request("CL-dup-differ")
    rows["CL-dup-differ"] = h((b"Content-Length", b"5"), (b"Content-Length", b"%d" % (5 + len(s)))) + b"hello" + s
    s = smuggled_request("CL-dup-same")
    rows["CL-dup-same"] = h((b"Content-Length", b"5"), (b"Content-Length", b"5")) + b"hello" + s
    add("chunk-size-overflow", lambda r, s: h(te) + b"fffffffffffffffffff1\r\n" + s + b"\r\n0\r\n\r\n")
    add("chunk-bare-LF", lambda r, s: h(te) + b"5\nhello\n0\n\n" + s)
    add("chunk-ext-quoted-CRLF", lambda r, s: h(te) + b'5;a="x\r\n0\r\n\r\n' + s + b'"\r\nhello\r\n0\r\n\r\n')
    add("chunk-trailer-CL", lambda r, s: h(te) + b"0\r\nContent-Length: %d\r\n\r\n" % len(s) + s)
    add("chunk-size-space", lambda r, s: h(te) + b" 5\r\nhello\r\n0\r\n\r\n" + s)
    add("chunk-size-0x", lambda r, s: h(te) + b"0x5\r\nhello\r\n0\r\n\r\n" + s)
    add("chunk-short-data", lambda r, s: h(te) + b"a\r\nhello\r\n0\r\n\r\n" + s)
    add("HTTP/1.0-TE", lambda r, s: h(te, version=b"HTTP/1.0") + chunked(s))
    add("expect-CL.TE", lambda r, s: h((b"Expect", b"100-continue"), (b"Content-Length", b"%d" % (5 + len(s))),
                                        te) + b"0\r\n\r\n" + s)
    add("upgrade-then-request", lambda r, s: h((b"Connection", b"Upgrade"), (b"Upgrade", b"websocket"),
                                                (b"Content-Length", b"0")) + s)

    # The client's own request, oddly framed: served or refused, it is never a second one.
    def own(row: str, damage) -> None:
        rows[row] = damage(post(chat_body(f"HOSTILE-{row}", size=SIZE), close=True))

    own("bare-LF-head", lambda d: d.replace(b"\r\n", b"\n"))
    own("bare-LF-request-line", lambda d: d.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\n", 1))
    own("leading-LF", lambda d: b"\n" + d)
    own("leading-CRLF", lambda d: b"\r\n" + d)
    own("target-CRLF-pct", lambda d: d.replace(CHAT, CHAT + b"%0D%0AX:%20y", 1))
    own("target-space", lambda d: d.replace(CHAT, CHAT + b" HTTP/1.1\r\nX: y", 1))
    own("absolute-form", lambda d: d.replace(CHAT, b"http://engine" + CHAT, 1))
    own("method-lowercase", lambda d: d.replace(b"POST", b"post", 1))
    return rows


def pipelined_rows() -> dict[str, tuple[bytes, bool]]:
    """Requests one after another in one write; (bytes, whether the prompts are the client's own requests).

    A request the client framed itself is its own, served or not; only SMUGGLED ones hide inside another."""
    def p(row: str, i: int, close: bool = False, stream: bool = False) -> bytes:
        return post(chat_body(f"PIPE-{row}-{i}", stream=stream, size=SIZE), close=close)

    def te(row: str, i: int) -> bytes:
        return head([(b"Host", b"gw"), (b"Authorization", USER_AUTH), (b"Transfer-Encoding", b"chunked")]) + \
            chunked(chat_body(f"PIPE-{row}-{i}", size=SIZE))

    bad = injection(b"x-request-id", b"\n", "split", "pipelined-after-bad", False)
    return {
        "pipelined-2": p("pipelined-2", 0) + p("pipelined-2", 1, close=True, stream=True),
        "pipelined-5": b"".join(p("pipelined-5", i, close=i == 4, stream=i % 2 == 1) for i in range(5)),
        "pipelined-bad-in-middle": p("pipelined-bad-in-middle", 0) + bad + p("pipelined-bad-in-middle", 1, True),
        "pipelined-after-chunked": te("pipelined-after-chunked", 0) + p("pipelined-after-chunked", 1, True),
        # A length that covers a tenth of the body: the rest is read as the next request.
        "pipelined-CL-short": post(chat_body("PIPE-pipelined-CL-short-0", size=SIZE)[:10])
        + chat_body("PIPE-pipelined-CL-short-0", size=SIZE)[10:] + p("pipelined-CL-short", 1, close=True),
        "pipelined-expect": post(chat_body("PIPE-pipelined-expect-0", size=SIZE), (b"Expect", b"100-continue"))
        + p("pipelined-expect", 1, close=True),
    }


def violations(seen: list[dict], sent: set[str], answered: Counter) -> list[str]:
    """How the requests an engine ran differ from what a gateway may send it: [] when they are exactly the
    completions clients sent whole and got answered (one run each), plus probes, all with the engine key."""
    found = []
    ran: Counter[str] = Counter()
    key = b"Bearer " + ENGINE_KEY.encode()
    for s in seen:
        what = f"{s['method']} {s['path']!r} {s['headers']!r} {s['body'][:80]!r}"
        if (s["method"], s["path"]) not in (("POST", CHAT), ("GET", b"/v1/models")):
            found.append(f"a request the gateway never sends: {what}")
        if [v for k, v in s["headers"] if k == b"authorization"] != [key]:
            found.append(f"not exactly one authorization, the engine key: {what}")
        ids = [v for k, v in s["headers"] if k == b"x-request-id"]
        if len(ids) > 1 or not all(SAFE_ID.fullmatch(v.decode("latin-1")) for v in ids):
            found.append(f"a request id outside the safe grammar: {what}")
        if s["method"] != "POST":
            continue
        names = [k for k, _ in s["headers"]]
        if not set(names) <= FORWARDED or len(names) != len(set(names)):
            found.append(f"a header the gateway does not send: {what}")
        if b"SMUGGLED" in s["body"]:
            found.append(f"a smuggled body: {what}")
        try:
            req = orjson.loads(s["body"])
            prompt = req["messages"][-1]["content"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            found.append(f"a body that is no client's completion request: {what}")
            continue
        # The body as the client sent it whole (the gateway may only add stream_options to a stream).
        if prompt not in sent or req["messages"] != [{"role": "user", "content": prompt}] or req["model"] != "m" \
                or not set(req) <= {"model", "messages", "stream", "stream_options"}:
            found.append(f"a body no client sent whole: {what}")
        ran[prompt] += 1
    if ran != answered:
        found.append(f"runs without a client's answer: {dict(ran - answered)}; answers without a run: "
                     f"{dict(answered - ran)}")
    return found


# -- the tests -------------------------------------------------------------------------------------
async def test_the_h11_engine_runs_a_request_smuggled_in_a_header_value(engine):
    """Sanity: the engine is the lenient one. The bytes a gateway copying x-request-id verbatim would send
    (one request to it) run as two requests on h11: the second carries the gateway's engine key, and its
    answer waits on the pooled connection for whoever sends next.

    h11 0.16 takes a bare LF as a line end (so LF LF ends a head) but refuses a request line inside a head
    ("illegal header line"), so the textbook `a\\nPOST ...` is refused there while `a\\n\\n...` smuggles."""
    hostile = chat_body("HOSTILE-sanity", size=SIZE)
    hidden = chat_body("SMUGGLED-sanity", size=SIZE)
    rid = hidden.join([b"a\n\n", b"POST /v1/chat/completions HTTP/1.1\nHost: e\nContent-Length: %d\nx-pad: z" % SIZE])
    # Byte for byte what backends/http1.Connection.send would write without its CR/LF check, for
    # OpenAIHTTPBackend.headers({"x-request-id": rid}) with the engine key.
    as_forwarded = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: %d\r\n"
                    b"Content-Type: application/json\r\nx-request-id: %s\r\nAuthorization: Bearer %s\r\n\r\n%s"
                    % (engine.port, SIZE, rid, ENGINE_KEY.encode(), hostile))
    # The next client's request, as the gateway forwards it on the same pooled connection.
    good = chat_body("GOOD-sanity")
    next_one = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: %d\r\n"
                b"Content-Type: application/json\r\nx-request-id: good-sanity\r\nAuthorization: Bearer %s\r\n"
                b"Connection: close\r\n\r\n%s" % (engine.port, len(good), ENGINE_KEY.encode(), good))
    reader, writer = await asyncio.open_connection("127.0.0.1", engine.port)
    writer.write(as_forwarded + next_one)
    data = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    replies, _ = parse_replies(data)
    # Three requests ran for two sent: the gateway would hand the attacker the answer to the prompt hidden in
    # its header, and the next client the answer to the attacker's prompt.
    assert [echoed(*r) for r in replies] == ["SMUGGLED-sanity", "HOSTILE-sanity", "GOOD-sanity"]
    smuggled = [s for s in engine.seen if s["method"] == "POST"][1]
    assert (b"x-pad", b"z") in smuggled["headers"]
    assert (b"authorization", b"Bearer " + ENGINE_KEY.encode()) in smuggled["headers"]
    # The checks the gateway test makes catch it.
    found = violations(engine.seen, {"HOSTILE-sanity", "GOOD-sanity"}, Counter({"HOSTILE-sanity": 1,
                                                                               "GOOD-sanity": 1}))
    for what in ("a smuggled body", "not exactly one authorization", "a header the gateway does not send",
                 "runs without a client's answer: {'SMUGGLED-sanity': 1}"):
        assert any(f.startswith(what) for f in found), (what, found)

    # The textbook shape is refused by this h11: documented above, and checked so a change shows.
    reader, writer = await asyncio.open_connection("127.0.0.1", engine.port)
    writer.write(as_forwarded.replace(b"a\n\n", b"a\n", 1))
    data = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    assert data.startswith(b"HTTP/1.1 400")


async def test_hostile_clients_never_make_the_engine_run_a_request_the_gateway_did_not_send(
        engine, monkeypatch, caplog):
    monkeypatch.setenv(KEY_ENV, ENGINE_KEY)
    caplog.set_level(logging.ERROR, logger="shapegate")
    cfg = gateway_config([{"id": "h11", "engine": "openai", "url": engine.url, "models": ["m"],
                           "api_key_env": KEY_ENV}],
                         # Short waits: a row the front keeps open (or waiting for a body) ends quickly.
                         server={"access_log": False, "keepalive_s": 0.5, "head_timeout_s": 2.0,
                                 "body_timeout_s": 2.0})
    gw = await start_gateway(cfg)
    rows: list[tuple[str, bytes, str]] = []  # (row, bytes, kind)
    i = 0
    for name in INJECTED_HEADERS:
        for sep_name, sep in SEPARATORS.items():
            for shape in ("split", "inline"):
                row = f"{name.decode()}/{sep_name}/{shape}"
                rows.append((row, injection(name, sep, shape, row, stream=i % 3 == 0), sep_name))
                i += 1
    rows += [(row, data, "desync") for row, data in desync_rows().items()]
    rows += [(row, data, "pipelined") for row, data in pipelined_rows().items()]

    answered: Counter[str] = Counter()  # prompts whose completion a client of this test got back
    sent: set[str] = set()  # every prompt a client framed as a whole request body of its own
    try:
        for n, (row, data, kind) in enumerate(rows):
            sent.update(p.decode() for p in re.findall(rb'"content":"((?:HOSTILE|PIPE)-[^"]*)"', data))
            raw = await exchange(gw.port, data)
            replies, rest = parse_replies(raw)
            assert not rest, f"{row}: a partial reply {rest[:80]!r}"
            for status, fields, body in replies:
                assert status != 500, f"{row}: {body[:200]!r}"
                for k, v in fields:
                    if k == "x-request-id":
                        assert SAFE_ID.fullmatch(v), f"{row}: reflected request id {v!r}"
                p = echoed(status, fields, body)
                if p is not None:
                    assert p.startswith(("HOSTILE-", "PIPE-")) and row in p, f"{row}: answered with {p!r}"
                    answered[p] += 1
            if kind in MUST_REFUSE:
                assert [r[0] for r in replies] == [400], f"{row}: {[r[0] for r in replies]}"

            # A well-behaved client next, on a new connection, gets its own answer.
            good = f"GOOD-{n}"
            sent.add(good)
            stream = n % 2 == 1
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(post(chat_body(good, stream=stream), (b"x-request-id", b"good-%d" % n),
                              (b"traceparent", TP), (b"tracestate", b"vendor=v1")))
            data = b""
            while True:
                data += await asyncio.wait_for(reader.read(65536), 10)
                replies, rest = parse_replies(data)
                if replies:
                    break
            writer.close()
            assert len(replies) == 1 and not rest, f"after {row}: {data[:300]!r}"
            status, fields, body = replies[0]
            assert status == 200, f"after {row}: {status} {body[:200]!r}"
            assert dict(fields)["x-request-id"] == f"good-{n}"
            assert echoed(status, fields, body) == good, f"after {row}: another's answer"
            answered[good] += 1
    finally:
        await gw.stop()

    # The engine ran exactly the requests the gateway sent: one per completion a client got back.
    assert violations(engine.seen, sent, answered) == []
    for s in engine.seen:
        if b'"GOOD-' in s["body"]:  # the well-behaved clients' id and trace context went on as sent
            n = orjson.loads(s["body"])["messages"][-1]["content"][5:]
            h = dict(s["headers"])
            assert h.get(b"x-request-id") == b"good-" + n.encode() and h.get(b"traceparent") == TP, s
    # The pooled engine connection went from one client to the next: a desync would have reached them.
    ports = {s["client"] for s in engine.seen if s["method"] == "POST"}
    assert len(ports) <= 2, ports
    assert not [r for r in caplog.records if r.name.startswith("shapegate")]
