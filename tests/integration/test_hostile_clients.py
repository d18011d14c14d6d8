"""Hostile clients on raw sockets against a real gateway: smuggling and bad framing refused, odd but valid requests served."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import orjson
import pytest

from tests.fake_engine import Knobs
from tests.raw_http import (AFTER, AUTH, BAD, CHUNKED_HEAD, CT, END_SMUG, HOST, KEY, OUTER, PIPELINED, SMUG, SMUGGLED,
                            WARMUP, Reply, assert_error, chat, chunk_body, chunked, cl, cl_body, close, exchange,
                            post, prompts, read_response, req, rest_of_connection, rig, stop, te_cl, te_only)


# ===================================================================================================
@dataclass(frozen=True)
class Hostile:
    raw: bytes
    status: int
    code: str
    # The request pipelined behind goes in the same write, or (for a head that has no CRLFCRLF and must be
    # refused when its bytes arrive, not at a timeout) only after the refusal.
    follow_after_reply: bool = False


BIG_ID = b"x-request-id: " + b"a" * 100_000
HOSTILE = {
    # -- CL.TE, TE.CL and TE.TE ---------------------------------------------------------------------
    "cl_te": Hostile(req(HOST, AUTH, CT, cl(len(END_SMUG)), b"Transfer-Encoding: chunked", body=END_SMUG), 400, BAD),
    "te_cl": Hostile(req(HOST, AUTH, CT, b"Transfer-Encoding: chunked", cl(4), body=chunked(SMUG)), 400, BAD),
    "te_xchunked": Hostile(te_cl(b"Transfer-Encoding: xchunked"), 400, BAD),
    "te_chunked_identity": Hostile(te_only(b"Transfer-Encoding: chunked, identity"), 400, BAD),
    "te_chunked_identity_with_cl": Hostile(te_cl(b"Transfer-Encoding: chunked, identity"), 400, BAD),
    "te_odd_whitespace": Hostile(te_cl(b"Transfer-Encoding:   chunked  "), 400, BAD),
    "te_tab": Hostile(te_cl(b"Transfer-Encoding:\tchunked"), 400, BAD),
    "te_vertical_tab_value": Hostile(te_cl(b"Transfer-Encoding:\x0bchunked"), 400, BAD),
    "te_vertical_tab_name": Hostile(te_cl(b"Transfer-Encoding\x0b: chunked"), 400, BAD),
    "te_two_fields_last_identity": Hostile(te_only(b"Transfer-Encoding: chunked", b"Transfer-encoding: identity"),
                                           400, BAD),
    "te_two_fields_with_cl": Hostile(te_cl(b"Transfer-encoding: chunked\r\nTransfer-Encoding: chunked"), 400, BAD),
    "te_space_before_colon": Hostile(te_cl(b"Transfer-Encoding : chunked"), 400, BAD),
    "te_obs_fold": Hostile(te_cl(b"Transfer-Encoding:\r\n chunked"), 400, BAD),
    "te_first_line_leading_space": Hostile(te_cl(b"X-Note: y", first=b" Transfer-Encoding: chunked"), 400, BAD),
    "te_gzip_chunked": Hostile(te_only(b"Transfer-Encoding: gzip, chunked"), 501, "unsupported_transfer_encoding"),
    "te_on_http10": Hostile(te_only(b"Transfer-Encoding: chunked", start=b"POST /v1/chat/completions HTTP/1.0"),
                            400, BAD),
    "te_cl_on_http10": Hostile(te_cl(b"Transfer-Encoding: chunked", start=b"POST /v1/chat/completions HTTP/1.0"),
                               400, BAD),
    # -- Content-Length ------------------------------------------------------------------------------
    "cl_twice_same": Hostile(cl_body(cl(len(chat(OUTER))), cl(len(chat(OUTER)))), 400, BAD),
    "cl_twice_different": Hostile(cl_body(cl(len(chat(OUTER))), cl(len(chat(OUTER)) + len(SMUG))), 400, BAD),
    "cl_plus": Hostile(cl_body(b"Content-Length: +%d" % len(chat(OUTER))), 400, BAD),
    "cl_hex": Hostile(cl_body(b"Content-Length: 0x%x" % len(chat(OUTER))), 400, BAD),
    "cl_list": Hostile(cl_body(b"Content-Length: %d, %d" % (len(chat(OUTER)), len(chat(OUTER)))), 400, BAD),
    "cl_letters": Hostile(cl_body(b"Content-Length: abc"), 400, BAD),
    "cl_negative": Hostile(cl_body(b"Content-Length: -%d" % len(chat(OUTER))), 400, BAD),
    "cl_overflow": Hostile(cl_body(b"Content-Length: 184467440737095516160"), 400, BAD),
    "cl_space_before_colon": Hostile(cl_body(b"Content-Length : %d" % len(chat(OUTER))), 400, BAD),
    # -- line ends and bytes that have no place in a head --------------------------------------------
    "bare_cr": Hostile(post(OUTER, b"X-A: a\rX-B: b"), 400, BAD),
    "bare_lf": Hostile(post(OUTER, b"X-A: a\nX-B: b"), 400, BAD),
    "nul_in_name": Hostile(post(OUTER, b"X-\x00A: a"), 400, BAD),
    "nul_in_value": Hostile(post(OUTER, b"X-A: a\x00b"), 400, BAD),
    "obs_text_in_name": Hostile(post(OUTER, b"X-\xe9: a"), 400, BAD),
    "obs_fold": Hostile(post(OUTER, b"X-A: a\r\n  folded"), 400, BAD),
    # The classic: a value, a bare LF, then a whole request with bare-LF line ends, inside one header line.
    "request_in_a_value_after_bare_lf": Hostile(post(OUTER, b"x-request-id: a\n" + SMUG.replace(b"\r\n", b"\n")),
                                                400, BAD),
    "lf_only_request": Hostile(post(OUTER).replace(b"\r\n", b"\n"), 400, BAD, follow_after_reply=True),
    "nul_in_target": Hostile(post(OUTER).replace(b"/v1/chat/completions", b"/v1/chat/completions\x00", 1), 400, BAD),
    "space_in_target": Hostile(post(OUTER).replace(b"/v1/chat/completions", b"/v1/chat /completions", 1), 400, BAD),
    "lowercase_method": Hostile(post(OUTER).replace(b"POST", b"post", 1), 400, BAD),
    # -- sizes ---------------------------------------------------------------------------------------
    "head_with_100kb_request_id": Hostile(post(OUTER, BIG_ID), 431, "request_head_too_large"),
    "100kb_url": Hostile(post(OUTER).replace(b"/v1/chat/completions", b"/v1/chat/completions?" + b"q" * 100_000, 1),
                         431, "request_head_too_large"),
    "too_many_headers": Hostile(post(OUTER, *(b"X-N%d: v" % i for i in range(150))), 431, "too_many_headers"),
    "body_over_the_limit": Hostile(req(HOST, AUTH, CT, cl(4 * 1024 * 1024 + 1), body=chat(OUTER) + SMUG),
                                   413, "request_too_large"),
    # -- fields that must come once, versions, expectations ------------------------------------------
    "no_host": Hostile(req(AUTH, CT, cl(len(chat(OUTER))), body=chat(OUTER) + SMUG), 400, "missing_host"),
    "two_host": Hostile(post(OUTER, b"Host: evil"), 400, "duplicate_header"),
    "two_authorization": Hostile(post(OUTER, b"Authorization: Bearer sk-other"), 400, "duplicate_header"),
    "two_x_api_key": Hostile(post(OUTER, b"x-api-key: " + KEY, b"X-Api-Key: sk-other"), 400, "duplicate_header"),
    "http_2_0": Hostile(post(OUTER, version=b"2.0"), 505, "http_version_not_supported"),
    "http_0_9": Hostile(b"GET /\r\n\r\n" + SMUG, 505, "http_version_not_supported"),
    # llhttp takes RTSP/ and ICE/ request lines too; they are not HTTP/1.x and must not pass for it.
    "rtsp_1_0": Hostile(post(OUTER).replace(b"HTTP/1.1", b"RTSP/1.0", 1), 505, "http_version_not_supported"),
    "connect": Hostile(b"CONNECT evil:443 HTTP/1.1\r\nHost: evil:443\r\n\r\n" + SMUG, 405, "method_not_allowed"),
    "expect_other": Hostile(post(OUTER, b"Expect: 200-ok"), 417, "expectation_failed"),
    "h2c_upgrade_with_body": Hostile(post(OUTER, b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c",
                                          b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"), 400, BAD),
    # -- chunked bodies ------------------------------------------------------------------------------
    "chunk_size_negative": Hostile(chunk_body(b"-6\r\nabcdef\r\n0\r\n\r\n"), 400, BAD),
    "chunk_size_0x": Hostile(chunk_body(b"0x2\r\nab\r\n0\r\n\r\n"), 400, BAD),
    "chunk_size_plus": Hostile(chunk_body(b"+0\r\n\r\n"), 400, BAD),
    "chunk_size_overflow": Hostile(chunk_body(b"fffffffffffffffff1\r\nab\r\n0\r\n\r\n"), 400, BAD),
    "chunk_without_crlf": Hostile(chunk_body(b"%x\r\n%sXX0\r\n\r\n" % (len(chat(OUTER)), chat(OUTER))), 400, BAD),
    "chunk_trailer_bare_lf": Hostile(chunk_body(chunked(chat(OUTER))[:-2] + b"X-T: a\nb\r\n\r\n"), 400, BAD),
    "chunk_size_bare_lf": Hostile(chunk_body(b"%x\n%s\r\n0\r\n\r\n" % (len(chat(OUTER)), chat(OUTER))), 400, BAD),
}


@pytest.mark.parametrize("name", list(HOSTILE))
async def test_hostile_request_is_refused_and_nothing_reaches_the_engine(name):
    row = HOSTILE[name]
    # Long waits, so that a refusal that only comes at a timeout shows as a wrong status (408), not a pass.
    r = await rig({"head_timeout_s": 5.0, "body_timeout_s": 5.0})
    try:
        # One request first, so the gateway holds a pooled engine connection the hostile one could spoil.
        assert (await exchange(r.gw.port, post(WARMUP))).status == 200
        assert len(r.pool.idle) == 1
        pooled = r.pool.idle[0]
        used = pooled.used

        reader, writer = await asyncio.open_connection("127.0.0.1", r.gw.port)
        t0 = time.monotonic()
        writer.write(row.raw if row.follow_after_reply else row.raw + post(PIPELINED))
        reply = await read_response(reader)
        elapsed = time.monotonic() - t0
        if row.follow_after_reply:
            writer.write(post(PIPELINED))
        # (a) the status and an OpenAI-shaped error, at once, and the connection ends
        assert_error(reply, row.status, row.code)
        assert reply.headers.get("connection") == "close"
        assert elapsed < 2.0, f"answered after {elapsed:.2f} s: at a timeout, not when the bytes arrived"
        assert SMUGGLED.encode() not in reply.body and PIPELINED.encode() not in reply.body
        # (c) the request pipelined behind it is never answered: the connection closes after the refusal
        assert await rest_of_connection(reader) == b""
        await close(writer)
        # (d) a new connection is served, over the same pooled engine connection
        after = await exchange(r.gw.port, post(AFTER))
        assert after.status == 200 and orjson.loads(after.body)["model"] == "m2"
        # (b) the engine saw the warm-up and the request after, nothing of the hostile connection
        seen = prompts(r.engine.knobs)
        assert SMUGGLED not in seen and PIPELINED not in seen and OUTER not in seen, seen
        assert seen == [WARMUP, AFTER]
        assert list(r.pool.idle) == [pooled] and pooled.used == used + 1
    finally:
        await stop(r)


# ===================================================================================================
# 2. Valid requests that look unusual: they must work, and forward exactly what they should.
# ===================================================================================================
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
GOOD_ID = "Client-42_a.b:c/d+e=f@g"


@dataclass(frozen=True)
class Step:
    pieces: tuple[bytes, ...]  # written one at a time, with a pause between
    replies: int  # read after the pieces are written


@dataclass(frozen=True)
class Unusual:
    steps: tuple[Step, ...]
    statuses: tuple[int, ...]
    prompts: tuple[str, ...]  # what the engine saw, in order
    check: Callable[[list[Reply], Knobs], None] = field(default=lambda replies, knobs: None)
    closes: bool = False  # the gateway ends the connection after the last reply (else it stays open)


def split(data: bytes, n: int) -> tuple[bytes, ...]:
    return tuple(data[i:i + n] for i in range(0, len(data), n))


def one(data: bytes, replies: int = 1) -> tuple[Step, ...]:
    return (Step((data,), replies),)


def reflected_and_forwarded(rid: str):
    def check(replies: list[Reply], knobs: Knobs) -> None:
        assert replies[-1].headers["x-request-id"] == rid
        assert knobs.headers_seen[-1]["x-request-id"] == rid
    return check


def replaced(rid: bytes):
    """An invalid request id is neither reflected nor forwarded: the gateway's own id goes both ways."""
    def check(replies: list[Reply], knobs: Knobs) -> None:
        own = replies[-1].headers["x-request-id"]
        assert own != rid.decode("latin-1") and knobs.headers_seen[-1].getall("x-request-id") == [own]
        assert all(rid.decode("latin-1") not in v for v in knobs.headers_seen[-1].values())
    return check


def trace_forwarded(parent: str | None, state: str | None):
    def check(replies: list[Reply], knobs: Knobs) -> None:
        seen = knobs.headers_seen[-1]
        assert seen.get("traceparent") == parent and seen.get("tracestate") == state
    return check


def in_order(ids: list[str]):
    def check(replies: list[Reply], knobs: Knobs) -> None:
        assert [r.headers["x-request-id"] for r in replies] == ids
        assert [h["x-request-id"] for h in knobs.headers_seen] == ids
    return check


def http10_kept_alive(replies: list[Reply], knobs: Knobs) -> None:
    assert all(r.headers.get("connection") == "keep-alive" for r in replies)


def continued(replies: list[Reply], knobs: Knobs) -> None:
    assert replies[0].status == 100 and replies[0].body == b""


def not_forwarded(name: str):
    def check(replies: list[Reply], knobs: Knobs) -> None:
        assert name not in knobs.headers_seen[-1]
    return check


def then_refused(code: str):
    def check(replies: list[Reply], knobs: Knobs) -> None:
        assert_error(replies[-1], replies[-1].status, code)
    return check


def allow_post(replies: list[Reply], knobs: Knobs) -> None:
    assert replies[0].headers["allow"] == "POST"
    assert orjson.loads(replies[0].body)["error"]["code"] == "method_not_allowed"


CHUNKED_A = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in split(chat("a"), 9)) + b"0\r\n\r\n"
UNUSUAL = {
    "three_pipelined_in_one_write": Unusual(
        (Step((b"".join(post(f"p{i}", b"x-request-id: pipe-%d" % i) for i in range(3)),), 3),),
        (200, 200, 200), ("p0", "p1", "p2"), in_order(["pipe-0", "pipe-1", "pipe-2"])),
    "http10_keep_alive": Unusual(
        (Step((post("a", b"Connection: keep-alive", version=b"1.0"),), 1),
         Step((post("b", b"Connection: keep-alive", version=b"1.0"),), 1)),
        (200, 200), ("a", "b"), http10_kept_alive),
    "http10_keep_alive_pipelined": Unusual(
        one(post("a", b"Connection: keep-alive", version=b"1.0") + post("b", b"Connection: keep-alive", version=b"1.0"),
            2), (200, 200), ("a", "b"), http10_kept_alive),
    # Runs of spaces in the request line: llhttp takes them, so the front reads the line the same way.
    "spaces_in_request_line": Unusual(one(post("a").replace(b"POST /v1/chat/completions HTTP/1.1",
                                                            b"POST  /v1/chat/completions  HTTP/1.1", 1)),
                                      (200,), ("a",)),
    "chunked_body_in_many_writes": Unusual((Step(split(CHUNKED_HEAD + CHUNKED_A, 5), 1),), (200,), ("a",)),
    "chunked_with_extension_and_trailer": Unusual(
        one(CHUNKED_HEAD + b"%x;ext=1\r\n%s\r\n0\r\nX-Trailer: t\r\n\r\n" % (len(chat("a")), chat("a"))),
        (200,), ("a",), not_forwarded("x-trailer")),
    # Bytes behind a chunked body are not parsed (front.py): the request is served, then the connection ends.
    "chunked_then_pipelined": Unusual(one(CHUNKED_HEAD + CHUNKED_A + post("b")), (200,), ("a",), closes=True),
    # A request that ends its connection is served; what follows it is not processed (RFC 9112, 9.6).
    "connection_close_then_pipelined": Unusual(one(post("a", b"Connection: close") + post("b")), (200,), ("a",),
                                               closes=True),
    "http10_without_keep_alive_then_pipelined": Unusual(one(post("a", version=b"1.0") + post("b")), (200,), ("a",),
                                                        closes=True),
    "http10_then_a_stray_crlf": Unusual(one(post("a", version=b"1.0") + b"\r\n"), (200,), ("a",), closes=True),
    # A good request, then a bad one on the same connection: the first is served, the second refused.
    "good_then_malformed": Unusual(one(post("a") + b"BROKEN\r\n\r\n", 2), (200, 400), ("a",), then_refused(BAD),
                                   closes=True),
    "good_then_cl_te": Unusual(one(post("a") + HOSTILE["cl_te"].raw, 2), (200, 400), ("a",), then_refused(BAD),
                               closes=True),
    "good_then_oversized_head": Unusual(one(post("a") + post("b", BIG_ID), 2), (200, 431), ("a",),
                                        then_refused("request_head_too_large"), closes=True),
    # An upgrade is not taken: the request is served as it is, and nothing after it.
    "upgrade_then_pipelined": Unusual(one(req(HOST, b"Connection: Upgrade", b"Upgrade: websocket",
                                              start=b"GET /healthz HTTP/1.1") + post("b")), (200,), (), closes=True),
    # Tab and space are optional whitespace around a value (a trailing tab after "chunked" llhttp refuses).
    "te_with_tab_ows": Unusual(one(req(HOST, AUTH, CT, b"Transfer-Encoding:\tchunked ", body=CHUNKED_A)),
                               (200,), ("a",)),
    "expect_100_continue": Unusual(
        (Step((post("a", b"Expect: 100-continue")[:-len(chat("a"))],), 1), Step((chat("a"),), 1)),
        (100, 200), ("a",), continued),
    "leading_empty_line": Unusual(one(b"\r\n" + post("a")), (200,), ("a",)),
    "mixed_case_names": Unusual(one(req(b"hOsT: x", b"AUTHORIZATION: Bearer " + KEY, b"content-TYPE: application/json",
                                        b"cOnTeNt-LeNgTh: %d" % len(chat("a")), body=chat("a"))), (200,), ("a",)),
    "obs_text_in_a_value": Unusual(one(post("a", b"X-Note: caf\xe9 \x80\xff")), (200,), ("a",),
                                   not_forwarded("x-note")),
    "request_id_valid": Unusual(one(post("a", b"x-request-id: " + GOOD_ID.encode())), (200,), ("a",),
                                reflected_and_forwarded(GOOD_ID)),
    "request_id_with_space": Unusual(one(post("a", b"x-request-id: a b")), (200,), ("a",), replaced(b"a b")),
    "request_id_with_markup": Unusual(one(post("a", b"x-request-id: <script>")), (200,), ("a",), replaced(b"<script>")),
    "request_id_obs_text": Unusual(one(post("a", b"x-request-id: id\xe9")), (200,), ("a",), replaced(b"id\xe9")),
    "request_id_too_long": Unusual(one(post("a", b"x-request-id: " + b"r" * 201)), (200,), ("a",),
                                   replaced(b"r" * 201)),
    "trace_context_valid": Unusual(
        one(post("a", b"traceparent: " + TRACEPARENT.encode(), b"tracestate: " + TRACESTATE.encode())),
        (200,), ("a",), trace_forwarded(TRACEPARENT, TRACESTATE)),
    "traceparent_invalid_drops_tracestate": Unusual(
        one(post("a", b"traceparent: 00-zz-00f067aa0ba902b7-01", b"tracestate: " + TRACESTATE.encode())),
        (200,), ("a",), trace_forwarded(None, None)),
    "traceparent_all_zero_trace_id": Unusual(
        one(post("a", b"traceparent: 00-" + b"0" * 32 + b"-00f067aa0ba902b7-01", b"tracestate: k=v")),
        (200,), ("a",), trace_forwarded(None, None)),
    "tracestate_invalid_dropped_alone": Unusual(
        one(post("a", b"traceparent: " + TRACEPARENT.encode(), b"tracestate: Bad Key=1")),
        (200,), ("a",), trace_forwarded(TRACEPARENT, None)),
    "put_on_an_api_route": Unusual(
        (Step((req(HOST, AUTH, cl(0), start=b"PUT /v1/chat/completions HTTP/1.1") + post("a"),), 2),),
        (405, 200), ("a",), allow_post),
}


@pytest.mark.parametrize("name", list(UNUSUAL))
async def test_unusual_but_valid_requests_are_served(name):
    row = UNUSUAL[name]
    r = await rig()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", r.gw.port)
        replies: list[Reply] = []
        for step in row.steps:
            for piece in step.pieces:
                writer.write(piece)
                await writer.drain()
                if len(step.pieces) > 1:
                    await asyncio.sleep(0.002)  # each piece its own segment
            for _ in range(step.replies):
                replies.append(await read_response(reader))
        assert tuple(x.status for x in replies) == row.statuses, [x.body[:200] for x in replies]
        assert tuple(prompts(r.engine.knobs)) == row.prompts
        row.check(replies, r.engine.knobs)
        if row.closes:
            assert replies[-1].headers.get("connection") == "close"
            assert await rest_of_connection(reader) == b""
        else:  # still open: one more request on it is served
            assert "connection" not in replies[-1].headers or replies[-1].headers["connection"] == "keep-alive"
            writer.write(post("last"))
            assert (await read_response(reader)).status == 200
            assert prompts(r.engine.knobs)[-1] == "last"
        await close(writer)
    finally:
        await stop(r)
