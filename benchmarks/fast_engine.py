"""A zero-delay engine on raw asyncio (uvloop), chat, Responses and Messages: the floor the gateway is measured against."""

from __future__ import annotations

import argparse
import asyncio
import os

import orjson
import uvloop

MODEL = "bench"
# Every reply to /v1/responses gets an id of its own, vLLM's form (resp_ and 32 hex): written in the prepared bytes
# as this placeholder, replaced per reply (a gateway that indexes stored responses sees a new one each time).
RESP_ID = "resp_" + "0" * 32
ITEM_ID, MSG_ITEM_ID = "1" * 32, "msg_" + "2" * 32  # vLLM streams its item under a bare uuid, finishes it as msg_


def _reply(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


def _nonstream_reply() -> bytes:
    text = " ".join(f"tok{i}" for i in range(16))
    return _reply(orjson.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "created": 1, "model": MODEL,
                                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                             "finish_reason": "length"}],
                                "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24}}))


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj: dict, kind: str | None = None) -> bytes:
    """One SSE event; with `kind`, an `event:` line first (the Responses and Messages streams)."""
    return (b"event: %s\n" % kind.encode() if kind else b"") + b"data: " + orjson.dumps(obj) + b"\n\n"


def _stream_events(n: int) -> list[bytes]:
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    events = [_event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": None}]})]
    events += [_event({**base, "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]})
               for i in range(n)]
    events.append(_event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
    events.append(_event({**base, "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n,
                                                            "total_tokens": 8 + n}}))
    events.append(b"data: [DONE]\n\n")
    return [_chunk(e) for e in events]


# -- the Responses API, as vLLM writes it --------------------------------------------------------
def _response(status: str, n: int, text: str | None) -> dict:
    """vLLM's Response object: the request's settings echoed, the output and usage once it is done."""
    output = [] if text is None else [{"id": MSG_ITEM_ID, "type": "message", "role": "assistant", "status": status,
                                       "content": [{"type": "output_text", "text": text, "annotations": [],
                                                    "logprobs": None}]}]
    usage = None if text is None else {
        "input_tokens": 8, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8 + n}
    return {"id": RESP_ID, "created_at": 1, "incomplete_details": None, "instructions": None, "metadata": None,
            "model": MODEL, "object": "response", "output": output, "parallel_tool_calls": True, "temperature": 1.0,
            "tool_choice": "none", "tools": [], "top_p": 1.0, "background": False, "max_output_tokens": n,
            "max_tool_calls": None, "previous_response_id": None, "prompt": None, "reasoning": None,
            "service_tier": "auto", "status": status, "text": None, "top_logprobs": None, "truncation": "disabled",
            "usage": usage, "user": None}


def _responses_events(n: int) -> list[bytes]:
    """response.created ... one response.output_text.delta per token ... response.completed (with usage)."""
    text = "".join(f"tok{i} " for i in range(n))
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    at = {"output_index": 0, "content_index": 0, "item_id": ITEM_ID}
    kinds: list[tuple[str, dict]] = [
        ("response.created", {"response": _response("in_progress", n, None)}),
        ("response.in_progress", {"response": _response("in_progress", n, None)}),
        ("response.output_item.added", {"output_index": 0, "item": {
            "id": ITEM_ID, "type": "message", "role": "assistant", "content": [], "status": "in_progress"}}),
        ("response.content_part.added", {**at, "part": part})]
    kinds += [("response.output_text.delta", {**at, "delta": f"tok{i} ", "logprobs": []}) for i in range(n)]
    kinds += [("response.output_text.done", {**at, "text": text, "logprobs": []}),
              ("response.content_part.done", {**at, "part": {**part, "text": text, "logprobs": None}}),
              ("response.output_item.done", {"output_index": 0, "item": _response("completed", n, text)["output"][0]}),
              ("response.completed", {"response": _response("completed", n, text)})]
    return [_chunk(_event({"type": kind, "sequence_number": seq, **fields}, kind))
            for seq, (kind, fields) in enumerate(kinds)]


# -- Anthropic's Messages API, as vLLM writes it -------------------------------------------------
def _message(n: int, text: str | None) -> dict:
    return {"id": "chatcmpl-bench", "type": "message", "role": "assistant",
            "content": [] if text is None else [{"type": "text", "text": text}], "model": MODEL,
            "stop_reason": None if text is None else "max_tokens", "stop_sequence": None,
            "usage": {"input_tokens": 8, "output_tokens": 0 if text is None else n}}


def _messages_events(n: int) -> list[bytes]:
    """message_start, content_block_start, one content_block_delta per token, content_block_stop, message_delta
    (usage), message_stop."""
    events: list[dict] = [{"type": "message_start", "message": _message(n, None)},
                          {"type": "content_block_start", "index": 0,
                           "content_block": {"type": "text", "text": ""}}]
    events += [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": f"tok{i} "}}
               for i in range(n)]
    events += [{"type": "content_block_stop", "index": 0},
               {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                "usage": {"input_tokens": 8, "output_tokens": n}},
               {"type": "message_stop"}]
    return [_chunk(_event(e, e["type"])) for e in events]


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


def _streamed(events: list[bytes]) -> bytes:
    """A whole streamed reply: head, chunked events and the last chunk."""
    return STREAM_HEAD + b"".join(events) + b"0\r\n\r\n"


# GET routes that routers in front of an engine read when they add it: the OpenAI model list, and SGLang's
# /server_info and /model_info (sglang-router asks for both; it reads model_path from them to load a tokenizer,
# so none is given: there is no tokenizer here to load). Any other GET answers an empty 200, as /health does.
GET_REPLIES = {
    b"/v1/models": _reply(orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 1,
                                                                    "owned_by": "bench"}]})),
    b"/server_info": _reply(orjson.dumps({"served_model_name": MODEL, "version": "bench"})),
    b"/model_info": _reply(orjson.dumps({"is_generation": True})),
}


def replies(chunks: int) -> dict[bytes, tuple[bytes, bytes, bytes]]:
    """POST path -> (non-streamed, streamed, streamed without the usage chunk); chat's under b"" (any other path).
    The non-streamed replies have 16 tokens, the streams `chunks` token events."""
    chat = _stream_events(chunks)
    resp, msgs = _responses_events(chunks), _messages_events(chunks)
    text = " ".join(f"tok{i}" for i in range(16))
    return {
        b"": (_nonstream_reply(), _streamed(chat), _streamed(chat[:-2] + chat[-1:])),
        b"/v1/responses": (_reply(orjson.dumps(_response("completed", 16, text))), _streamed(resp), _streamed(resp)),
        b"/v1/messages": (_reply(orjson.dumps(_message(16, text))), _streamed(msgs), _streamed(msgs)),
    }


class EngineProtocol(asyncio.Protocol):
    """Keep-alive HTTP/1.1: reads whole requests, answers each at once (one write per reply)."""

    def __init__(self, by_path: dict[bytes, tuple[bytes, bytes, bytes]]) -> None:
        self.buf = b""
        self.by_path = by_path

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            length = 0
            if i >= 0:
                j = head.find(b"\r\n", i)
                length = int(head[i + 15:j if j > 0 else len(head)])
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            if head.startswith(b"pri * http/2"):  # an HTTP/2 (gRPC) probe: not spoken here, refused at once
                self.transport.close()
                return
            path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            if not head.startswith(b"post"):
                self.transport.write(GET_REPLIES.get(path, HEALTH))
                continue
            nonstream, stream, no_usage = self.by_path.get(path.split(b"?", 1)[0]) or self.by_path[b""]
            if b'"stream":true' not in body and b'"stream": true' not in body:
                reply = nonstream
            elif b'"include_usage":true' in body or b'"include_usage": true' in body:
                reply = stream
            else:
                reply = no_usage
            if path.startswith(b"/v1/responses"):  # a fresh id, the placeholder's length
                reply = reply.replace(RESP_ID.encode(), b"resp_" + os.urandom(16).hex().encode())
            self.transport.write(reply)


async def serve(host: str, port: int, chunks: int) -> None:
    loop = asyncio.get_running_loop()
    # One write per reply. Written event by event (200 send calls), a client on this process's core saw 1.35 ms of
    # first-token latency added by a gateway at c=1 against 0.47 ms on the gateway's core (2 cores): the engine's
    # own sending was in the measure. With one write, 0.45-0.50 ms wherever the client ran.
    by_path = replies(chunks)
    server = await loop.create_server(lambda: EngineProtocol(by_path), host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunks", type=int, default=200)
    a = p.parse_args()
    uvloop.run(serve(a.host, a.port, a.chunks))


if __name__ == "__main__":
    main()
