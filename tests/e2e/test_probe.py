"""The support probe against the real llama-server and vLLM: every API and feature, the APIs as docs/apis.md's
matrix says, and the tables it prints."""

from __future__ import annotations

import pytest

from gateway.cli.probe import probe_all, render
from gateway.config import parse_config
from gateway.config_experiments import PROBE_APIS, PROBE_FEATURES
from gateway.config_experiments import PROBE_CHECKS as CHECKS
from gateway.fleet.probe_target import GATEWAY, NO, PARTIAL, YES
from gateway.runtime import build_policy
from tests.e2e.engines import EngineHandle
from tests.e2e.targets import PUBLIC_MODEL, backend
from tests.gateway_harness import gateway_config
from tests.support_matrix import documented, found

pytestmark = pytest.mark.e2e

# Seen on both engines (tests/e2e/OBSERVED.md, and this probe's runs): plain and streamed chat, legacy
# completions, the usage chunk on request, two sampled choices, logprobs, and a context error past the window
# (llama.cpp: 2,048 tokens a slot; vLLM: max_model_len 4,096).
CERTAIN = ("answers", "chat", "completions", "stream", "stream_usage", "n", "logprobs", "context")
WINDOWS = {"llamacpp": 2048, "vllm": 4096}
# Generous: on two cores a busy vLLM can leave a request unanswered for seconds.
TIMEOUT_S = 60.0
# docs/apis.md's rows of these engines, as tests/e2e starts them.
DOC_ROWS = {"llamacpp": "llamacpp-real", "vllm": "vllm-real"}


async def test_both_engines_serve_the_documented_apis_and_the_basics(llama_server: EngineHandle,
                                                                     vllm_server: EngineHandle) -> None:
    cfg = parse_config(gateway_config([backend("llama", "llamacpp", llama_server.url),
                                       backend("vllm", "vllm", vllm_server.url)],
                                      probe={"require": list(CERTAIN)}), build_policy)
    rows = await probe_all(cfg, TIMEOUT_S)
    assert [(r.model, r.backend, r.engine) for r in rows] == [(PUBLIC_MODEL, "llama", "llamacpp"),
                                                             (PUBLIC_MODEL, "vllm", "vllm")]
    matrix = documented()
    for r in rows:
        assert list(r.cells) == list(CHECKS)
        assert {name: r.cells[name].verdict for name in CERTAIN} == dict.fromkeys(CERTAIN, YES), r.cells
        assert r.cells["context"].window == WINDOWS[r.engine]
        # Every API as docs/apis.md says for this engine, each refusal with its status.
        assert found(r) == matrix[DOC_ROWS[r.engine]].cells, {a: r.cells[a].describe() for a in PROBE_APIS}
        # What the tiny random-weight model makes of a forced tool or a schema is its own: answered, not failed.
        assert all(c.verdict in (YES, NO, PARTIAL, GATEWAY) for c in r.cells.values()), r.cells
    llama, vllm = (r.cells for r in rows)
    # The reasons name what the engine said.
    assert llama["rerank"].reason == ("HTTP 501: This server does not support reranking. "
                                      "Start it with `--reranking`")
    assert llama["response_store"].reason == "GET: HTTP 404: File Not Found"
    assert vllm["embeddings"].reason == "HTTP 404: Not Found"
    assert vllm["response_store"].reason == "GET served; DELETE: HTTP 405: Method Not Allowed"
    # Whether an engine calls tools depends on how it was started: this vLLM has no --tool-call-parser.
    assert vllm["tools"].verdict == NO and "--tool-call-parser" in vllm["tools"].reason, vllm["tools"]
    lines = render(rows, cfg.probe.require)
    apis, features = lines.index("APIs:"), lines.index("chat features:")
    assert lines[apis + 1].split() == ["model", "backend", "engine", "answers", *PROBE_APIS]
    assert lines[apis + 2].split()[:7] == [PUBLIC_MODEL, "(tiny-llama)", "llama", "llamacpp", "yes", "yes", "yes"]
    assert lines[features + 1].split() == ["model", "backend", "engine", *PROBE_FEATURES]
    assert lines[features + 2].split()[-1] == "2048" and lines[features + 3].split()[-1] == "4096"
    assert lines[-1] == f"required ({', '.join(CERTAIN)}): passed on all 2 model-backend pairs"
