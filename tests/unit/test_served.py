"""A configured model an engine does not serve by name: the engines' refusals told apart, what the backend keeps,
what a client and `shapegate check` are told; and why a backend still not ready is logged."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from gateway.cli.check import BackendReport, ModelReport, describe, failed, summary
from gateway.config import BackendConfig, GatewayConfig, HealthConfig
from gateway.contracts import DEFAULT, READY, STARTING, ProbeResult
from gateway.errors import normalize_engine_error
from gateway.fleet.health import not_ready_reason, report_not_ready
from gateway.fleet.pool import BackendState, Pool
from gateway.fleet.served import fix, not_listed, refuses_model
from gateway.routing.failover import Retryable, charge_engine_error, model_refused

CFG = GatewayConfig(auth={"enabled": False}, backends=[
    BackendConfig(id="bad", engine="sglang", url="http://127.0.0.1:1", models={"qwen3-30b": "qwen3-30b"}),
    BackendConfig(id="good", engine="vllm", url="http://127.0.0.1:2", models={"qwen3-30b": "Qwen/Qwen3-30B"}),
    BackendConfig(id="short", engine="vllm", url="http://127.0.0.1:3", models={"m": "m"})])
HEALTH = HealthConfig()


def pool() -> Pool:
    return Pool([BackendState(bc, None, CFG) for bc in CFG.backends])


VLLM_404 = orjson.dumps({"error": {"message": "The model `qwen3-30b` does not exist.", "type": "NotFoundError",
                                   "param": "model", "code": 404}})
SGLANG_400 = orjson.dumps({"object": "error", "message": "The model `qwen3-30b` does not exist. The served model "
                           "name is `sim-model`.", "type": "BadRequestError", "param": None, "code": 400})
OPENAI_404 = orjson.dumps({"error": {"message": "The model `qwen3-30b` does not exist or you do not have access to "
                                     "it.", "type": "invalid_request_error", "param": None, "code": "model_not_found"}})


@pytest.mark.parametrize("status, body, refused", [
    (404, VLLM_404, True),
    (400, SGLANG_400, True),
    (404, OPENAI_404, True),
    (404, b"Not Found", False),  # a route the engine lacks, not the model
    (404, orjson.dumps({"error": {"message": "The model `other` does not exist.", "code": 404}}), False),
    (400, orjson.dumps({"error": {"message": "qwen3-30b: 'messages' must not be empty", "code": 400}}), False),
    (422, VLLM_404, False),
])
def test_an_engines_refusal_of_the_configured_name_in_its_own_words(status, body, refused):
    err = normalize_engine_error(status, body)
    assert refuses_model(err.status, err.code, err.message, "qwen3-30b") is refused


def test_a_short_name_counts_only_as_a_whole_name():
    assert refuses_model(404, "model_not_found", "The model `m` does not exist.", "m")
    assert not refuses_model(404, "model_not_found", "The model `mistral` does not exist.", "m")
    assert not refuses_model(404, "model_not_found", "model not found: lm-m2", "m")


def test_a_refusal_fails_over_and_keeps_the_model_away_from_that_backend_until_its_list_changes(caplog):
    p = pool()
    bad = p.get("bad")
    bad.take_model_list(("sim-model",))  # logged, and still routed there: only a refusal takes it out
    for b in p.all():
        b.health.state = READY
    assert [b.id for b in p.candidates("qwen3-30b", DEFAULT)] == ["bad", "good"]
    retry = charge_engine_error(bad, normalize_engine_error(400, SGLANG_400), {}, HEALTH, "qwen3-30b")
    assert isinstance(retry, Retryable) and not retry.suspect
    assert (retry.error.status, retry.error.code, retry.error.param) == (404, "model_not_found", "model")
    assert "backend bad" in retry.error.message and "--served-model-name qwen3-30b" in retry.error.message
    assert bad.breaker.failures == 0, "no breaker verdict: the engine answered soundly"
    assert "does not serve 'qwen3-30b'" in bad.unsupported["qwen3-30b"]
    assert "it lists: sim-model" in bad.unsupported["qwen3-30b"]
    assert [b.id for b in p.candidates("qwen3-30b", DEFAULT)] == ["good"]
    # Said once, however many requests meet the same refusal.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shapegate"):
        model_refused(bad, normalize_engine_error(404, VLLM_404), "qwen3-30b")
    assert not caplog.records
    bad.take_model_list(("sim-model",))  # the same list again: still out
    assert "qwen3-30b" in bad.lacks
    bad.take_model_list(("sim-model", "other"))  # the list changed: routed there again
    assert bad.lacks == {} and bad.unsupported == {}
    assert [b.id for b in p.candidates("qwen3-30b", DEFAULT)] == ["bad", "good"]


def test_a_list_read_after_the_refusal_is_kept_and_one_naming_the_model_lifts_it():
    bad = pool().get("bad")
    model_refused(bad, normalize_engine_error(404, VLLM_404), "qwen3-30b")  # no list read yet
    bad.take_model_list(("sim-model",))  # known now, still without it: stays out
    assert "qwen3-30b" in bad.lacks
    bad.take_model_list(("sim-model", "qwen3-30b"))
    assert bad.lacks == {}


def test_other_client_errors_stay_the_clients():
    b = pool().get("bad")
    err = normalize_engine_error(400, orjson.dumps({"message": "'messages' must not be empty", "code": 400}))
    assert charge_engine_error(b, err, {}, HEALTH, "qwen3-30b") is None
    assert b.lacks == {}


def test_the_client_gets_a_404_naming_the_misconfiguration_only_when_every_backend_lacks_the_model():
    p = pool()
    model_refused(p.get("bad"), normalize_engine_error(404, VLLM_404), "qwen3-30b")
    assert p.unavailable("qwen3-30b", 0.0).code == "no_backend_available"  # "good" may come back
    err = normalize_engine_error(404, orjson.dumps({"error": {"message": "The model `Qwen/Qwen3-30B` does not "
                                                              "exist.", "code": 404}}))
    assert model_refused(p.get("good"), err, "qwen3-30b") is not None
    refusal = p.unavailable("qwen3-30b", 0.0)
    assert (refusal.status, refusal.code) == (404, "model_not_found")
    assert "gateway misconfiguration" in refusal.message


def test_a_reload_that_renames_the_model_judges_it_afresh():
    bad = pool().get("bad")
    model_refused(bad, normalize_engine_error(404, VLLM_404), "qwen3-30b")
    bad.reconfigure(BackendConfig(id="bad", engine="sglang", url="http://127.0.0.1:1",
                                  models={"qwen3-30b": "sim-model"}))
    assert bad.lacks == {} and bad.unsupported == {} and bad.list_due


def test_each_missing_model_is_logged_once_per_list_with_the_engines_flag(caplog):
    b = pool().get("good")
    with caplog.at_level(logging.WARNING, logger="shapegate"):
        b.take_model_list(("a", "b"))
        b.take_model_list(("a", "b"))
        b.take_model_list(("a", "b", "c"))  # another list: said again
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == ("backend good (vllm at http://127.0.0.1:2) does not list model 'Qwen/Qwen3-30B' (configured "
                        "as qwen3-30b) (it lists: a, b): start the engine with --served-model-name Qwen/Qwen3-30B, or "
                        "map qwen3-30b to a name the engine lists in [[backends]] models")


def test_the_fix_names_each_engines_flag():
    assert fix("vllm", "x", "x") == "start the engine with --served-model-name x, or map it in [[backends]] models"
    assert fix("sglang", "x", "x").startswith("start the engine with --served-model-name x")
    assert fix("llamacpp", "x", "x").startswith("start the engine with --alias x")
    assert fix("openai", "x", "x").startswith("serve it under the name x")
    assert "whatever they name" in not_listed("l", "llamacpp", "http://h", "x", "x", ("y",))
    many = not_listed("v", "vllm", "http://h", "x", "x", tuple(f"n{i}" for i in range(12)))
    assert "n9, ... (12 in all)" in many and "\x1b" not in not_listed("v", "vllm", "u", "x", "x", ("a\x1b[2J",))


@pytest.mark.parametrize("probe, kind, words", [
    (ProbeResult(False, 0, "connect failed: [Errno 111] Connect call failed ('127.0.0.1', 9)", refused=True),
     "connect", "connection refused (connect failed: [Errno 111]"),
    (ProbeResult(False, 0, "connect failed: [Errno -2] Name or service not known", refused=True),
     "connect", "cannot connect (connect failed"),
    (ProbeResult(False, 0, "TimeoutError"), "timeout", "no answer within 2 s (timeout)"),
    (ProbeResult(False, 503, "Loading model"), "HTTP 503", "HTTP 503: Loading model"),
    (ProbeResult(False, 503, "HTTP 503"), "HTTP 503", "HTTP 503"),
])
def test_why_a_backend_is_not_ready(probe, kind, words):
    got_kind, got_words = not_ready_reason(probe, 2.0)
    assert got_kind == kind and got_words.startswith(words)


class Adapter:
    health_path = "/health"

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        return 502, self.body


def test_a_start_that_overruns_its_grace_is_logged_once_per_cause_with_the_body(caplog):
    b = BackendState(CFG.backends[1], Adapter(b"<html> Bad\n gateway </html>" + b"x" * 4000), CFG)
    assert b.health.state == STARTING
    refused = ProbeResult(False, 0, "connect failed: [Errno 111] Connect call failed", refused=True)
    proxy = ProbeResult(False, 502, "HTTP 502")

    async def run() -> None:
        for r in (refused, refused, proxy, proxy, refused):
            await report_not_ready(b, r, HEALTH, b.health.changed_at + 31)

    with caplog.at_level(logging.WARNING, logger="shapegate.health"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "not ready 31.0 s after it was added: connection refused" in lines[0]
    assert lines[1].endswith("HTTP 502: <html> Bad gateway </html>" + "x" * 134)  # 160 characters
    assert "connection refused" in lines[2]


def report(listed: tuple[str, ...] | None, *models: ModelReport, reachable: bool = True) -> BackendReport:
    r = BackendReport(CFG.backends[0], reachable, "ok" if reachable else "connect failed", 200 if reachable else 0,
                      listed=listed)
    r.models = list(models)
    return r


def test_check_never_says_all_healthy_while_a_model_is_missing():
    ok = report(("qwen3-30b",), ModelReport("qwen3-30b", "qwen3-30b", True, None, ""))
    lacking = report(("sim-model",), ModelReport("qwen3-30b", "qwen3-30b", False, None, ""))
    assert summary([ok]) == "1 backend answered, all healthy" and not failed([ok])
    assert failed([ok, lacking])
    assert summary([ok, lacking]) == ("2 backends answered, 2 healthy; not listed by their engine: bad/qwen3-30b "
                                      "(exit status 1; --allow-missing accepts this)")
    assert summary([ok, lacking], allow_missing=True).endswith("not listed by their engine: bad/qwen3-30b")
    assert describe(lacking)[-1] == ("    fix: start the engine with --served-model-name qwen3-30b, or map it in "
                                     "[[backends]] models")
    assert failed([ok, report(None, reachable=False)])
