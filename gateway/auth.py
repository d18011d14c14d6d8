"""API keys: SHA-256 digests in config, constant-time comparison, the key's id as the request's principal."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Mapping

from gateway.config import AuthConfig
from gateway.errors import forbidden, unauthorized


@dataclass(frozen=True, slots=True)
class Principal:
    id: str
    admin: bool


ANONYMOUS = Principal("anonymous", admin=True)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return "sg-" + secrets.token_urlsafe(32)


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")  # lower case: both servers look names up that way
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    return headers.get("x-api-key") or None


class Authenticator:
    """Maps a presented key to its principal; the key itself is never stored, logged or echoed."""

    def __init__(self, cfg: AuthConfig) -> None:
        self.enabled = cfg.enabled
        # Looked up by digest: the lookup's timing depends on the digest, not on the key's prefix.
        self._by_digest = {k.sha256: (k.sha256, Principal(k.id, k.admin)) for k in cfg.keys}
        # Keys that already proved valid, so that a client's every request does not pay for SHA-256. Only
        # valid keys enter (one entry per configured key at most); a reload builds a new Authenticator, so a
        # removed key stops working at once. The lookup compares salted string hashes before any bytes, so
        # its timing reveals nothing about a valid key.
        self._proven: dict[str, Principal] = {}

    def principal_for_key(self, key: str | None) -> Principal | None:
        if not self.enabled:
            return ANONYMOUS
        if not key:
            return None
        principal = self._proven.get(key)
        if principal is not None:
            return principal
        digest = hash_key(key)
        entry = self._by_digest.get(digest)
        if entry is None or not hmac.compare_digest(entry[0], digest):
            return None
        self._proven[key] = entry[1]
        return entry[1]

    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        principal = self.principal_for_key(presented_key(headers))
        if principal is None:
            raise unauthorized()
        return principal

    def require_admin(self, headers: Mapping[str, str]) -> Principal:
        principal = self.authenticate(headers)
        if not principal.admin:
            raise forbidden()
        return principal

    def admin_for_key(self, key: str) -> str | None:
        principal = self.principal_for_key(key)
        return principal.id if principal is not None and principal.admin else None
