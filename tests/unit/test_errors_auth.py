"""Error normalisation of the three engine error shapes, and API-key authentication."""

from __future__ import annotations

import orjson
import pytest
from multidict import CIMultiDict

from gateway.config import AuthConfig
from gateway.errors import GatewayError, error_from_event, normalize_engine_error
from gateway.keys.auth import Authenticator, presented_key
from gateway.keys.principal import hash_key


@pytest.mark.parametrize("status,raw,code,param", [
    (404, b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":"model","code":404}}',
     "model_not_found", "model"),
    (400, b'{"object":"error","message":"bad top_p","type":"BadRequestError","param":null,"code":400}', None, None),
    (503, b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}', "server_is_overloaded", None),
    (500, b"Internal Server Error", None, None),
    (429, b"", "rate_limit_exceeded", None),
])
def test_normalize_engine_error_shapes(status, raw, code, param):
    e = normalize_engine_error(status, raw)
    body = orjson.loads(e.body())
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert e.status == status and e.code == code and e.param == param
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_llamacpp_context_error_keeps_its_numbers():
    e = normalize_engine_error(400, b'{"error":{"code":400,"message":"request (10 tokens) exceeds the available '
                                    b'context size (8 tokens), try increasing it","type":"exceed_context_size_error",'
                                    b'"n_prompt_tokens":10,"n_ctx":8}}')
    err = e.payload()["error"]
    assert err["code"] == "context_length_exceeded" and err["n_ctx"] == 8 and err["n_prompt_tokens"] == 10


def test_in_band_error_event():
    e = error_from_event({"error": {"object": "error", "message": "boom", "type": "x", "code": 400}})
    assert e.status == 400 and e.message == "boom"
    assert e.sse_event().startswith(b'data: {"error":') and e.sse_event().endswith(b"\n\n")
    assert error_from_event({"error": {"message": "x"}}).status == 500


def test_gateway_error_type_from_status():
    assert GatewayError(401, "x").type == "authentication_error"
    assert GatewayError(503, "x").type == "service_unavailable_error"


KEYS = AuthConfig(keys=[{"id": "alice", "sha256": hash_key("k-alice")},
                        {"id": "root", "sha256": hash_key("k-root"), "admin": True}])


@pytest.mark.parametrize("headers,who", [
    ({"Authorization": "Bearer k-alice"}, "alice"),
    ({"Authorization": "bearer k-root"}, "root"),
    ({"x-api-key": "k-alice"}, "alice"),
    ({"Authorization": "Basic k-alice"}, None),
    ({"Authorization": "Bearer k-nobody"}, None),
    ({}, None),
])
def test_authenticate(headers, who):
    a = Authenticator(KEYS)
    # Headers as aiohttp gives them (case-insensitive) and as the front gives them (names in lower case);
    # twice each, since a key that proved valid is remembered.
    for hs in (CIMultiDict(headers), {k.lower(): v for k, v in headers.items()}) * 2:
        if who is None:
            with pytest.raises(GatewayError) as ei:
                a.authenticate(hs)
            assert ei.value.status == 401
            assert "k-" not in ei.value.message  # a key is never echoed
        else:
            assert a.authenticate(hs).id == who


def test_admin_and_disabled_auth():
    a = Authenticator(KEYS)
    assert a.admin_for_key("k-root") == "root" and a.admin_for_key("k-alice") is None
    with pytest.raises(GatewayError) as ei:
        a.require_admin({"x-api-key": "k-alice"})
    assert ei.value.status == 403
    assert Authenticator(AuthConfig(enabled=False)).authenticate({}).id == "anonymous"
    assert presented_key({"authorization": "Bearer   "}) is None
