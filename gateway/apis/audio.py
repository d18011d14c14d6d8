"""Audio transcriptions and translations: a multipart/form-data body, of which routing reads only the form fields."""

from __future__ import annotations

import re
from typing import Any, Final, Mapping

from gateway.apis.api import FORM, Api
from gateway.errors import bad_request

_BOUNDARY: Final = re.compile(r'boundary="?([^";]{1,200})"?', re.I)
_NAME: Final = re.compile(rb'name="([^"]{1,100})"', re.I)
FIELDS: Final[tuple[str, ...]] = ("model", "stream", "language", "prompt", "response_format")
FIELD_LIMIT: Final[int] = 4096  # a form field routing reads (a model name, a flag): longer ones are not ours to read


def form_fields(content_type: str, raw: bytes) -> dict[str, str]:
    """The small text fields of a multipart body (the file part is skipped, never copied): name -> value."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise bad_request("The request body must be multipart/form-data (a file and its form fields).",
                          code="invalid_content_type")
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise bad_request("The multipart/form-data body has no boundary.", code="invalid_content_type")
    delimiter = b"--" + m.group(1).encode("latin-1")
    out: dict[str, str] = {}
    i = raw.find(delimiter)
    while i >= 0:
        head_start = i + len(delimiter)
        if raw[head_start:head_start + 2] == b"--":
            break  # the closing delimiter
        head_end = raw.find(b"\r\n\r\n", head_start, head_start + 8192)
        if head_end < 0:
            break
        nxt = raw.find(b"\r\n" + delimiter, head_end)
        if nxt < 0:
            break
        head = raw[head_start:head_end]
        name = _NAME.search(head)
        if name is not None and b"filename=" not in head.lower():
            key = name.group(1).decode("latin-1")
            if key in FIELDS and nxt - head_end - 4 <= FIELD_LIMIT:
                out[key] = raw[head_end + 4:nxt].decode("utf-8", "replace")
        i = nxt + 2
    return out


def check(content_type: str, raw: bytes) -> dict[str, str]:
    """The form fields, with `model` required and a file part present."""
    fields = form_fields(content_type, raw)
    if not fields.get("model"):
        raise bad_request("you must provide a model parameter", param="model", code="missing_required_parameter")
    if b'filename="' not in raw and b"filename=" not in raw:
        raise bad_request("Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
    return fields


def with_form_model(raw: bytes, model: str) -> bytes:
    """The form with its `model` field's value replaced (an engine that serves the model under another name)."""
    i = raw.find(b'name="model"')
    if i < 0:
        return raw
    start = raw.find(b"\r\n\r\n", i)
    end = raw.find(b"\r\n--", start + 4) if start >= 0 else -1
    if start < 0 or end < 0:
        return raw
    return raw[:start + 4] + model.encode() + raw[end:]


class Audio(Api):
    """A form's text fields as the body routing reads (`stream` a boolean); the form itself goes on as sent."""

    def parse(self, raw: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
        fields: dict[str, Any] = check(headers.get("content-type", ""), raw)
        fields["stream"] = fields.get("stream", "").lower() == "true"
        return fields


_FORM_HEADERS: Final = (("content-type", "Content-Type"),)
TRANSCRIPTIONS: Final[Api] = Audio("transcriptions", "/v1/audio/transcriptions", "/v1/audio/transcriptions",
                                   body=FORM, passed_headers=_FORM_HEADERS)
TRANSLATIONS: Final[Api] = Audio("translations", "/v1/audio/translations", "/v1/audio/translations", body=FORM,
                                 passed_headers=_FORM_HEADERS)
