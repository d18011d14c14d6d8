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


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return "sg-" + secrets.token_urlsafe(32)
