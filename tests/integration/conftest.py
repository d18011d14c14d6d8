"""Fixtures of the integration tests that several files share."""

from __future__ import annotations

import pytest

from tests.integration.browser import chromium_available
from tests.needs import skip_or_fail


@pytest.fixture
def chromium() -> None:
    """Skip on a workstation without Chromium; in CI its absence is a broken setup, so fail."""
    if not chromium_available():
        skip_or_fail("/usr/bin/chromium is not installed (apt-get install -y chromium)")

