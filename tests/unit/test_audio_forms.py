"""Audio forms read strictly: hostile forms are refused with a 400, or read once and re-encoded so that any parser of
the result (python-multipart as Starlette runs it, the standard library's email parser, a naive scan) reads the same
fields the gateway routed by."""

from __future__ import annotations

import email.parser
import email.policy
import re

import pytest
from python_multipart import MultipartParser

from gateway.apis import audio
from gateway.errors import GatewayError

CT = "multipart/form-data; boundary=XyZ"
WAV = b"RIFF\x00\x01\x02WAVE" + bytes(range(256)) * 4


def part(head: bytes, data: bytes) -> bytes:
    return b"--XyZ\r\n" + head + b"\r\n\r\n" + data + b"\r\n"


def field(name: str, value: bytes) -> bytes:
    return part(b'Content-Disposition: form-data; name="' + name.encode() + b'"', value)


FILE = part(b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav', WAV)
END = b"--XyZ--\r\n"


def form(*parts: bytes) -> bytes:
    return b"".join(parts) + END


# (what it tries, content type, body, the model the gateway must read). Each is accepted, and what the engine gets
# must read the same to every parser.
ACCEPTED = [
    ("plain", CT, form(field("model", b"free"), FILE), "free"),
    ("a decoy parameter before the name", CT,
     form(part(b'Content-Disposition: form-data; xname="model"; name="note"', b"mk"), field("model", b"free"), FILE),
     "free"),
    ("the model after a field larger than any scan window", CT,
     form(field("notes", b"n" * 100_000), field("model", b"free"), FILE), "free"),
    ("the model after the file", CT, form(FILE, field("model", b"free")), "free"),
    ("parameter names in capitals", CT, form(part(b'Content-Disposition: form-data; NAME="model"', b"free"), FILE),
     "free"),
    ("a second form in the epilogue", CT,
     form(field("model", b"free"), FILE) + field("model", b"mk") + END, "free"),
    ("a quoted boundary and another parameter", 'multipart/form-data; charset=utf-8; boundary="XyZ"',
     form(field("model", b"free"), FILE), "free"),
    ("a filename that tries to close its quotes", CT,
     form(field("model", b"free"),
          part(b'Content-Disposition: form-data; name="file"; filename="a\\"; name=\\"model.wav"', WAV)), "free"),
    ("an array field given twice", CT,
     form(field("model", b"free"), field("timestamp_granularities[]", b"word"),
          field("timestamp_granularities[]", b"segment"), FILE), "free"),
]

# (what it tries, content type, body, the error code of the 400)
REFUSED = [
    ("not multipart", "application/json", form(field("model", b"mk"), FILE), "invalid_content_type"),
    ("no boundary", "multipart/form-data", form(field("model", b"mk"), FILE), "invalid_content_type"),
    ("two boundaries", "multipart/form-data; boundary=XyZ; boundary=Other", form(field("model", b"mk"), FILE),
     "invalid_content_type"),
    ("another boundary than the body's", "multipart/form-data; boundary=Other", form(field("model", b"mk"), FILE),
     "invalid_multipart"),
    ("a boundary with a quote in it", 'multipart/form-data; boundary="X\\"yZ"', form(field("model", b"mk"), FILE),
     "invalid_content_type"),
    ("a delimiter line inside the file that one parser takes as data", CT,
     form(field("model", b"free"), part(b'Content-Disposition: form-data; name="file"; filename="a.wav"',
                                        WAV + b"\r\n--XyZ\r")), "invalid_multipart"),
    ("the model only in a decoy", CT,
     form(part(b'Content-Disposition: form-data; xname="model"; name="note"', b"mk"), FILE),
     "missing_required_parameter"),
    ("the model twice", CT, form(field("model", b"free"), field("model", b"mk"), FILE), "duplicate_parameter"),
    ("the file twice", CT, form(field("model", b"free"), FILE, FILE), "duplicate_parameter"),
    ("a name given twice in one part", CT,
     form(part(b'Content-Disposition: form-data; name="note"; name="model"', b"mk"), FILE), "invalid_multipart"),
    ("two Content-Disposition headers", CT,
     form(part(b'Content-Disposition: form-data; name="note"\r\nContent-Disposition: form-data; name="model"',
               b"mk"), FILE), "invalid_multipart"),
    ("a bare LF splitting a header", CT,
     form(part(b'Content-Disposition: form-data; name="note"\n; name="model"', b"mk"), FILE), "invalid_multipart"),
    ("a header folded onto a second line", CT,
     form(part(b'Content-Disposition: form-data;\r\n name="model"', b"mk"), FILE), "invalid_multipart"),
    ("a name with an escaped quote", CT,
     form(part(b'Content-Disposition: form-data; name="a\\"; name=\\"model"', b"mk"), FILE), "invalid_multipart"),
    ("an extended name*", CT,
     form(part(b"Content-Disposition: form-data; name*=utf-8''model", b"mk"), FILE), "invalid_multipart"),
    ("a part without a name", CT, form(part(b"Content-Disposition: form-data", b"mk"), field("model", b"free"), FILE),
     "invalid_multipart"),
    ("a part without Content-Disposition", CT, form(part(b"Content-Type: text/plain", b"mk"), FILE),
     "invalid_multipart"),
    ("a base64 transfer encoding", CT,
     form(field("model", b"free"), part(b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                                        b"Content-Transfer-Encoding: base64", b"UklGRg==")), "invalid_multipart"),
    ("a preamble before the first boundary", CT, b"hello\r\n" + form(field("model", b"free"), FILE),
     "invalid_multipart"),
    ("truncated before the closing boundary", CT, field("model", b"free") + FILE, "invalid_multipart"),
    ("truncated inside a part", CT, field("model", b"free") + FILE[:40], "invalid_multipart"),
    ("the boundary inside a part's data", CT,
     form(field("model", b"free"), part(b'Content-Disposition: form-data; name="file"; filename="a.wav"',
                                        WAV + b"--XyZ\r\n" + WAV)), "invalid_multipart"),
    ("a model longer than the field limit", CT, form(field("model", b"m" * (audio.FIELD_LIMIT + 1)), FILE),
     "invalid_value"),
    ("a model that is not UTF-8", CT, form(field("model", b"m\xff"), FILE), "invalid_value"),
    ("no file", CT, form(field("model", b"free")), "missing_required_parameter"),
    ("the file as a plain field", CT, form(field("model", b"free"), field("file", WAV)), "missing_required_parameter"),
    ("too many parts", CT, form(field("model", b"free"), FILE, *(field(f"f{i}", b"x") for i in range(70))),
     "invalid_multipart"),
    ("too many headers in a part", CT,
     form(part(b'Content-Disposition: form-data; name="model"' + b"\r\nX-A: 1" * 10, b"free"), FILE),
     "invalid_multipart"),
    ("a header line too long", CT,
     form(part(b'Content-Disposition: form-data; name="model"; x="' + b"a" * 5000 + b'"', b"free"), FILE),
     "invalid_multipart"),
    ("a preamble of empty lines only, then nothing", CT, b"\r\n\r\n", "invalid_multipart"),
]


def python_multipart_fields(ctype: str, body: bytes) -> list[tuple[str, bytes, bool]]:
    """The form as Starlette reads it (python-multipart, its own Content-Disposition parsing): (name, data, file?)."""
    from python_multipart.multipart import parse_options_header
    _, params = parse_options_header(ctype)
    out: list[tuple[str, bytes, bool]] = []
    state: dict = {}

    def on_header_field(d, s, e):
        state["f"] = state.get("f", b"") + d[s:e]

    def on_header_value(d, s, e):
        state["v"] = state.get("v", b"") + d[s:e]

    def on_header_end():
        state.setdefault("h", {})[state.pop("f").lower()] = state.pop("v", b"")

    def on_headers_finished():
        _, opts = parse_options_header(state["h"][b"content-disposition"])
        out.append((opts[b"name"].decode(), b"", b"filename" in opts))
        state["h"] = {}

    def on_part_data(d, s, e):
        name, data, is_file = out[-1]
        out[-1] = (name, data + d[s:e], is_file)

    p = MultipartParser(params[b"boundary"], {"on_header_field": on_header_field, "on_header_value": on_header_value,
                                              "on_header_end": on_header_end, "on_part_data": on_part_data,
                                              "on_headers_finished": on_headers_finished})
    p.write(body)
    return out


def email_fields(ctype: str, body: bytes) -> list[tuple[str, bytes, bool]]:
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + body)
    assert not msg.defects
    return [(p.get_param("name", header="content-disposition"), p.get_payload(decode=True),
             p.get_filename() is not None) for p in msg.iter_parts()]


def naive_fields(ctype: str, body: bytes) -> list[tuple[str, bytes, bool]]:
    """A scan that takes the first name="..." of each part's head (as the gateway once did)."""
    boundary = re.search(r'boundary="?([^";]+)', ctype).group(1).encode()
    out = []
    for chunk in body.split(b"\r\n--" + boundary)[:-1]:
        chunk = chunk.removeprefix(b"--" + boundary)
        head, _, data = chunk.partition(b"\r\n\r\n")
        out.append((re.search(rb'name="([^"]*)"', head).group(1).decode(), data, b"filename=" in head))
    return out


@pytest.mark.parametrize("what,ctype,body,model", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_an_accepted_form_reaches_the_engine_as_the_gateway_read_it(what, ctype, body, model):
    fields = audio.check(ctype, body)
    assert fields["model"] == model
    sent_type = audio.forwarded_content_type(ctype)
    sent = fields[audio.FORM_KEY].encode("native-" + model)
    readings = [read(sent_type, sent) for read in (python_multipart_fields, email_fields, naive_fields)]
    assert readings[0] == readings[1] == readings[2], what
    names = [name for name, _, _ in readings[0]]
    assert names.count("model") == 1 and names.count("file") == 1
    assert dict((n, d) for n, d, _ in readings[0])["model"] == b"native-" + model.encode()
    assert [n for n, _, _ in readings[0]] == [p.name for p in fields[audio.FORM_KEY].parts]
    files = [d for n, d, f in readings[0] if f]
    assert files and all(d.startswith(WAV) for d in files)  # the file's bytes pass on as they came


@pytest.mark.parametrize("what,ctype,body,code", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_hostile_form_is_a_400_in_openais_shape(what, ctype, body, code):
    with pytest.raises(GatewayError) as e:
        audio.TRANSCRIPTIONS.parse(body, {"content-type": ctype})
    err = e.value.payload()["error"]
    assert e.value.status == 400 and err["code"] == code, what
    assert err["type"] == "invalid_request_error" and "mk" not in err["message"]


def test_stream_is_passed_on_as_the_gateway_reads_it():
    for sent, streams in ((b"true", True), (b"TRUE", True), (b"1", False), (b"yes", False), (b"false", False)):
        body = audio.TRANSCRIPTIONS.parse(form(field("model", b"m"), field("stream", sent), FILE),
                                          {"content-type": CT})
        assert body["stream"] is streams
        got = dict((n, d) for n, d, _ in python_multipart_fields(CT, body[audio.FORM_KEY].encode("m")))
        assert got["stream"] == (b"true" if streams else b"false")


def test_the_forwarded_content_type_is_plain():
    assert audio.forwarded_content_type('Multipart/Form-Data; charset=x; boundary="a b"') == \
        'multipart/form-data; boundary="a b"'
    assert audio.forwarded_content_type("multipart/form-data;boundary=abc") == "multipart/form-data; boundary=abc"
