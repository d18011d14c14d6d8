"""What llhttp leaves to the server in a request head (RFC 9112): fields as one dict, Host, codings, Expect, upgrades."""

from __future__ import annotations

from typing import Final

from gateway.errors import GatewayError

# Fields a request may carry once: two Host headers, or two credentials, have no one meaning.
SINGLE: Final = frozenset({"host", "authorization", "x-api-key", "content-length"})


def refusal(status: int, message: str, code: str) -> GatewayError:
    return GatewayError(status, message, code=code)


def request_headers(lines: list[str]) -> dict[str, str] | GatewayError:
    """The header lines of a head llhttp accepted, as a dict of lower-case names; a repeated field is joined,
    or refused where it must be single.

    Strict llhttp has checked every line is `name ":" OWS value OWS` (a token name, no CR, LF or NUL, no
    folding), so splitting at the first colon is exact.
    """
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.lower()] = value.strip(" \t")
    if len(headers) == len(lines):
        return headers
    headers = {}  # some name repeats: the rare path
    for line in lines:
        name, _, value = line.partition(":")
        name, value = name.lower(), value.strip(" \t")
        if name in headers:
            if name in SINGLE:
                return refusal(400, f"The request has more than one {name} header.", "duplicate_header")
            value = f"{headers[name]}{'; ' if name == 'cookie' else ', '}{value}"
        headers[name] = value
    return headers


def check_head(version: str, method: str, headers: dict[str, str], upgrade: bool) -> GatewayError | None:
    """What llhttp leaves to the server (RFC 9112): Host, the transfer codings served, Expect, upgrades."""
    if version not in ("1.1", "1.0"):
        return refusal(505, f"HTTP/{version} is not supported.", "http_version_not_supported")
    if version == "1.1" and "host" not in headers:
        return refusal(400, "The request has no Host header.", "missing_host")
    te = headers.get("transfer-encoding")
    if te is not None and version == "1.0":
        return refusal(400, "HTTP/1.0 has no transfer codings.", "bad_http_request")
    if te is not None and te.lower() != "chunked":
        return refusal(501, "Only the chunked transfer coding is supported.", "unsupported_transfer_encoding")
    expect = headers.get("expect")
    if expect is not None and expect.lower() != "100-continue":
        return refusal(417, "Only 'Expect: 100-continue' is supported.", "expectation_failed")
    if upgrade:
        if method == "CONNECT":
            return refusal(405, "CONNECT is not supported.", "method_not_allowed")
        if te is not None or headers.get("content-length", "0") != "0":
            return refusal(400, "A protocol upgrade with a request body is not supported.", "bad_http_request")
    return None
