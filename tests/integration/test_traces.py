"""OpenTelemetry traces: a request that failed over is one trace with both attempts, exported over OTLP/HTTP to a
receiver on loopback; the caller's trace context is the parent; with traces off nothing of the SDK is loaded."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import aiohttp
import pytest

from tests import kit
from tests.fake_engine import FakeEngine, Knobs
from tests.gateway_harness import USER_KEY, gateway_config, start_gateway
from tests.otlp_receiver import OtlpReceiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


async def test_a_failed_over_request_is_one_trace_with_both_attempts():
    receiver = await OtlpReceiver().start()
    broken = await FakeEngine(Knobs(fail_status=500)).start()
    good = await FakeEngine(Knobs(stream_chunks=5)).start()
    cfg = gateway_config([{"id": "broken", "engine": "vllm", "url": broken.url, "models": ["m"]},
                          {"id": "good", "engine": "vllm", "url": good.url, "models": ["m"]}],
                         routing={"policy": "round_robin"}, health={"breaker_failures": 1000},
                         observe={"traces": True, "endpoint": receiver.url, "service_name": "gw-under-test"})
    gw = await start_gateway(cfg)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    headers = {"Authorization": f"Bearer {USER_KEY}", "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # round robin: one of two requests goes to the broken engine first
                async with s.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200
                    await r.read()
                    if "failover" in r.headers["x-shapegate-reason"]:
                        rid = r.headers["x-request-id"]
                        break
            else:
                raise AssertionError("no request failed over")

        def trace() -> list[dict] | None:
            top = [sp for sp in receiver.spans if sp["attributes"].get("shapegate.request_id") == rid]
            if not top:
                return None
            kids = [sp for sp in receiver.spans if sp["parent_span_id"] == top[0]["span_id"]]
            return [top[0], *sorted(kids, key=lambda sp: sp["attributes"]["shapegate.attempt"])]

        req, first, second = await kit.until(trace, "the request's trace at the receiver", timeout=10.0)
    finally:
        await gw.stop()
        for x in (broken, good, receiver):
            await x.stop()
    assert req["service"] == "gw-under-test" and req["name"] == "chat m"
    assert req["trace_id"] == TRACE_ID and req["parent_span_id"] == PARENT_ID  # the caller's context
    a = req["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "m"
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
    assert a["shapegate.attempts"] == 2 and a["shapegate.backend"] == "good" and "failover" in a["shapegate.reason"]
    assert [e["name"] for e in req["events"]] == ["gen_ai.first_token"]
    assert first["trace_id"] == second["trace_id"] == TRACE_ID
    assert first["attributes"]["shapegate.backend"] == "broken" and first["attributes"]["shapegate.failed_over"]
    assert first["attributes"]["http.response.status_code"] == 500 and first["attributes"]["error.type"] == "500"
    assert first["attributes"]["shapegate.failover_reason"] == "engine_error 500"
    assert first["status"] == 2  # STATUS_CODE_ERROR
    assert second["attributes"]["shapegate.backend"] == "good" and not second["attributes"]["shapegate.failed_over"]
    assert "shapegate.failover_reason" not in second["attributes"]
    assert second["attributes"]["http.response.status_code"] == 200 and second["status"] != 2
    assert [e["name"] for e in second["events"]] == ["gen_ai.first_token"]
    # The spans keep the gateway's own times: attempts one after the other, within the request.
    assert req["start"] <= first["start"] < first["end"] <= second["start"] < second["end"] <= req["end"]
    assert second["start"] < second["events"][0]["time"] < second["end"]


NO_SDK = """
import sys
from gateway.app import build_app
from gateway.config import parse_config
from gateway.runtime import GATEWAY, build_policy
cfg = parse_config({"auth": {"enabled": False},
                    "backends": [{"id": "a", "engine": "vllm", "url": "http://127.0.0.1:9", "models": ["m"]}]},
                   build_policy)
app = build_app(cfg)
assert app[GATEWAY].tracer is None
loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter")))
print(loaded)
"""


def test_traces_off_load_nothing_of_the_tracing_sdk():
    out = subprocess.run([sys.executable, "-c", NO_SDK], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_traces_on_without_the_packages_is_refused_at_start(tmp_path):
    # gRPC's exporter is not among the test dependencies: asking for it names what to install.
    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None:
        pytest.skip("the gRPC exporter is installed here")
    cfg = gateway_config([{"id": "a", "engine": "vllm", "url": "http://127.0.0.1:9", "models": ["m"]}],
                         observe={"traces": True, "protocol": "grpc"})
    from tests.procs import shapegate, write_config
    code, _, err = await shapegate("serve", "--config", str(write_config(tmp_path, cfg)), "--port", "0")
    assert code == 2 and "opentelemetry-exporter-otlp-proto-grpc" in err, err
