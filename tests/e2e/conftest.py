"""Session fixtures for real engines (llama-server, vLLM CPU), their build/install step and timing summary."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from tests.e2e import vllm_env
from tests.e2e.build_llama import ensure_llama_server, have_llama_server
from tests.e2e.engines import EngineHandle, start_llama_server, start_vllm_server
from tests.e2e.targets import (
    TARGETS,
    Boot,
    Target,
    engine_of,
    open_target,
    watch_startup,
)
from tests.e2e.tiny_models import ensure_gguf_model, ensure_hf_model
from tests.needs import in_ci

E2E_DIR = Path(__file__).parent
ENGINE_FIXTURES = {"llamacpp": "llama_server", "vllm": "vllm_server"}
# fixtures that start an engine without being named in ENGINE_FIXTURES
NEEDS = {"vllm_boot": "vllm"}

# name -> seconds; lives on the config so nothing is module-level mutable
TIMINGS = pytest.StashKey[dict[str, float]]()
# engine -> error text of a failed build, so each fixture fails fast instead of rebuilding
BUILD_ERRORS = pytest.StashKey[dict[str, str]]()


def e2e_enabled() -> bool:
    return os.environ.get("SHAPEGATE_E2E", "1") != "0"


def vllm_enabled() -> bool:
    return e2e_enabled() and os.environ.get("SHAPEGATE_E2E_VLLM", "1") != "0"


def _in_e2e(item: pytest.Item) -> bool:
    return E2E_DIR in Path(str(item.path)).parents


def _engines_of(item: pytest.Item) -> set[str]:
    """Engines an e2e item needs: by fixture name, or by an `engine` parameter value."""
    if not _in_e2e(item):  # other suites may name a parameter "engine" too
        return set()
    names = getattr(item, "fixturenames", ())
    needed = {engine for engine, fx in ENGINE_FIXTURES.items() if fx in names}
    needed |= {engine for fx, engine in NEEDS.items() if fx in names}
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("engine") in ENGINE_FIXTURES:
        needed.add(callspec.params["engine"])
    if callspec is not None and str(callspec.params.get("target_engine", "")).endswith("-real"):
        needed.add(engine_of(callspec.params["target_engine"]))
    if callspec is not None and callspec.params.get("portfolio") == "real":
        needed |= set(ENGINE_FIXTURES)
    return needed


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if in_ci() and any(_in_e2e(item) for item in items) and not (e2e_enabled() and vllm_enabled()):
        # CI runs every real-engine test: one switched off there would leave it green with half of them gone.
        raise pytest.UsageError("CI is set but the real-engine suites are switched off "
                                "(SHAPEGATE_E2E=0 or SHAPEGATE_E2E_VLLM=0)")
    for item in items:
        if not _in_e2e(item):
            continue
        if not e2e_enabled():
            item.add_marker(pytest.mark.skip(reason="real-engine e2e tests disabled (SHAPEGATE_E2E=0)"))
        elif "vllm" in _engines_of(item) and not vllm_enabled():
            item.add_marker(pytest.mark.skip(reason="vLLM e2e tests disabled (SHAPEGATE_E2E_VLLM=0)"))


def _timed(config: pytest.Config, name: str, fn: Callable[[], object]) -> None:
    started = time.monotonic()
    fn()
    config.stash.setdefault(TIMINGS, {})[name] = time.monotonic() - started


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build/install what the selected tests need before any test runs.

    A cold llama-server build takes minutes and the vLLM venv a few more: done here, the per-test
    timeout covers only start-up and the test itself.
    """
    config = session.config
    if config.option.collectonly:
        return
    needed: set[str] = set()
    for item in session.items:
        if not any(m.name == "skip" for m in item.iter_markers()):
            needed |= _engines_of(item)
    errors = config.stash.setdefault(BUILD_ERRORS, {})
    steps: dict[str, list[tuple[str, Callable[[], object]]]] = {
        "llamacpp": [("build llama-server" if not have_llama_server() else "check llama-server", ensure_llama_server),
                     ("tiny GGUF model", ensure_gguf_model)],
        "vllm": [("install vLLM venv" if not vllm_env.have_vllm_venv() else "check vLLM venv",
                  vllm_env.ensure_vllm_venv),
                 ("tiny HF model", lambda: ensure_hf_model(vllm_env.venv_python()))],
    }
    for engine in sorted(needed):
        for name, fn in steps[engine]:
            try:
                _timed(config, name, fn)
            except (RuntimeError, OSError, ImportError) as exc:  # e.g. no cmake, no `gguf` package
                errors[engine] = f"{name} failed: {exc}"
                break


def _check_built(config: pytest.Config, engine: str) -> None:
    error = config.stash.get(BUILD_ERRORS, {}).get(engine)
    if error:
        pytest.fail(error, pytrace=False)


async def _stop(handle: EngineHandle, timings: dict[str, float], name: str) -> None:
    started = time.monotonic()
    await handle.close()
    timings[name] = time.monotonic() - started


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def llama_server(request: pytest.FixtureRequest) -> AsyncIterator[EngineHandle]:
    """llama-server b11434 on the tiny GGUF: --parallel 2, -c 4096 (2,048 per slot), --metrics."""
    if not e2e_enabled():
        pytest.skip("real-engine e2e tests disabled (SHAPEGATE_E2E=0)")
    _check_built(request.config, "llamacpp")
    handle = await start_llama_server()
    timings = request.config.stash.setdefault(TIMINGS, {})
    timings["llama-server start-up"] = handle.startup_s
    yield handle
    await _stop(handle, timings, "llama-server stop")


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_boot(request: pytest.FixtureRequest) -> AsyncIterator[Boot]:
    """vLLM 0.32 CPU on the tiny HF model (--enforce-eager, --max-num-seqs 2, max_model_len 4096),
    started behind a gateway that records its /readyz answers over the start-up.

    One start serves both the readiness test and every other vLLM test: a second start would
    cost another 30-50 s on two cores.
    """
    if not vllm_enabled():
        pytest.skip("vLLM e2e tests disabled (SHAPEGATE_E2E_VLLM=0 or SHAPEGATE_E2E=0)")
    _check_built(request.config, "vllm")
    boot = await watch_startup("vllm", lambda port: start_vllm_server(max_num_seqs=2, port=port))
    timings = request.config.stash.setdefault(TIMINGS, {})
    timings["vLLM start-up"] = boot.handle.startup_s
    yield boot
    await _stop(boot.handle, timings, "vLLM stop")


@pytest.fixture(scope="session")
def vllm_server(vllm_boot: Boot) -> EngineHandle:
    return vllm_boot.handle


@pytest.fixture(params=["real", "sim"])
def portfolio(request: pytest.FixtureRequest) -> dict[str, str] | None:
    """Engine URLs of the real llama.cpp and vLLM pair, or None for a pair of simulators started by the test."""
    if request.param == "sim":
        return None
    return {"llamacpp": request.getfixturevalue("llama_server").url,
            "vllm": request.getfixturevalue("vllm_server").url}


@pytest.fixture(params=sorted(ENGINE_FIXTURES))
def engine(request: pytest.FixtureRequest) -> EngineHandle:
    """Either real engine; tests using it run once per engine."""
    return request.getfixturevalue(ENGINE_FIXTURES[request.param])


@pytest.fixture(params=TARGETS)
def target_engine(request: pytest.FixtureRequest) -> tuple[str, EngineHandle | None]:
    """A target's name, and its real engine (None for a simulator)."""
    name = request.param
    if name.endswith("-real"):
        return name, request.getfixturevalue(ENGINE_FIXTURES[engine_of(name)])
    return name, None


@pytest_asyncio.fixture
async def target(target_engine: tuple[str, EngineHandle | None]) -> AsyncIterator[Target]:
    """A gateway (public model name `shapegate-tiny`) in front of one real engine or one fresh simulator."""
    async with open_target(*target_engine) as t:
        yield t


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    timings = config.stash.get(TIMINGS, {})
    if not timings:
        return
    terminalreporter.section("shapegate e2e timings")
    for name, seconds in timings.items():
        terminalreporter.write_line(f"{name:<28} {seconds:8.2f} s")
