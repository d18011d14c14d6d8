"""Engine load signals mapped to common fields, staleness, admission control and the reload plan."""

from __future__ import annotations

import pytest

from backends.llamacpp import LlamaCppBackend
from backends.openai_http import parse_gauges
from backends.sglang import SGLangBackend, legacy_load_sample, loads_sample
from backends.vllm import VLLMBackend
from gateway.config import AdmissionConfig, parse_config
from gateway.contracts import LoadSample
from gateway.errors import GatewayError
from gateway.ops.reload import plan
from gateway.routing.admission import admit, saturated
from gateway.runtime import build_policy

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0 1712345678000
vllm:num_requests_waiting_by_reason{engine="0",reason="x"} 99.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
"""
OLD_VLLM_TEXT = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\nvllm:num_requests_running{model_name="m"} 1\n'
SGLANG_TEXT = 'sglang:num_running_reqs{model_name="m"} 4\nsglang:num_queue_reqs{model_name="m"} 1\n' \
              'sglang:token_usage{model_name="m"} 0.8\n'
LLAMA_TEXT = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 5\n"


@pytest.mark.parametrize("text,names,expected", [
    (VLLM_TEXT, VLLMBackend.metric_names, {"running": 5.0, "waiting": 7.0, "kv_usage": 0.25}),
    (OLD_VLLM_TEXT, VLLMBackend.metric_names, {"running": 1.0, "kv_usage": 0.5}),
    (SGLANG_TEXT, SGLangBackend.metric_names, {"running": 4.0, "waiting": 1.0, "kv_usage": 0.8}),
    (LLAMA_TEXT, LlamaCppBackend.metric_names, {"running": 2.0, "waiting": 5.0}),
    ("", VLLMBackend.metric_names, {}),
])
def test_engine_metrics_map_to_common_fields(text, names, expected):
    assert parse_gauges(text, names) == expected


def test_sglang_loads_route_and_its_older_form():
    two_ranks = {"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "token_usage": 0.2},
                           {"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 4, "token_usage": 0.7}]}
    s = loads_sample(two_ranks, now=5.0)
    assert (s.running, s.waiting, s.kv_usage, s.at) == (5.0, 5.0, 0.7, 5.0)
    assert loads_sample([{"num_running_reqs": 1}], now=0).running == 1.0
    assert loads_sample({"loads": []}, now=0) is None
    old = legacy_load_sample([{"num_reqs": 6, "num_waiting_reqs": 2}], now=1.0)
    assert (old.running, old.waiting) == (4.0, 2.0)


class B:
    """The parts of a BackendState that admission reads."""

    def __init__(self, in_flight=0, load=None, stale_after=3.0, load_in_flight=0):
        self.in_flight = in_flight
        self.load = load
        self.load_in_flight = load_in_flight
        self._stale = stale_after

    def fresh_load(self, now):
        return self.load if self.load is not None and now - self.load.at <= self._stale else None


FRESH = 10.0
SLOTS_FULL = LoadSample(running=4, idle_slots=0, total_slots=4, at=FRESH)
SLOTS_FREE = LoadSample(running=2, idle_slots=2, total_slots=4, at=FRESH)
QUEUED = LoadSample(running=8, waiting=20, at=FRESH)
STALE_QUEUED = LoadSample(running=8, waiting=20, at=1.0)


@pytest.mark.parametrize("name,b,klass,cfg,expected", [
    ("no bounds configured", B(load=QUEUED), "default", AdmissionConfig(), False),
    ("engine queue over the bound", B(load=QUEUED), "default", AdmissionConfig(max_waiting=16), True),
    ("engine queue at the bound", B(load=QUEUED), "default", AdmissionConfig(max_waiting=20), False),
    ("stale sample says nothing", B(load=STALE_QUEUED), "default", AdmissionConfig(max_waiting=0), False),
    ("gateway in-flight bound", B(in_flight=4), "default", AdmissionConfig(max_in_flight=4), True),
    ("no idle slot for a slot class", B(load=SLOTS_FULL), "interactive",
     AdmissionConfig(slot_classes=("interactive",)), True),
    ("no idle slot, class does not need one", B(load=SLOTS_FULL), "default",
     AdmissionConfig(slot_classes=("interactive",)), False),
    ("idle slots in the sample, taken since by the gateway", B(in_flight=4, load=SLOTS_FREE), "interactive",
     AdmissionConfig(slot_classes=("interactive",)), True),
    ("idle slot", B(in_flight=1, load=SLOTS_FREE), "interactive", AdmissionConfig(slot_classes=("interactive",)),
     False),
    ("the gateway's own request ended since the sample", B(in_flight=0, load=SLOTS_FULL, load_in_flight=1),
     "interactive", AdmissionConfig(slot_classes=("interactive",)), False),
    ("another client holds the slot", B(in_flight=0, load=SLOTS_FULL, load_in_flight=0),
     "interactive", AdmissionConfig(slot_classes=("interactive",)), True),
])
def test_saturation(name, b, klass, cfg, expected):
    assert saturated(b, klass, FRESH + 1.0, cfg) is expected, name


def test_admit_filters_and_refuses_with_retry_after_when_all_saturated():
    ok, full = B(load=SLOTS_FREE), B(load=SLOTS_FULL)
    cfg = AdmissionConfig(slot_classes=("interactive",), status=429, retry_after_s=7)
    assert admit([full, ok], "m", "interactive", FRESH, cfg) == [ok]
    with pytest.raises(GatewayError) as ei:
        admit([full], "m", "interactive", FRESH, cfg)
    assert ei.value.status == 429 and ei.value.headers["Retry-After"] == "7"
    with pytest.raises(GatewayError) as ei:
        admit([full], "m", "interactive", FRESH, AdmissionConfig(slot_classes=("interactive",)))
    assert ei.value.status == 503 and ei.value.code == "server_is_overloaded"


def _cfg(backends, **extra):
    return parse_config({"auth": {"enabled": False}, "backends": backends, **extra}, build_policy)


A = {"id": "a", "engine": "vllm", "url": "http://127.0.0.1:1", "models": ["m"]}
C = {"id": "c", "engine": "llamacpp", "url": "http://127.0.0.1:3", "models": ["m"]}


@pytest.mark.parametrize("new,expected", [
    ([A, C], {"added": ["c"], "removed": [], "replaced": [], "updated": []}),
    ([C], {"added": ["c"], "removed": ["a"], "replaced": [], "updated": []}),
    ([{**A, "url": "http://127.0.0.1:2"}], {"added": [], "removed": [], "replaced": ["a"], "updated": []}),
    ([{**A, "weight": 2.0}], {"added": [], "removed": [], "replaced": [], "updated": ["a"]}),
    ([A], {"added": [], "removed": [], "replaced": [], "updated": []}),
])
def test_reload_plan(new, expected):
    s = plan(_cfg([A]), _cfg(new)).summary()
    assert {k: s[k] for k in expected} == expected


def test_reload_plan_names_settings_that_need_a_restart():
    p = plan(_cfg([A]), _cfg([A], server={"port": 9999}, health={"interval_s": 0.3}))
    assert p.restart_needed == ["server.port"]
