"""Signed dashboard session tokens: principal + expiry under HMAC-SHA256, never the API key; optionally bound
to the key that opened the session, so that revoking (or replacing) the key ends the session at once."""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
from collections.abc import Callable

import orjson

# A shorter secret makes the HMAC guessable offline from one captured cookie.
MIN_SECRET_BYTES = 16


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, body: str) -> bytes:
    # The domain prefix keeps this MAC from ever validating a value signed for another purpose
    # with the same secret.
    return hmac.new(secret, b"shapegate-dash-v1." + body.encode("ascii"), hashlib.sha256).digest()


# What ties a session to the key it was opened with (the key's digest), by principal id; None when that
# principal has no live admin key now. Looked up afresh for every request that shows a cookie.
Binding = Callable[[str], bytes | None]


def bound_secret(secret: bytes, binding: bytes) -> bytes:
    """The secret a session opened with one particular key is signed with: a token made for a key that has
    since been revoked or replaced (another key under the same id) matches no live key's secret."""
    return hmac.new(secret, b"shapegate-dash-key." + binding, hashlib.sha256).digest()


def check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"session_secret must be at least {MIN_SECRET_BYTES} bytes")


def issue_token(principal: str, secret: bytes, *, now: float, ttl_s: float) -> str:
    """Return `<payload>.<mac>` where payload is base64url JSON {"p": principal, "exp": unix s}."""
    check_secret(secret)
    if not principal:
        raise ValueError("principal must be non-empty")
    body = _b64(orjson.dumps({"p": principal, "exp": math.floor(now + ttl_s)}))
    return f"{body}.{_b64(_mac(secret, body))}"


def verify_token(token: str | None, secret: bytes, *, now: float) -> str | None:
    """Principal of a token signed with `secret` and not expired at `now`; None otherwise."""
    if not token or token.count(".") != 1 or len(token) > 4096:
        return None
    body, sig = token.split(".")
    try:
        expected = _b64(_mac(secret, body)).encode("ascii")
    except UnicodeEncodeError:
        return None
    # Compared as canonical text, so no second spelling of a valid MAC is accepted, and in
    # constant time, so the MAC cannot be recovered byte by byte from response timings.
    if not hmac.compare_digest(sig.encode("utf-8"), expected):
        return None
    try:
        payload = orjson.loads(_unb64(body))
    except (ValueError, orjson.JSONDecodeError):
        return None
    if not isinstance(payload, dict):
        return None
    principal, exp = payload.get("p"), payload.get("exp")
    if not isinstance(principal, str) or not principal or not isinstance(exp, int):
        return None
    if now >= exp:
        return None
    return principal


def claimed_principal(token: str | None) -> str | None:
    """The principal a token says it is for, NOT verified: only to find which key's secret verifies it."""
    if not token or token.count(".") != 1 or len(token) > 4096:
        return None
    try:
        payload = orjson.loads(_unb64(token.split(".")[0]))
    except (ValueError, orjson.JSONDecodeError):
        return None
    principal = payload.get("p") if isinstance(payload, dict) else None
    return principal if isinstance(principal, str) and principal else None


def verify_bound_token(token: str | None, secret: bytes, binding: Binding, *, now: float) -> str | None:
    """Principal of a token signed for a key that is still a live admin key, not expired at `now`; None else."""
    claimed = claimed_principal(token)
    bound = binding(claimed) if claimed is not None else None
    if bound is None:
        return None
    principal = verify_token(token, bound_secret(secret, bound), now=now)
    return principal if principal == claimed else None
