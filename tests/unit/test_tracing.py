"""Spans made after the fact from the gateway's own records: times, parents, sampling, refusals."""

from __future__ import annotations

import time

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.config_usage import ObserveConfig
from gateway.contracts import CLIENT_LEFT, ENGINE_ERROR, OK, REJECTED, Outcome, RequestShape
from gateway.observe.tracing import RequestRecord, RequestTracer, make_tracer

SHAPE = RequestShape("m", "responses", True, 30, 10, "default", "team-a", max_output=10)
PARENT = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


def tracer(**cfg) -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    t = make_tracer(ObserveConfig(traces=True, **cfg), exporter)
    assert t is not None
    return t, exporter


def record(shape: RequestShape | None = SHAPE, status: int = 200, result: str = OK, t_in: float = 100.0,
           t_end: float = 100.5, parent: dict | None = None) -> RequestRecord:
    return RequestRecord("req-1", "responses", "POST", shape, "team-a", "shape ttft", status, result, t_in, t_end,
                         parent or {}, (30, 0, 10) if result == OK else (0, 0, 0))


def finished(t: RequestTracer, exporter: InMemorySpanExporter) -> list:
    t.drain()
    t.provider.force_flush()
    return list(exporter.get_finished_spans())


def test_times_come_from_the_records_and_attempts_are_children():
    t, exporter = tracer()
    t.attempt(SHAPE, "a", Outcome("a", SHAPE, False, 503, e2e=0.05, result=ENGINE_ERROR), 100.01)
    t.attempt(SHAPE, "b", Outcome("b", SHAPE, True, 200, ttft=0.1, e2e=0.4, prompt_tokens=30,
                                  completion_tokens=10), 100.07)
    t.request(record(parent=PARENT))
    spans = {s.name: s for s in finished(t, exporter)}
    req, a, b = spans["chat m"], spans["attempt a"], spans["attempt b"]
    assert req.parent.span_id == 0xb7ad6b7169203331 and req.context.trace_id == 0x0af7651916cd43dd8448eb211c80319c
    assert a.parent.span_id == b.parent.span_id == req.context.span_id
    # perf_counter times become epoch times with their differences kept, to the nanosecond's rounding
    assert abs((b.start_time - req.start_time) - 70_000_000) < 10 and abs((b.end_time - b.start_time) - 4e8) < 10
    assert abs((req.end_time - req.start_time) - 5e8) < 10
    # an epoch time, not perf_counter's: the record's perf_counter 100.0 moved to the epoch
    assert abs(req.start_time - (time.time_ns() - time.perf_counter_ns() + 100 * 10**9)) < 10**9
    assert req.attributes["gen_ai.operation.name"] == "chat" and req.attributes["gen_ai.request.max_tokens"] == 10
    assert (req.attributes["gen_ai.usage.input_tokens"], req.attributes["gen_ai.usage.output_tokens"]) == (30, 10)
    assert a.attributes["shapegate.failed_over"] and a.attributes["error.type"] == "503"
    assert [e.name for e in b.events] == ["gen_ai.first_token"] and abs(b.events[0].timestamp - b.start_time - 1e8) < 10
    assert abs(req.events[0].attributes["gen_ai.server.time_to_first_token"] - 0.17) < 1e-9  # from the request's start


def test_a_refused_request_is_one_span_in_error_and_a_client_that_left_is_no_error():
    t, exporter = tracer()
    t.request(record(status=429, result=REJECTED, t_in=5.0, t_end=5.001))
    shape2 = RequestShape("m", "chat", True, 30, 10, "default", "team-a")
    t.attempt(shape2, "a", Outcome("a", shape2, False, 499, ttft=0.1, e2e=0.3, completion_tokens=3,
                                   result=CLIENT_LEFT), 6.0)
    t.request(RequestRecord("req-2", "chat", "POST", shape2, "team-a", "", 499, CLIENT_LEFT, 6.0, 6.3, {},
                            (30, 0, 3)))
    spans = {s.attributes["shapegate.request_id"]: s for s in finished(t, exporter) if s.name != "attempt a"}
    refused, left = spans["req-1"], spans["req-2"]
    assert refused.status.status_code.name == "ERROR" and refused.attributes["error.type"] == "429"
    assert left.status.status_code.name == "UNSET"


def test_sampling_follows_the_callers_flag_and_the_ratio():
    t, exporter = tracer(sampling_ratio=0.0)
    t.request(record())  # the gateway's own trace at ratio 0: dropped
    t.request(record(parent=PARENT))  # the caller sampled it: kept
    unsampled = {"traceparent": PARENT["traceparent"][:-2] + "00"}
    t.request(record(parent=unsampled))  # the caller did not: dropped
    spans = finished(t, exporter)
    assert [s.context.trace_id for s in spans] == [0x0af7651916cd43dd8448eb211c80319c]


def test_a_request_is_emitted_a_round_after_it_ended():
    t, exporter = tracer()
    t.request(record())
    assert t.emit() == 0  # its last attempt may be recorded at the end of this loop turn
    assert t.emit() == 1
    t.provider.force_flush()
    assert len(exporter.get_finished_spans()) == 1


def test_traces_off_is_no_tracer():
    assert make_tracer(ObserveConfig()) is None
