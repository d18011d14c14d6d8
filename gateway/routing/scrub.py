"""The gateway's own engine key, kept out of everything of an engine's that reaches a client (an engine may echo it)."""

from __future__ import annotations

from typing import Final

from gateway.routing.relay import ModelRewrite

REDACTED: Final[bytes] = b"[redacted]"


def scrub(data: bytes, secret: bytes | None) -> bytes:
    """data with every copy of the key replaced (one search when it holds none)."""
    if secret is None or data.find(secret) < 0:
        return data
    return data.replace(secret, REDACTED)


class Scrubbing(ModelRewrite):
    """A reply's rewrite (the model's public name back, private fields out) that also scrubs the key: every block of
    a stream and every whole reply of a backend with a key goes through it."""

    __slots__ = ("inner", "secret")

    def __init__(self, inner: ModelRewrite, secret: bytes) -> None:
        super().__init__("")
        self.inner = inner
        self.secret = secret

    def __call__(self, data: bytes) -> bytes:
        return scrub(self.inner(data), self.secret)
