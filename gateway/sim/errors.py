"""The error a simulated engine answers a refused request with (shared by every API module)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the engine refuses: status, message and the engine's error type/param."""

    def __init__(self, status: int, message: str, type_: str | None = None,
                 param: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.param = param
        self.extra = extra
