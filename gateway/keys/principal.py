"""Who an API key speaks for (Principal), and how keys are made and digested: what auth and the key store share."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from gateway.config import KeyLimits


@dataclass(frozen=True, slots=True)
class Principal:
    id: str
    admin: bool
    limits: KeyLimits | None = None  # the key's own limits; None: the [limits] defaults
    # Whose state (stored responses, conversations) the key's requests reach: the key itself, not only its id, so
    # that a key made again under a revoked key's id reaches nothing of the revoked key's (see owner_of).
    owner: str = "-"
    priority: str | None = None  # where its requests wait in [queue]; None: each request's class decides
    priority_header: bool = False  # its requests may set their own priority (x-shapegate-priority)


def owner_of(key_id: str, digest: str) -> str:
    """A key's identity as the owner of state: a hash of its id and its digest (never the digest itself, which
    Redis would then hold beside the data), so another key, or the same id with another secret, is another owner."""
    return hashlib.sha256(f"shapegate-owner\0{key_id}\0{digest}".encode("utf-8", "surrogatepass")).hexdigest()[:32]


def principal(key_id: str, admin: bool, limits: KeyLimits | None, digest: str, priority: str | None = None,
              priority_header: bool = False) -> Principal:
    """The principal of a key known by its digest."""
    return Principal(key_id, admin, limits, owner_of(key_id, digest), priority, priority_header)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return "sg-" + secrets.token_urlsafe(32)
