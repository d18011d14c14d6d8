"""Fixtures of the integration tests that several files share."""

from __future__ import annotations

import os

import pytest

from tests.integration.browser import chromium_available


@pytest.fixture
def chromium() -> None:
    """Skip on a workstation without Chromium; in CI its absence is a broken setup, so fail."""
    if chromium_available():
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI is set but /usr/bin/chromium is missing: apt-get install -y chromium")
    pytest.skip("/usr/bin/chromium is not installed (apt-get install -y chromium)")

