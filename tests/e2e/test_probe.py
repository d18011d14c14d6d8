"""The support probe against the real llama-server and vLLM: what both certainly serve, and the matrix it prints."""

from __future__ import annotations

import pytest

from gateway.cli.probe import probe_all, render
from gateway.config import parse_config
from gateway.config_experiments import PROBE_CHECKS as CHECKS
from gateway.fleet.probe_checks import NO, YES
from gateway.runtime import build_policy
from tests.e2e.engines import EngineHandle
from tests.e2e.targets import PUBLIC_MODEL, backend
from tests.gateway_harness import gateway_config

pytestmark = pytest.mark.e2e

# Seen on both engines (tests/e2e/OBSERVED.md, and this probe's runs): plain and streamed chat, legacy
# completions, the usage chunk on request, two sampled choices, logprobs, and a context error past the window
# (llama.cpp: 2,048 tokens a slot; vLLM: max_model_len 4,096).
CERTAIN = ("answers", "chat", "completions", "stream", "stream_usage", "n", "logprobs", "context")
WINDOWS = {"llamacpp": 2048, "vllm": 4096}
# Generous: on two cores a busy vLLM can leave a request unanswered for seconds.
TIMEOUT_S = 60.0


async def test_both_engines_support_the_basics_and_the_matrix_renders(llama_server: EngineHandle,
                                                                       vllm_server: EngineHandle) -> None:
    cfg = parse_config(gateway_config([backend("llama", "llamacpp", llama_server.url),
                                       backend("vllm", "vllm", vllm_server.url)],
                                      probe={"require": list(CERTAIN)}), build_policy)
    rows = await probe_all(cfg, TIMEOUT_S)
    assert [(r.model, r.backend, r.engine) for r in rows] == [(PUBLIC_MODEL, "llama", "llamacpp"),
                                                             (PUBLIC_MODEL, "vllm", "vllm")]
    for r in rows:
        assert list(r.cells) == list(CHECKS)
        assert {name: r.cells[name].verdict for name in CERTAIN} == dict.fromkeys(CERTAIN, YES), r.cells
        assert r.cells["context"].window == WINDOWS[r.engine]
        # What the tiny random-weight model makes of a forced tool or a schema is its own: answered, not failed.
        assert all(c.verdict in (YES, NO) for c in r.cells.values()), r.cells
    # Whether an engine calls tools depends on how it was started: this vLLM has no --tool-call-parser.
    tools = rows[1].cells["tools"]
    assert tools.verdict == NO and "--tool-call-parser" in tools.reason, tools
    lines = render(rows, cfg.probe.require)
    assert lines[0].split() == ["model", "backend", "engine", *CHECKS]
    assert lines[1].split()[:7] == [PUBLIC_MODEL, "(tiny-llama)", "llama", "llamacpp", "yes", "yes", "yes"]
    assert lines[1].split()[-1] == "2048" and lines[2].split()[-1] == "4096"
    assert lines[-1] == f"required ({', '.join(CERTAIN)}): passed on all 2 model-backend pairs"
