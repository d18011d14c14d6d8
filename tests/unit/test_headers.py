"""Grammars of forwarded and reflected header values, and the request-head checks llhttp leaves to the server."""

from __future__ import annotations

import pytest

from gateway.errors import GatewayError
from gateway.http.headers import safe_value, trace_headers, valid_request_id, valid_traceparent, valid_tracestate
from gateway.http.request_head import check_head, request_headers

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("value,ok", [
    ("req-123", True),
    ("0af7651916cd43dd8448eb211c80319c", True),
    ("b64+/=@:._-", True),
    ("a" * 200, True),
    ("a" * 201, False),
    ("", False),
    ("a b", False),  # a space: reflected it would split nothing, but it is no id either
    ("a\nGET / HTTP/1.1", False),
    ("a\rb", False),
    ("a\x00b", False),
    ("a,b", False),  # two ids joined from repeated headers
    ("caf\xe9", False),
    ("<script>", False),
])
def test_request_id_grammar(value, ok):
    assert (valid_request_id(value) == value) is ok


@pytest.mark.parametrize("value,ok", [
    (PARENT, True),
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00", True),
    ("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra", True),  # a later version may add fields
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra", False),  # version 00 may not
    ("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", False),
    ("00-00000000000000000000000000000000-b7ad6b7169203331-01", False),
    ("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", False),
    ("00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01", False),  # upper case
    ("00-abc-def-01", False),
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\nX: y", False),
    ("", False),
])
def test_traceparent_grammar(value, ok):
    assert valid_traceparent(value) is ok


@pytest.mark.parametrize("value,ok", [
    ("congo=t61rcWkgMzE", True),
    ("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE", True),
    ("rojo=00f067aa0ba902b7 ,\tcongo=t61rcWkgMzE", True),
    ("tenant@vendor=value", True),
    ("", True),  # an empty list is valid (and forwarded as nothing of note)
    ("Rojo=1", False),  # keys are lower case
    ("rojo=1,rojo=2", False),
    ("rojo=a=b", False),
    ("rojo=a,b", False),
    ("rojo=a\nb", False),
    (",".join(f"k{i}=v" for i in range(33)), False),
    ("k=" + "v" * 600, False),
])
def test_tracestate_grammar(value, ok):
    assert valid_tracestate(value) is ok


def test_trace_context_is_forwarded_only_whole_and_valid():
    assert trace_headers({"traceparent": PARENT, "tracestate": "a=1"}) == {"traceparent": PARENT, "tracestate": "a=1"}
    assert trace_headers({"traceparent": PARENT, "tracestate": "A=1"}) == {"traceparent": PARENT}
    # Without a valid traceparent its tracestate means nothing and goes nowhere.
    assert trace_headers({"traceparent": "00-abc", "tracestate": "a=1"}) == {}
    assert trace_headers({"tracestate": "a=1"}) == {}


@pytest.mark.parametrize("value,ok", [
    ("application/json", True), ("text/event-stream; charset=utf-8", True), ("caf\xe9", True), ("a\tb", False),
    ("a\rb", False), ("a\nb", False), ("a\x00b", False), ("a\x7fb", False),
])
def test_safe_value(value, ok):
    assert safe_value(value) is ok


def test_request_headers_join_repeats_and_refuse_repeated_singletons():
    assert request_headers(["Host: x", "Accept: a", "accept:  b  ", "Cookie: c=1", "Cookie: d=2"]) == \
        {"host": "x", "accept": "a, b", "cookie": "c=1; d=2"}
    for name in ("Host", "Authorization", "x-api-key", "Content-Length"):
        err = request_headers([f"{name}: a", f"{name.upper()}: b"])
        assert isinstance(err, GatewayError) and err.status == 400 and err.code == "duplicate_header"


@pytest.mark.parametrize("version,method,headers,upgrade,status", [
    ("1.1", "POST", {"host": "x"}, False, None),
    ("1.0", "POST", {}, False, None),
    ("1.1", "POST", {}, False, 400),  # no Host
    ("2.0", "POST", {"host": "x"}, False, 505),
    ("1.1", "POST", {"host": "x", "transfer-encoding": "gzip, chunked"}, False, 501),
    ("1.0", "POST", {"transfer-encoding": "chunked"}, False, 400),
    ("1.1", "POST", {"host": "x", "expect": "200-ok"}, False, 417),
    ("1.1", "CONNECT", {"host": "x"}, True, 405),
    ("1.1", "POST", {"host": "x", "content-length": "5"}, True, 400),
    ("1.1", "GET", {"host": "x", "upgrade": "h2c"}, True, None),  # the upgrade is ignored, the request served
])
def test_check_head(version, method, headers, upgrade, status):
    err = check_head(version, method, headers, upgrade)
    assert (err.status if err is not None else None) == status
