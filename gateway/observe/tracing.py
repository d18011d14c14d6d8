"""OpenTelemetry traces of requests, made after the fact from the times the gateway records anyway.

Off (the default), nothing here runs and OpenTelemetry is never imported: the request path tests one attribute for
None. On, a request's end and each of its attempts leave a small record (Gateway.finish, Gateway.record); a
background round (`emit`, every EMIT_S) turns the records into spans with explicit start and end times: one span
per request, with the GenAI semantic conventions, a child span per attempt (backend, status, outcome, whether the
request failed over from it) and the first token as an event. The SDK's batch processor exports them over OTLP
from its own thread, so no export ever waits on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Final, Mapping

from gateway.config_usage import ObserveConfig
from gateway.contracts import OK, Outcome, RequestShape

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("shapegate.traces")

EMIT_S: Final = 0.5  # how often records become spans (a request's trace is out within two rounds of its end)
MAX_PENDING: Final = 100_000  # records waiting for a round; past it they are dropped (and counted)
# gen_ai.operation.name of each generating route (the GenAI semantic conventions' names); other routes by name.
OPERATIONS: Final[dict[str, str]] = {"chat": "chat", "messages": "chat", "responses": "chat",
                                     "completions": "text_completion", "embeddings": "embeddings"}
_FIRST_TOKEN: Final = "gen_ai.first_token"


class AttemptRecord:
    """One ended attempt, as Gateway.record saw it."""

    __slots__ = ("backend", "outcome", "t_upstream")

    def __init__(self, backend: str, outcome: Outcome, t_upstream: float) -> None:
        self.backend = backend
        self.outcome = outcome
        self.t_upstream = t_upstream


class RequestRecord:
    """One ended request, as Gateway.finish saw it."""

    __slots__ = ("request_id", "route", "method", "shape", "key", "reason", "status", "result", "t_in", "t_end",
                 "parent", "usage")

    def __init__(self, request_id: str, route: str, method: str, shape: RequestShape | None, key: str | None,
                 reason: str, status: int, result: str, t_in: float, t_end: float, parent: Mapping[str, str],
                 usage: tuple[int, int, int]) -> None:
        self.request_id = request_id
        self.route = route
        self.method = method
        self.shape = shape
        self.key = key
        self.reason = reason
        self.status = status
        self.result = result
        self.t_in = t_in
        self.t_end = t_end
        self.parent = parent  # the caller's valid traceparent (and tracestate), or empty
        self.usage = usage  # (input, cached input, output) tokens, as the usage ledger counts them


class RequestTracer:
    """Records of ended requests and attempts, turned into spans by `emit` off the request path."""

    def __init__(self, cfg: ObserveConfig, exporter: SpanExporter | None = None) -> None:
        # Imported here, not at the top: with traces off, OpenTelemetry is never loaded.
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(cfg.sampling_ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(exporter or otlp_exporter(cfg)))
        self.tracer = self.provider.get_tracer("shapegate")
        self._attempts: dict[RequestShape, list[AttemptRecord]] = {}  # the attempts of requests not yet emitted
        self._ended: list[RequestRecord] = []  # requests ended since the last round
        self._ready: list[RequestRecord] = []  # ...and those of the round before, emitted in this one
        self.dropped = 0

    # -- on the request's way out: records only ----------------------------------------------------
    def attempt(self, shape: RequestShape, backend: str, o: Outcome, t_upstream: float) -> None:
        """An attempt ended (from the record stage, which runs after the attempt's own loop turn)."""
        tries = self._attempts.get(shape)
        if tries is None:
            if len(self._attempts) >= MAX_PENDING:
                self.dropped += 1
                return
            self._attempts[shape] = [AttemptRecord(backend, o, t_upstream)]
        else:
            tries.append(AttemptRecord(backend, o, t_upstream))

    def request(self, rec: RequestRecord) -> None:
        """A request ended, however it ended."""
        if len(self._ended) >= MAX_PENDING:
            self.dropped += 1
            return
        self._ended.append(rec)

    # -- the background round ----------------------------------------------------------------------
    def emit(self) -> int:
        """Spans for the requests that ended before the previous round (by then their last attempt, recorded at
        the end of its loop turn, is in too); how many requests were traced."""
        ready, self._ready, self._ended = self._ready, self._ended, []
        if not ready:
            return 0
        offset = time.time_ns() - time.perf_counter_ns()  # perf_counter times -> the epoch, in ns
        for rec in ready:
            tries = self._attempts.pop(rec.shape, []) if rec.shape is not None else []
            try:
                self._spans(rec, tries, offset)
            except Exception as e:  # one odd record must not lose the rest of the round
                log.error("tracing a request failed: %s", type(e).__name__)
        return len(ready)

    def _spans(self, rec: RequestRecord, tries: list[AttemptRecord], offset: int) -> None:
        trace = self._trace
        ns = _clock(offset)
        parent = self._propagator.extract(rec.parent) if rec.parent else None
        shape = rec.shape
        op = OPERATIONS.get(rec.route, rec.route)
        attrs: dict[str, Any] = {"gen_ai.operation.name": op, "http.request.method": rec.method,
                                 "http.response.status_code": rec.status, "shapegate.route": rec.route,
                                 "shapegate.request_id": rec.request_id, "shapegate.outcome": rec.result}
        if shape is not None:
            attrs.update({"gen_ai.request.model": shape.model, "shapegate.class": shape.klass})
            if shape.max_output is not None:
                attrs["gen_ai.request.max_tokens"] = shape.max_output
        if rec.key is not None:
            attrs["shapegate.key_id"] = rec.key
        if rec.reason:
            attrs["shapegate.reason"] = rec.reason
        if tries:
            attrs["shapegate.backend"] = tries[-1].backend
            attrs["shapegate.attempts"] = len(tries)
        if rec.usage != (0, 0, 0):
            attrs["gen_ai.usage.input_tokens"], cached, attrs["gen_ai.usage.output_tokens"] = rec.usage
            if cached:
                attrs["gen_ai.usage.cache_read.input_tokens"] = cached
        t_start = rec.t_in if rec.t_in > 0 else (tries[0].t_upstream if tries else rec.t_end)
        name = f"{op} {shape.model}" if shape is not None else op
        span = self.tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attrs,
                                      start_time=ns(t_start))
        if rec.status >= 500 or rec.result not in (OK, "client_left", "client_error"):
            span.set_status(trace.Status(trace.StatusCode.ERROR))
            span.set_attribute("error.type", str(rec.status) if rec.status >= 400 else rec.result)
        last = tries[-1] if tries else None
        if last is not None and last.outcome.ttft is not None:
            span.add_event(_FIRST_TOKEN, {"gen_ai.server.time_to_first_token": last.outcome.ttft + last.t_upstream
                                          - t_start}, timestamp=ns(last.t_upstream + last.outcome.ttft))
        inner = trace.set_span_in_context(span)
        for i, a in enumerate(tries):
            self._attempt_span(a, i, i < len(tries) - 1, inner, ns)
        span.end(end_time=max(ns(rec.t_end), ns(t_start)))

    def _attempt_span(self, a: AttemptRecord, index: int, failed_over: bool, context: Any, ns: Any) -> None:
        trace, o = self._trace, a.outcome
        attrs: dict[str, Any] = {"shapegate.backend": a.backend, "shapegate.attempt": index + 1,
                                 "http.response.status_code": o.status, "shapegate.outcome": o.result,
                                 "shapegate.failed_over": failed_over}
        if o.ok or o.ttft is not None:
            attrs["gen_ai.usage.input_tokens"] = o.prompt_tokens
            attrs["gen_ai.usage.output_tokens"] = o.completion_tokens
        span = self.tracer.start_span(f"attempt {a.backend}", context=context, kind=trace.SpanKind.CLIENT,
                                      attributes=attrs, start_time=ns(a.t_upstream))
        if not o.ok and o.result != "client_left":
            span.set_status(trace.Status(trace.StatusCode.ERROR))
            span.set_attribute("error.type", str(o.status) if o.status >= 400 else o.result)
        if failed_over:  # why the next candidate took the request: how this attempt ended
            span.set_attribute("shapegate.failover_reason", f"{o.result} {o.status}")
        if o.ttft is not None:
            span.add_event(_FIRST_TOKEN, {"gen_ai.server.time_to_first_token": o.ttft},
                           timestamp=ns(a.t_upstream + o.ttft))
        span.end(end_time=ns(a.t_upstream + o.e2e))

    def drain(self) -> None:
        """Spans for every request ended so far (at shutdown, once no request is left to end)."""
        self.emit()
        self.emit()

    def shutdown(self) -> None:
        """Export what is left and stop the exporter's thread (blocking: run it off the loop, after drain)."""
        self.provider.shutdown()


def _clock(offset: int):
    def ns(t: float) -> int:
        return int(t * 1e9) + offset
    return ns


def otlp_exporter(cfg: ObserveConfig) -> SpanExporter:
    """The OTLP exporter `cfg` names: HTTP/protobuf to ENDPOINT/v1/traces, or gRPC to ENDPOINT (its package is
    not in the `otel` extra: pip install opentelemetry-exporter-otlp-proto-grpc)."""
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return GrpcExporter(endpoint=cfg.endpoint, timeout=cfg.timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=cfg.endpoint.rstrip("/") + "/v1/traces", timeout=cfg.timeout_s)


class TracingUnavailable(ValueError):
    """[observe] traces is on, but the OpenTelemetry packages it needs are not installed."""


def make_tracer(cfg: ObserveConfig, exporter: SpanExporter | None = None) -> RequestTracer | None:
    """The tracer [observe] asks for, or None when traces are off. TracingUnavailable names the missing package."""
    if not cfg.traces:
        return None
    try:
        return RequestTracer(cfg, exporter)
    except ImportError as e:
        extra = "opentelemetry-exporter-otlp-proto-grpc" if cfg.protocol == "grpc" else "shapegate[otel]"
        raise TracingUnavailable(f"[observe] traces = true needs OpenTelemetry ({e.name or e} is not installed): "
                                 f"pip install '{extra}'") from None


async def emit_loop(tracer: RequestTracer, stop: asyncio.Event) -> None:
    """Every EMIT_S until `stop`: the ended requests' spans, made on the loop (a few microseconds a span) and handed
    to the exporter's thread."""
    while not stop.is_set():
        try:
            async with asyncio.timeout(EMIT_S):
                await stop.wait()
        except TimeoutError:
            pass
        tracer.emit()
