"""Fixtures of the integration tests that several files share."""

from __future__ import annotations

import pytest

from tests.api_engine import ApiEngine, ApiKnobs
from tests.integration.browser import chromium_available
from tests.needs import skip_or_fail


@pytest.fixture
def chromium() -> None:
    """Skip on a workstation without Chromium; in CI its absence is a broken setup, so fail."""
    if not chromium_available():
        skip_or_fail("/usr/bin/chromium is not installed (apt-get install -y chromium)")



@pytest.fixture
async def api_engines():
    """Two fake engines of the APIs beyond chat, named a and b (their texts say which answered)."""
    started = [await ApiEngine(ApiKnobs(name=n)).start() for n in ("a", "b")]
    yield started
    for e in started:
        await e.stop()
