"""Reading HTTP/1.1 replies off raw bytes for wire tests: strict about the head, framing as RFC 9112 says."""

from __future__ import annotations

import re

STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-5]\d\d) [\t\x20-\x7e\x80-\xff]*")
# A field line as a server may write it: a token, a colon, a value with no control character but tab.
FIELD_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*")

Reply = tuple[int, list[tuple[str, str]], bytes]


class BadReply(AssertionError):
    """The bytes are not a sequence of well-formed replies."""


def parse_replies(data: bytes, head_first: bool = False) -> tuple[list[Reply], bytes]:
    """The complete replies at the start of `data` (interim 1xx ones skipped), and the bytes left over (a reply
    not complete yet). A body with neither Content-Length nor chunked coding runs to the end of `data`.
    head_first: the first reply answers a HEAD request (a head only, whatever its fields say)."""
    replies: list[Reply] = []
    while data:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            break
        lines = data[:end].split(b"\r\n")
        m = STATUS_LINE.fullmatch(lines[0])
        if m is None:
            raise BadReply(f"not a status line: {lines[0][:100]!r}")
        for line in lines[1:]:
            if FIELD_LINE.fullmatch(line) is None:
                raise BadReply(f"not a field line: {line[:100]!r}")
        fields = [(k.decode("latin-1").lower(), v.decode("latin-1").strip(" \t"))
                  for k, _, v in (ln.partition(b":") for ln in lines[1:])]
        h = dict(fields)
        rest = data[end + 4:]
        status = int(m.group(1))
        if status < 200:  # 100 Continue: no body, the real reply follows
            data = rest
            continue
        if status in (204, 304) or (head_first and not replies):
            body, data = b"", rest
        elif h.get("transfer-encoding", "").lower() == "chunked":
            parts, pos = [], 0
            while True:
                eol = rest.find(b"\r\n", pos)
                if eol < 0:
                    return replies, data
                size_text = rest[pos:eol]
                if not re.fullmatch(rb"[0-9a-fA-F]{1,15}", size_text):
                    raise BadReply(f"not a chunk size: {size_text[:40]!r}")
                size = int(size_text, 16)
                if len(rest) < eol + 2 + size + 2:
                    return replies, data
                if rest[eol + 2 + size:eol + 4 + size] != b"\r\n":
                    raise BadReply("a chunk not followed by CRLF")
                parts.append(rest[eol + 2:eol + 2 + size])
                pos = eol + 4 + size
                if size == 0:
                    break
            body, data = b"".join(parts), rest[pos:]
        elif "content-length" in h:
            if not h["content-length"].isdigit():
                raise BadReply(f"not a length: {h['content-length']!r}")
            n = int(h["content-length"])
            if len(rest) < n:
                break
            body, data = rest[:n], rest[n:]
        else:
            body, data = rest, b""
        replies.append((status, fields, body))
    return replies, data
