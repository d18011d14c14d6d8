"""API keys: SHA-256 digests (config and run time), constant-time comparison, the key's id as the principal."""

from __future__ import annotations

import hmac
import time
from collections.abc import Mapping
from typing import Final

from gateway.config import AuthConfig
from gateway.errors import forbidden, unauthorized
from gateway.keys.keystore import KeyStore
from gateway.keys.principal import Principal, hash_key, principal

ANONYMOUS: Final = principal("anonymous", True, None, "")  # with [auth] off: every request


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")  # lower case: both servers look names up that way
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    return headers.get("x-api-key") or None


class Authenticator:
    """Maps a presented key to its principal; the key itself is never stored, logged or echoed.

    Keys come from the configuration and, when given, from the gateway's run-time key store (which outlives
    this object: a reload builds a new Authenticator on the same store).
    """

    def __init__(self, cfg: AuthConfig, runtime: KeyStore | None = None) -> None:
        self.enabled = cfg.enabled
        # Looked up by digest: the lookup's timing depends on the digest, not on the key's prefix.
        self._by_digest = {k.sha256: (k.sha256, principal(k.id, k.admin, k.limits, k.sha256, k.priority,
                                                          k.priority_header)) for k in cfg.keys}
        self._runtime = runtime
        self._generation = runtime.generation if runtime is not None else 0
        # Keys that already proved valid, so that a client's every request does not pay for SHA-256. Only
        # valid keys enter (one entry per valid key at most); a reload builds a new Authenticator and a change
        # of the run-time keys a new generation of them, so a removed or revoked key stops working at once.
        # The lookup compares salted string hashes before any bytes, so its timing reveals nothing about a
        # valid key.
        self._proven: dict[str, Principal] = {}

    def principal_for_key(self, key: str | None) -> Principal | None:
        if not self.enabled:
            return ANONYMOUS
        if not key:
            return None
        runtime = self._runtime
        if runtime is not None and runtime.generation != self._generation:
            self._proven.clear()  # the run-time keys changed: one of them may be revoked
            self._generation = runtime.generation
        principal = self._proven.get(key)
        if principal is None:
            digest = hash_key(key)
            entry = self._by_digest.get(digest)
            if entry is None and runtime is not None:
                entry = runtime.by_digest.get(digest)
            if entry is None or not hmac.compare_digest(entry[0], digest):
                return None
            principal = self._proven[key] = entry[1]
        if runtime is not None:
            runtime.used[principal.id] = time.time()  # published in batches, off the request path
        return principal

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
