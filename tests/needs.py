"""Skips CI never takes: a test that cannot run says why, and under CI=true a missing dependency fails it."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_or_fail(reason: str) -> NoReturn:
    """Skip with the reason on a workstation; fail under CI, where everything the tests need is installed."""
    if in_ci():
        pytest.fail(f"CI is set but {reason}")
    pytest.skip(reason)
