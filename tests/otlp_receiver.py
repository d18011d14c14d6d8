"""A small OTLP/HTTP trace receiver on loopback: what an OpenTelemetry collector would be handed, decoded."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)

from benchmarks.loopback import free_port

RECEIVED: web.AppKey[list[dict[str, Any]]] = web.AppKey("received", list)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


def span_dict(span: Any, service: str) -> dict[str, Any]:
    """A span as a test reads it: ids in hex, attributes and events as plain values."""
    return {"service": service, "name": span.name, "kind": span.kind, "trace_id": span.trace_id.hex(),
            "span_id": span.span_id.hex(), "parent_span_id": span.parent_span_id.hex(),
            "start": span.start_time_unix_nano, "end": span.end_time_unix_nano, "status": span.status.code,
            "attributes": {a.key: _value(a.value) for a in span.attributes},
            "events": [{"name": e.name, "time": e.time_unix_nano,
                        "attributes": {a.key: _value(a.value) for a in e.attributes}} for e in span.events]}


async def _traces(request: web.Request) -> web.Response:
    if request.headers.get("Content-Type") != "application/x-protobuf":
        return web.Response(status=415)
    msg = ExportTraceServiceRequest()
    msg.ParseFromString(await request.read())
    for rs in msg.resource_spans:
        service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            request.app[RECEIVED].extend(span_dict(s, service) for s in ss.spans)
    return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf")


class OtlpReceiver:
    """POST /v1/traces (OTLP/HTTP, protobuf): every span it was sent, in `spans`."""

    def __init__(self) -> None:
        self.app = web.Application()
        self.app[RECEIVED] = []
        self.app.router.add_post("/v1/traces", _traces)
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spans(self) -> list[dict[str, Any]]:
        return self.app[RECEIVED]

    async def start(self) -> OtlpReceiver:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
