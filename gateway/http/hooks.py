"""What the HTTP server needs of the application it serves: its settings, request ids and refusal count."""

from __future__ import annotations

from typing import Protocol


class ServerSettings(Protocol):
    """The [server] settings the front reads per request and per wait (the runtime's HotSettings has them)."""

    @property
    def head_timeout_s(self) -> float: ...

    @property
    def body_timeout_s(self) -> float: ...

    @property
    def write_timeout_s(self) -> float: ...

    @property
    def keepalive_s(self) -> float: ...

    @property
    def max_head_bytes(self) -> int: ...

    @property
    def max_headers(self) -> int: ...

    @property
    def max_body_bytes(self) -> int: ...

    @property
    def max_connections(self) -> int: ...

    @property
    def max_reading_connections(self) -> int: ...


class RequestIdSource(Protocol):
    def next(self) -> str:
        """A new request id, for a request that brings none the server accepts."""


class RejectCounter(Protocol):
    def reject(self, status: int) -> None:
        """A request the server refused itself (malformed, too large, too slow), counted by its status."""


class Owner(Protocol):
    """The application behind the server (the runtime's Gateway is one)."""

    @property
    def hot(self) -> ServerSettings:
        """The settings now: read on use, since a reload replaces them."""

    @property
    def request_ids(self) -> RequestIdSource: ...

    @property
    def metrics(self) -> RejectCounter: ...


class Limits:
    """The server's limits and timeouts, copied out of the owner's settings each time those are replaced.

    Why a copy: read through a Protocol, each attribute is a lookup by name in the compiled build; copied into
    this class, each is a field of a C struct, and a request reads half a dozen of them.
    """

    def __init__(self, source: ServerSettings) -> None:
        self.source = source  # what these were copied from: the owner's settings object, compared by identity
        self.head_timeout_s = source.head_timeout_s
        self.body_timeout_s = source.body_timeout_s
        self.write_timeout_s = source.write_timeout_s
        self.keepalive_s = source.keepalive_s
        self.max_head_bytes = source.max_head_bytes
        self.max_headers = source.max_headers
        self.max_body_bytes = source.max_body_bytes
        self.max_connections = source.max_connections
        self.max_reading_connections = source.max_reading_connections
