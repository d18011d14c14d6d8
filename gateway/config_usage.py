"""The configuration of the usage ledger ([usage], prices per model) and of request traces ([observe])."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config_base import Strict


class ModelPrice(Strict):
    """What a million tokens of one public model cost, in whatever currency the operator bills in."""

    input_per_million: float = Field(0.0, ge=0)
    output_per_million: float = Field(0.0, ge=0)
    # Prompt tokens the engine served from its prefix cache; unset: as any other input token.
    cached_input_per_million: float | None = Field(None, ge=0)


class UsageConfig(Strict):
    # Count every request per key, model, API, backend and hour (gateway/stats/ledger.py); kept where
    # [state] backend says: in this process's memory, or in Redis for every replica.
    enabled: bool = True
    retention_days: int = Field(90, ge=1, le=3650)
    flush_interval_s: float = Field(1.0, gt=0, le=60)  # counts go to the store in batches this often
    prices: dict[str, ModelPrice] = Field(default_factory=dict)  # public model name -> its price
    currency: str = Field("USD", min_length=1, max_length=8)


class ObserveConfig(Strict):
    # OpenTelemetry traces of every request (one span, a child per attempt), sent over OTLP. Needs the
    # `otel` extra (pip install 'shapegate[otel]'); off, nothing of OpenTelemetry is imported.
    traces: bool = False
    # The collector's base address: /v1/traces is added for http/protobuf; gRPC takes it as it is.
    endpoint: str = Field("http://127.0.0.1:4318", min_length=1)
    protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    service_name: str = Field("shapegate", min_length=1)
    sampling_ratio: float = Field(1.0, ge=0, le=1)  # of the traces the gateway starts; a caller's flag wins
    timeout_s: float = Field(10.0, gt=0)  # one export call
