"""Shared fixtures: fake engines and a gateway in front of them, all on loopback."""

from __future__ import annotations

import pytest

from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import ADMIN_KEY, USER_KEY, gateway_config, start_gateway


@pytest.fixture
async def engines():
    """Three fake engines; the `gateway` fixture puts the first two behind it (experiments use all three)."""
    started = [await FakeEngine(Knobs()).start() for _ in range(3)]
    yield started
    for e in started:
        await e.stop()


@pytest.fixture
async def gateway(engines):
    cfg = gateway_config([
        {"id": "vllm-a", "engine": "vllm", "url": engines[0].url, "models": {"m1": "native-m1", "m2": "m2"}},
        {"id": "llama-b", "engine": "llamacpp", "url": engines[1].url, "models": {"m1": "m1.gguf"}},
    ], routing={"policy": "round_robin"})
    gw = await start_gateway(cfg)
    yield gw
    await gw.stop()


@pytest.fixture
def user_key():
    return USER_KEY


@pytest.fixture
def admin_key():
    return ADMIN_KEY


# Every rerun is printed at the end with why the attempt failed (the rerun plugin's own summary names only the
# test): a rerun is a defect to look into, so its reason must outlive the run that hid it.
_RERUN_REASONS: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome == "rerun":
        text = report.longreprtext.strip().splitlines()
        errors = [line[1:].strip() for line in text if line.startswith("E ")]
        reason = " / ".join(errors[:3]) if errors else (text[-1] if text else "")
        _RERUN_REASONS.append((f"{report.nodeid} ({report.when})", reason[:400]))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    if _RERUN_REASONS:
        terminalreporter.section("why each rerun was needed")
        for nodeid, reason in _RERUN_REASONS:
            terminalreporter.line(f"{nodeid}: {reason}")
