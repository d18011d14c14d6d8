"""Audio transcriptions and translations: a multipart/form-data body read once, strictly, and passed on re-encoded,
so that the engine reads exactly the fields the gateway routed and rate-limited by."""

from __future__ import annotations

import logging
import re
from typing import Any, Final, Mapping

from python_multipart import MultipartParser
from python_multipart.exceptions import MultipartParseError

from gateway.apis.api import FORM, Api
from gateway.errors import GatewayError, bad_request

# Why the form is re-encoded rather than passed on: the engines parse forms with parsers of their own (vLLM and
# SGLang through Starlette and python-multipart, llama-server through cpp-httplib), and parsers disagree on
# hostile framing: a decoy parameter (`xname="model"; name="note"`), a name given twice, a boundary that reappears
# inside a part, a preamble, a second boundary parameter. Whatever the client sent, the engine gets a form of the
# gateway's making: every part the gateway read, with only the headers it understood, in a framing every parser
# reads the same way; the `model` field carries the engine's own name for the model the gateway routed.

FIELDS: Final[tuple[str, ...]] = ("model", "stream", "language", "prompt", "response_format")
FIELD_LIMIT: Final[int] = 4096  # a field routing reads (a model name, a flag): a longer one is refused
MAX_PARTS: Final[int] = 64  # an audio form has a file and a dozen small fields
MAX_PART_HEADERS: Final[int] = 8
MAX_HEADER_LINE: Final[int] = 2048
# The key of a form route's body under which the parsed form is kept for the adapter to encode (never a form
# field's name: only FIELDS become keys of the body).
FORM_KEY: Final[str] = "\x00form"

_TOKEN: Final = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
# One `; name=value` parameter of a header value: a token or a quoted string (a backslash escapes one character).
_PARAM: Final = re.compile(r'[ \t]*;[ \t]*(' + _TOKEN + r')[ \t]*=[ \t]*(?:"((?:[^"\\\x00-\x1f]|\\[^\x00-\x1f])*)"|('
                           + _TOKEN + r'))')
_ESCAPED: Final = re.compile(r"\\(.)")
_TRAILER: Final = re.compile(r"[ \t]*;?[ \t]*")
_BOUNDARY: Final = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")  # RFC 2046 bchars
_PART_TYPE: Final = re.compile(_TOKEN + "/" + _TOKEN)
_NAME: Final = re.compile(r'[^"\\\x00-\x1f\x7f]{1,200}')  # a field name as it can be written back unescaped
_UNSAFE_FILENAME: Final = re.compile(r'["\\\x00-\x1f\x7f]')
_CONTENT_TYPE_LIMIT: Final[int] = 1024  # what the front passes on as a form's Content-Type (gateway/http/headers.py)

# The parser logs each malformed form at WARNING: a hostile client would write the log. The 400 says it instead.
_QUIET: Final = logging.getLogger("shapegate.multipart")
_QUIET.disabled = True


class Part:
    """One part of a form: its name, file name and type as read, and its data as spans of the body."""

    __slots__ = ("name", "filename", "content_type", "spans", "size")

    def __init__(self, name: str, filename: str | None, content_type: str | None) -> None:
        self.name = name
        self.filename = filename
        self.content_type = content_type
        self.spans: list[tuple[bytes, int, int]] = []  # (buffer, start, end): the data, never copied until encoded
        self.size = 0

    def value(self) -> bytes:
        return b"".join(memoryview(buf)[s:e] for buf, s, e in self.spans)


class Form:
    """A parsed form: its boundary and parts, in order, and the body they were read from."""

    __slots__ = ("boundary", "parts", "raw")

    def __init__(self, boundary: str, parts: list[Part], raw: bytes) -> None:
        self.boundary = boundary
        self.parts = parts
        self.raw = raw

    def encode(self, model: str) -> bytes:
        """The form as the engine gets it: every part, canonical headers, `model` set to the engine's name. When
        that is byte for byte what the client sent (as the SDKs write forms), the client's body itself: no copy."""
        delimiter = b"--" + self.boundary.encode("latin-1")
        out: list[bytes | tuple[bytes, int, int]] = []
        for p in self.parts:
            head = 'Content-Disposition: form-data; name="' + p.name + '"'
            if p.filename is not None:
                head += '; filename="' + p.filename + '"'
            if p.content_type is not None:
                head += "\r\nContent-Type: " + p.content_type
            out.append(delimiter + b"\r\n" + head.encode("utf-8") + b"\r\n\r\n")
            if p.name == "model" and p.filename is None:
                out.append(model.encode("utf-8"))
            else:
                out.extend(p.spans)
            out.append(b"\r\n")
        out.append(delimiter + b"--\r\n")
        if self._is_raw(out):
            return self.raw
        return b"".join(memoryview(x[0])[x[1]:x[2]] if isinstance(x, tuple) else x for x in out)

    def _is_raw(self, pieces: list[bytes | tuple[bytes, int, int]]) -> bool:
        """Whether the pieces, laid end to end, are the client's body: its spans in place, the rest equal."""
        raw = self.raw
        pos = 0
        for x in pieces:
            if isinstance(x, tuple):
                if x[0] is not raw or x[1] != pos:
                    return False
                pos = x[2]
            elif raw.startswith(x, pos):
                pos += len(x)
            else:
                return False
        return pos == len(raw)


def _malformed(what: str) -> GatewayError:
    return bad_request(f"The multipart/form-data body is malformed: {what}.", code="invalid_multipart")


def _params(value: str, start: int) -> dict[str, str] | None:
    """The `; name=value` parameters of a header value from `start`, names lower-cased; None when the value does not
    parse as such or names a parameter twice (ambiguous: parsers differ on which one counts)."""
    out: dict[str, str] = {}
    pos = start
    while True:
        m = _PARAM.match(value, pos)
        if m is None:
            break
        key = m.group(1).lower()
        if key in out:
            return None
        quoted = m.group(2)
        out[key] = _ESCAPED.sub(r"\1", quoted) if quoted is not None else m.group(3)
        pos = m.end()
    return out if _TRAILER.fullmatch(value, pos) else None


def boundary_of(content_type: str) -> str:
    """The boundary of a multipart/form-data Content-Type, read strictly (a 400 for anything ambiguous)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise bad_request("The request body must be multipart/form-data (a file and its form fields).",
                          code="invalid_content_type")
    if len(content_type) > _CONTENT_TYPE_LIMIT or not content_type.isprintable():
        raise bad_request("The multipart/form-data Content-Type is too long or holds control characters.",
                          code="invalid_content_type")
    params = _params(content_type, len("multipart/form-data"))
    if params is None:
        raise bad_request("The multipart/form-data Content-Type does not parse (or names a parameter twice).",
                          code="invalid_content_type")
    boundary = params.get("boundary")
    if boundary is None:
        raise bad_request("The multipart/form-data body has no boundary.", code="invalid_content_type")
    if not _BOUNDARY.fullmatch(boundary):
        raise bad_request("The multipart/form-data boundary is not 1 to 70 of the characters RFC 2046 allows.",
                          code="invalid_content_type")
    return boundary


def forwarded_content_type(content_type: str) -> str:
    """The Content-Type the engine gets with a form: the client's boundary (which the form is re-encoded with),
    written plainly, and nothing else of what the client sent."""
    boundary = boundary_of(content_type)
    plain = re.fullmatch(_TOKEN, boundary) is not None
    return "multipart/form-data; boundary=" + (boundary if plain else '"' + boundary + '"')


class _Reader:
    """The callbacks of one parse: each part's headers, checked as they end, and its data's spans."""

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.part: Part | None = None
        self.headers: dict[str, str] = {}
        self.field = bytearray()
        self.value = bytearray()
        self.ended = False

    def callbacks(self) -> Any:
        return {"on_part_begin": self.part_begin, "on_header_field": self.header_field,
                "on_header_value": self.header_value, "on_header_end": self.header_end,
                "on_headers_finished": self.headers_finished, "on_part_data": self.part_data, "on_end": self.end}

    def part_begin(self) -> None:
        if len(self.parts) >= MAX_PARTS:
            raise bad_request(f"The form has more than {MAX_PARTS} parts.", code="invalid_multipart")
        self.headers = {}
        self.part = None

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self.field += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self.value += data[start:end]

    def header_end(self) -> None:
        name = self.field.decode("latin-1").strip().lower()
        value = self.value.decode("utf-8", "replace").strip(" \t")
        self.field.clear()
        self.value.clear()
        if name in self.headers:
            raise _malformed(f"a part has two {name} headers")
        self.headers[name] = value

    def headers_finished(self) -> None:
        self.part = part = _part(self.headers)
        self.parts.append(part)

    def part_data(self, data: bytes, start: int, end: int) -> None:
        part = self.part
        if part is None or end <= start:
            return
        if part.filename is None and part.name in FIELDS and part.size + end - start > FIELD_LIMIT:
            raise bad_request(f"The form field '{part.name}' is longer than {FIELD_LIMIT} bytes.", param=part.name,
                              code="invalid_value")
        part.spans.append((data, start, end))
        part.size += end - start

    def end(self) -> None:
        self.ended = True


def _part(headers: dict[str, str]) -> Part:
    """A part from its headers: a form-data disposition with a name, unambiguous, in a form that can be written back."""
    disposition = headers.get("content-disposition")
    if disposition is None:
        raise _malformed("a part has no Content-Disposition")
    if not disposition.lower().startswith("form-data"):
        raise _malformed("a part's Content-Disposition is not form-data")
    params = _params(disposition, len("form-data"))
    if params is None:
        raise _malformed("a part's Content-Disposition does not parse (or names a parameter twice)")
    name = params.get("name")
    if name is None or "name*" in params:
        raise _malformed("a part has no plain name")
    if not _NAME.fullmatch(name):
        raise _malformed("a part's name is empty, too long, or holds quotes, backslashes or control characters")
    filename = params.get("filename")
    if filename is None and "filename*" in params:  # RFC 5987 form (charset'lang'percent-encoded): the name alone
        filename = params["filename*"].rpartition("'")[2]
    if filename is not None:
        filename = _UNSAFE_FILENAME.sub("_", filename)[:255]  # only ever read for its extension
    encoding = headers.get("content-transfer-encoding")
    if encoding is not None and encoding.lower() not in ("7bit", "8bit", "binary"):
        raise _malformed("a part has a Content-Transfer-Encoding (forms send their bytes as they are)")
    ctype = headers.get("content-type")
    if ctype is not None:
        ctype = ctype.partition(";")[0].strip()
        ctype = ctype if _PART_TYPE.fullmatch(ctype) else "application/octet-stream"
    return Part(name, filename, ctype)


def read_form(content_type: str, raw: bytes) -> Form:
    """The whole form, parsed once (a 400 in OpenAI's shape for a form that is malformed, truncated or ambiguous)."""
    boundary = boundary_of(content_type)
    reader = _Reader()
    parser = MultipartParser(boundary.encode("latin-1"), reader.callbacks(), max_header_count=MAX_PART_HEADERS,
                             max_header_size=MAX_HEADER_LINE)
    parser.logger = _QUIET
    try:
        parser.write(raw)
    except MultipartParseError:
        raise _malformed("its framing or a part's headers do not parse") from None
    if not reader.ended:
        raise _malformed("it ends before its closing boundary")
    delimiter = b"--" + boundary.encode("latin-1")
    seen: set[str] = set()
    for part in reader.parts:
        # Arrays (`timestamp_granularities[]`) repeat; any other name given twice is read differently by different
        # parsers (the first, the last, a list), so it is refused rather than guessed.
        if part.name in seen and not part.name.endswith("[]"):
            raise bad_request(f"The form gives the field '{part.name}' more than once.", param=part.name,
                              code="duplicate_parameter")
        seen.add(part.name)
        # The parser takes a delimiter followed by neither CRLF nor "--" as data; a laxer one would end the part.
        if _holds(part, delimiter):
            raise _malformed("a part's data holds the boundary")
    return Form(boundary, reader.parts, raw)


def _holds(part: Part, needle: bytes) -> bool:
    if len(part.spans) == 1:  # the body written to the parser at once: one span of it, searched in place
        buf, start, end = part.spans[0]
        return buf.find(needle, start, end) >= 0
    return part.value().find(needle) >= 0


def check(content_type: str, raw: bytes) -> dict[str, Any]:
    """The fields routing reads (name -> text), `model` required and a file present; under FORM_KEY the parsed form,
    which the engine's adapter encodes (Form.encode) as the body it sends."""
    form = read_form(content_type, raw)
    out: dict[str, Any] = {}
    has_file = False
    for part in form.parts:
        if part.filename is not None:
            has_file = has_file or part.name == "file"
            continue
        if part.name in FIELDS:
            try:
                value = out[part.name] = part.value().decode("utf-8")
            except UnicodeDecodeError:
                raise bad_request(f"The form field '{part.name}' is not UTF-8 text.", param=part.name,
                                  code="invalid_value") from None
            if part.name == "stream":  # the engine streams exactly when the gateway relays a stream
                out["stream"] = "true" if value.lower() == "true" else "false"
                part.spans = [(out["stream"].encode(), 0, len(out["stream"]))]
    if not out.get("model"):
        raise bad_request("you must provide a model parameter", param="model", code="missing_required_parameter")
    if not has_file:
        raise bad_request("Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
    out[FORM_KEY] = form
    return out


class Audio(Api):
    """A form's text fields as the body routing reads (`stream` a boolean), the parsed form under FORM_KEY (the
    engine is sent it re-encoded)."""

    def parse(self, raw: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
        fields: dict[str, Any] = check(headers.get("content-type", ""), raw)
        fields["stream"] = fields.get("stream", "").lower() == "true"
        return fields


_FORM_HEADERS: Final = (("content-type", "Content-Type"),)
TRANSCRIPTIONS: Final[Api] = Audio("transcriptions", "/v1/audio/transcriptions", "/v1/audio/transcriptions",
                                   body=FORM, passed_headers=_FORM_HEADERS)
TRANSLATIONS: Final[Api] = Audio("translations", "/v1/audio/translations", "/v1/audio/translations", body=FORM,
                                 passed_headers=_FORM_HEADERS)
