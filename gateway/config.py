"""The gateway's configuration: pydantic models (frozen, unknown keys rejected) loaded from one TOML file."""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

import policies
from backends import engine_names
from gateway.config_base import CLASS_NAMES, Strict
from gateway.config_errors import did_you_mean, error_lines
from gateway.config_experiments import ExperimentConfig, ProbeConfig
from gateway.config_queue import AdmissionConfig, Priority, QueueConfig
from gateway.config_usage import ObserveConfig, UsageConfig

# What config.example.toml has instead of a digest: copying the example must not give a usable key.
KEY_PLACEHOLDER = "run-shapegate-keys-new-and-put-its-sha256-here"


class ServerConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    shutdown_grace_s: float = Field(30.0, ge=0)
    access_log: bool = True
    keepalive_s: float = Field(75.0, gt=0)
    # Limits on what a client sends before its request is served (431, 408; see gateway/http/front.py).
    max_head_bytes: int = Field(32 * 1024, ge=1024)
    max_headers: int = Field(100, ge=8)
    head_timeout_s: float = Field(15.0, gt=0)
    body_timeout_s: float = Field(60.0, gt=0)
    # A client that takes nothing of its reply for this long is dropped (its engine request is aborted).
    write_timeout_s: float = Field(30.0, gt=0)
    # Open client connections; at the limit the oldest one not being served makes room. Also bounded by
    # the process's file limit (each connection may need one to an engine).
    max_connections: int = Field(10_000, ge=16)
    # Connections in the middle of sending a request head or body; past it the oldest one gets a 408.
    max_reading_connections: int = Field(1024, ge=1)
    # Start-up's objects frozen out of garbage collection before serving, and the young generation sized for
    # the requests in flight (gateway/observe/loop_watch.py).
    gc_freeze: bool = True
    # Fields an engine adds to OpenAI's replies of its own (llama.cpp's `timings`): dropped unless kept here, or
    # per backend ([[backends]] engine_private_fields), so that clients see one API whichever engine answered.
    engine_private_fields: bool = False


# Beyond any engine fleet (a billion requests, a trillion tokens a minute); larger numbers would only overflow
# what stores, lists and counts them (GET /admin/keys could not even show a key with 2**64).
MAX_RPM = 10**9
MAX_TPM = 10**12
MAX_QUOTA = 10**15  # tokens a quota counts to: whole numbers all the way in a double (Redis's Lua numbers)
# Per-model limits one key (or [limits]) may have: each is a bucket pair the limiter keeps per key and model.
MAX_MODEL_LIMITS = 256
MAX_MODEL_NAME = 256


class RateLimit(Strict):
    """Requests and tokens per minute, at most MAX_RPM and MAX_TPM, and token quotas per UTC day and month, at most
    MAX_QUOTA; None: no limit of that kind."""
    rpm: int | None = Field(None, ge=1, le=MAX_RPM)
    tpm: int | None = Field(None, ge=1, le=MAX_TPM)
    tokens_per_day: int | None = Field(None, ge=1, le=MAX_QUOTA)
    tokens_per_month: int | None = Field(None, ge=1, le=MAX_QUOTA)


class KeyLimits(RateLimit):
    # Per public model, on top of the key's own limits (a request needs room in both).
    models: dict[str, RateLimit] = Field(default_factory=dict, max_length=MAX_MODEL_LIMITS)

    @field_validator("models")
    @classmethod
    def _model_names(cls, v: dict[str, RateLimit]) -> dict[str, RateLimit]:
        for name in v:
            if not 1 <= len(name) <= MAX_MODEL_NAME:
                raise ValueError(f"model names are 1 to {MAX_MODEL_NAME} characters")
        return v


class ApiKey(Strict):
    id: str = Field(min_length=1)
    sha256: str
    admin: bool = False
    limits: KeyLimits | None = None  # None: the [limits] defaults
    # Where its requests wait when the backends are saturated ([queue]): None, each request's class decides;
    # priority_header: its requests may set their own with x-shapegate-priority.
    priority: Priority | None = None
    priority_header: bool = False

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, v: str) -> str:
        v = v.strip().lower()
        if v == KEY_PLACEHOLDER:
            raise ValueError("still the example's placeholder: run `shapegate keys new` and put the sha256 "
                             "it prints here (the key itself goes to the client)")
        if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            raise ValueError("must be the 64-character hex SHA-256 digest of the key "
                             "(`shapegate keys new` makes a key and prints its digest)")
        return v


class AuthConfig(Strict):
    enabled: bool = True
    keys: tuple[ApiKey, ...] = ()
    # Keys made at run time (POST /admin/keys) persist here when [state] is not Redis; None: kept in memory.
    keys_file: str | None = None

    @model_validator(mode="after")
    def _keys_when_enabled(self) -> "AuthConfig":
        if self.enabled and not self.keys:
            raise ValueError("auth is enabled but no [[auth.keys]] are configured; "
                             "add keys or set [auth] enabled = false explicitly")
        ids = [k.id for k in self.keys]
        if len(ids) != len(set(ids)):
            raise ValueError("[[auth.keys]] ids must be unique")
        return self


class UpstreamConfig(Strict):
    connect_timeout_s: float = Field(2.0, gt=0)
    first_byte_timeout_s: float = Field(120.0, gt=0)
    idle_timeout_s: float = Field(60.0, gt=0)
    pool_limit: int = Field(1024, ge=1)
    pool_limit_per_backend: int = Field(512, ge=1)
    keepalive_s: float = Field(30.0, gt=0)
    # Bounds on what an engine sends: a non-streamed reply (larger: 502), an error body (cut there), one
    # server-sent event (larger: the stream ends with an error event).
    max_reply_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    max_error_bytes: int = Field(64 * 1024, ge=1024)
    max_event_bytes: int = Field(1024 * 1024, ge=1024)
    # Per request class: a stream whose engine sent nothing within this long fails over to the next
    # candidate (the last candidate still gets first_byte_timeout_s). Classes not named use that too.
    ttft_deadline_s: dict[str, float] = Field(default_factory=dict)

    @field_validator("ttft_deadline_s")
    @classmethod
    def _deadline_classes(cls, v: dict[str, float]) -> dict[str, float]:
        for name, seconds in v.items():
            if name not in CLASS_NAMES:
                raise ValueError(f"unknown class {name!r}; expected one of {', '.join(CLASS_NAMES)}")
            if not seconds > 0:
                raise ValueError(f"the deadline of {name!r} must be greater than 0")
        return v


class ModelRouting(Strict):
    policy: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)


class RoutingConfig(Strict):
    # The policy that routes by each request's shape: the reason to run the gateway, and the best of the four
    # on a mixed workload (benchmarks/results/routing.md).
    policy: str = "shape"
    params: dict[str, Any] = Field(default_factory=dict)
    max_attempts: int = Field(3, ge=1, le=10)
    retry_deadline_s: float = Field(30.0, gt=0)
    models: dict[str, ModelRouting] = Field(default_factory=dict)


class ShapeConfig(Strict):
    long_prompt_tokens: int = Field(768, ge=1)
    prefill_ratio: float = Field(2.0, ge=0)  # a long prompt must also be this many times the expected output
    long_output_tokens: int = Field(512, ge=1)
    default_output_tokens: int = Field(256, ge=1)
    prefix_block_chars: int = Field(256, ge=16)
    max_prefix_blocks: int = Field(64, ge=1)


class HealthConfig(Strict):
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    sglang_interval_s: float = Field(5.0, gt=0)
    sglang_timeout_s: float = Field(25.0, gt=0)
    healthy_threshold: int = Field(1, ge=1)
    unhealthy_threshold: int = Field(2, ge=1)
    load_interval_s: float = Field(0.5, gt=0)
    load_stale_s: float = Field(3.0, gt=0)
    breaker_failures: int = Field(5, ge=1)
    breaker_open_s: float = Field(5.0, gt=0)
    overload_hold_s: float = Field(1.0, gt=0)
    backoff_max_s: float = Field(2.0, gt=0)
    warmup: bool = True
    warmup_timeout_s: float = Field(10.0, gt=0)
    # A backend not ready this long after it was added is logged with why (again when the cause changes).
    startup_grace_s: float = Field(30.0, gt=0)


class LimitsConfig(KeyLimits):
    """[limits]: every key's defaults (rpm, tpm, per-model limits); a key's own `limits` replace them."""

    # With Redis state: the longest a request waits for the shared buckets before this process decides alone.
    redis_timeout_s: float = Field(0.05, gt=0, le=5)
    # With Redis state: how many gateway processes (replicas x workers) share the limits. While Redis is
    # unusable each process enforces limit / the larger of this and the count it last saw in Redis, so one
    # that starts while Redis is down does not count itself alone.
    processes: int = Field(1, ge=1, le=100_000)
    # With Redis state: after Redis restarted or was replaced (a new run id, so every bucket was lost), each
    # process decides alone on its own buckets this long before it trusts the shared ones again.
    restart_hold_s: float = Field(60.0, ge=0, le=3600)


class StateConfig(Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "shapegate:"
    affinity_ttl_s: float = Field(600.0, gt=0)
    affinity_max_entries: int = Field(100_000, ge=16)  # prefix blocks and sessions kept; least recent go first
    flush_interval_s: float = Field(0.5, gt=0)
    redis_timeout_s: float = Field(0.25, gt=0)  # one background Redis call; on timeout the state stays local
    # Stored responses (Responses API): which backend holds each id and which key owns it, least recent first out.
    stored_responses_max: int = Field(100_000, ge=16)
    stored_response_ttl_s: float = Field(86_400.0, gt=0)  # kept this long after it was made (engines forget on restart)


class ResponsesConfig(Strict):
    # "gateway": stored responses and conversations are kept by the gateway (memory, or Redis with [state] backend =
    # "redis") and every turn is routed like any request; "engine": passed through to the engines that keep them.
    state: Literal["gateway", "engine"] = "gateway"
    ttl_s: float = Field(2_592_000.0, gt=0)  # a stored response or conversation is kept this long after its last write
    max_response_bytes: int = Field(4 << 20, ge=1024)  # one stored response: its input items and the Response object
    max_per_key: int = Field(10_000, ge=1)  # stored responses per key: past it the key's oldest go first
    max_bytes_per_key: int = Field(256 << 20, ge=1024)
    max_total: int = Field(200_000, ge=16)  # stored responses in all: past it the oldest of all go first
    max_total_bytes: int = Field(1 << 30, ge=1 << 20)
    max_conversations_per_key: int = Field(10_000, ge=1)  # past it, creating another is refused (409)
    max_conversation_items: int = Field(10_000, ge=1)  # past it, adding items is refused (400)
    max_conversation_bytes: int = Field(16 << 20, ge=1024)
    cache_bytes: int = Field(64 << 20, ge=0)  # with Redis: recent records kept here too (checked, never trusted alone)
    # One Redis call of the store (a turn's record is written before its final event: a slow moment must not lose it)
    store_timeout_s: float = Field(2.0, gt=0)
    background_timeout_s: float = Field(600.0, gt=0)  # a `background: true` response runs this long at most


class MetricsConfig(Strict):
    enabled: bool = True
    require_admin: bool = False


class DashboardConfig(Strict):
    enabled: bool = True
    secure_cookie: bool = True  # the sign-in cookie is sent over HTTPS only; false for plain-HTTP loopback
    session_secret_env: str | None = None  # env var holding the cookie-signing secret (shared by replicas)
    session_ttl_s: float = Field(43200.0, gt=0)


class StatsConfig(Strict):
    # false: no latency-model learning, no rolling samples, no latency histograms (counters stay)
    enabled: bool = True
    window_s: float = Field(60.0, gt=0)
    max_samples: int = Field(2048, ge=16)
    model_half_life_s: float = Field(120.0, gt=0)  # the latency model forgets samples at this pace
    warmup_samples: int = Field(1, ge=0)  # first samples after a backend becomes ready do not teach the model
    refit_interval_s: float = Field(0.05, gt=0)  # the latency model is solved again at most this often


class LatencyHints(Strict):
    ttft_ms: float | None = Field(None, gt=0)
    prefill_tps: float | None = Field(None, gt=0)
    itl_ms: float | None = Field(None, gt=0)
    itl_per_stream_ms: float | None = Field(None, ge=0)


class BackendConfig(Strict):
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    engine: str  # one of backends.engine_names()
    url: str
    models: dict[str, str]
    api_key_env: str | None = None
    classes: tuple[str, ...] | None = None
    interactive: bool = False
    weight: float = Field(1.0, gt=0)
    hints: LatencyHints = LatencyHints()
    # Tokens one request may hold here (prompt + output): discovered from the engine when it says; this
    # overrides it, or supplies it for an engine that does not.
    max_context: int | None = Field(None, ge=1)
    engine_private_fields: bool | None = None  # None: as [server] engine_private_fields says
    # Requests the engine runs at once (vLLM --max-num-seqs, SGLang --max-running-requests): the gateway's queue
    # holds the rest. None: llama.cpp's slots as it reports them, else the most the engine was seen running.
    seats: int | None = Field(None, ge=1)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        known = engine_names()
        if v not in known:
            raise ValueError(f"unknown engine {v!r}{did_you_mean(v, known)}; expected one of {', '.join(known)}")
        return v

    @field_validator("models", mode="before")
    @classmethod
    def _models_list_or_table(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return {str(name): str(name) for name in v}
        return v

    @field_validator("models")
    @classmethod
    def _models_nonempty(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("a backend must serve at least one model")
        return v

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")

    @field_validator("classes")
    @classmethod
    def _known_classes(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for name in v or ():
            if name not in CLASS_NAMES:
                raise ValueError(f"unknown class {name!r}; expected one of {', '.join(CLASS_NAMES)}")
        return v


class GatewayConfig(Strict):
    server: ServerConfig = ServerConfig()
    auth: AuthConfig = AuthConfig(enabled=False)
    limits: LimitsConfig = LimitsConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    routing: RoutingConfig = RoutingConfig()
    shape: ShapeConfig = ShapeConfig()
    health: HealthConfig = HealthConfig()
    admission: AdmissionConfig = AdmissionConfig()
    queue: QueueConfig = QueueConfig()
    state: StateConfig = StateConfig()
    responses: ResponsesConfig = ResponsesConfig()
    metrics: MetricsConfig = MetricsConfig()
    stats: StatsConfig = StatsConfig()
    dashboard: DashboardConfig = DashboardConfig()
    probe: ProbeConfig = ProbeConfig()
    usage: UsageConfig = UsageConfig()
    observe: ObserveConfig = ObserveConfig()
    backends: tuple[BackendConfig, ...] = Field(min_length=1)
    experiments: tuple[ExperimentConfig, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _auth_is_explicit(cls, data: Any) -> Any:
        # Running without keys must be a visible choice in the file, never a default.
        if isinstance(data, dict) and "auth" not in data:
            data = {**data, "auth": {"enabled": True}}
        return data

    @model_validator(mode="after")
    def _across_sections(self) -> "GatewayConfig":
        problems = across_sections(self)
        if problems:
            raise ValueError("\n".join(problems))  # one line each: every problem at once
        return self


def across_sections(cfg: GatewayConfig) -> list[str]:
    """What no single section can check: unique backend ids, experiments that fit the backends. Each line names its
    field (experiments by name)."""
    problems = []
    ids = [b.id for b in cfg.backends]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        problems.append(f"backends: ids must be unique: {', '.join(dupes)}")
    served = {b.id: b.models for b in cfg.backends}
    models = {m for b in cfg.backends for m in b.models}
    names, modes = set(), {}
    for x in cfg.experiments:
        where = f"experiments[{x.name}]"
        if x.name in names:
            problems.append(f"{where}.name: experiment names must be unique ({x.name!r} twice)")
        names.add(x.name)
        if x.model not in models:
            problems.append(f"{where}.model: no backend serves model {x.model!r}{did_you_mean(x.model, models)}")
        if (x.model, x.mode) in modes:
            problems.append(f"{where}: model {x.model!r} already has a {x.mode} experiment "
                            f"({modes[x.model, x.mode]!r}); one of each mode per model")
        modes.setdefault((x.model, x.mode), x.name)
        for arm in x.arms:
            for b in arm.backends:
                if b not in served:
                    problems.append(f"{where}.arms[{arm.name}].backends: unknown backend {b!r}{did_you_mean(b, served)}")
                elif x.model not in served[b]:
                    problems.append(f"{where}.arms[{arm.name}].backends: backend {b!r} does not serve {x.model!r}")
    # A backend that serves a model's split arm must not also be kept out of serving it as a shadow arm.
    for x in cfg.experiments:
        if x.mode != "shadow":
            continue
        shadowed = {b for a in x.arms for b in a.backends}
        for y in cfg.experiments:
            if y.mode == "split" and y.model == x.model:
                both = sorted(shadowed & {b for a in y.arms for b in a.backends})
                if both:
                    problems.append(f"backend {both[0]!r} is an arm of split experiment {y.name!r} and of shadow "
                                    f"experiment {x.name!r}: an arm cannot be in two modes at once")
        if all(set(served[b]) and x.model in served[b] and b in shadowed for b in served if x.model in served[b]):
            problems.append(f"shadow experiment {x.name!r}: every backend of {x.model!r} is a shadow arm; leave at "
                            "least one to serve the model")
    return problems


class ConfigError(ValueError):
    """The configuration file is missing, not TOML, or not valid; the message names the field."""


# Builds the policy a name and its params describe; raises pydantic's ValidationError for bad params and
# ValueError naming the known policies for an unknown name. The gateway layer supplies it
# (gateway.runtime.build_policy): the configuration knows no policy of its own.
PolicyFactory = Callable[[str, Mapping[str, Any]], object]


def _invalid(lines: list[str]) -> ConfigError:
    return ConfigError("invalid configuration:\n" + "\n".join(lines))


def _policy_lines(name: str, params: Mapping[str, Any], where: tuple[str, ...],
                  build: PolicyFactory) -> tuple[bool, list[str]]:
    """(whether the policy exists, why `build` refuses it: empty when it accepts it)."""
    try:
        build(name, params)
    except ValidationError as e:
        return True, error_lines(e, {}, GatewayConfig, (*where, "params"))
    except ValueError as e:
        msg = str(e).replace(repr(name), repr(name) + did_you_mean(name, policies.policy_names()), 1)
        return False, [f"  {'.'.join((*where, 'policy'))}: {msg}"]
    return True, []


def policy_problems(r: RoutingConfig, build: PolicyFactory) -> list[str]:
    """Why the policies the routing section names do not build (each with its path); empty when they all do."""
    default_known, lines = _policy_lines(r.policy, r.params, ("routing",), build)
    for model, m in r.models.items():
        if m.policy is None and not default_known:
            continue  # inherits the unknown routing.policy, reported once above
        lines += _policy_lines(m.policy or r.policy, m.params, ("routing", "models", model), build)[1]
    return lines


def check_policies(cfg: GatewayConfig, build: PolicyFactory) -> None:
    """Every policy the routing section names exists and takes its params; raises ConfigError with their paths."""
    lines = policy_problems(cfg.routing, build)
    if lines:
        raise _invalid(lines)


def parse_config(data: dict[str, Any], policies: PolicyFactory) -> GatewayConfig:
    """The validated configuration, its routing policies and their params included (`policies` builds them:
    gateway.runtime.build_policy). ConfigError lists every problem found, not only the first."""
    try:
        cfg = GatewayConfig.model_validate(data)
    except ValidationError as e:
        lines = error_lines(e, data, GatewayConfig)
        routing = _routing_alone(data)  # its policies are checked too when the section itself is valid
        raise _invalid(lines + (policy_problems(routing, policies) if routing is not None else [])) from None
    check_policies(cfg, policies)
    return cfg


def _routing_alone(data: Any) -> RoutingConfig | None:
    section = data.get("routing", {}) if isinstance(data, dict) else None
    try:
        return RoutingConfig.model_validate(section)
    except ValidationError:
        return None  # its errors are among the file's already


def load_config(path: str | Path, policies: PolicyFactory) -> GatewayConfig:
    """The file at `path`, validated completely; ConfigError says why it cannot be used."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"configuration file not found: {p}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise ConfigError(f"cannot read configuration file {p}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    return parse_config(data, policies)
