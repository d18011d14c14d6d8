"""The settings read on every request, copied out of one configuration into plain attributes."""

from __future__ import annotations

from gateway.config import GatewayConfig
from gateway.config_queue import QueueSettings
from policies.shape_params import Params as ShapeParams


class HotSettings:
    """What the request path reads of a GatewayConfig, made once per configuration (Gateway.hot).

    Each read of a pydantic model's field goes through its __getattr__ hook, a few hundred instructions, and a
    request read about thirty; here each is a plain attribute (compiled: a field of a C struct). The sections
    passed on whole (shape, admission, limits, health) are held as they are, one read fewer each.

    Written out, as policies/shape.py's Settings: a few fields picked from several sections, each typed by mypy
    from the configuration and set in __init__ where mypyc sees it (a generic copy helper would lose both).
    """

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg  # the configuration these were copied from: a reload makes a new one
        server = cfg.server
        # [server]: the front's limits and timeouts
        self.head_timeout_s = server.head_timeout_s
        self.body_timeout_s = server.body_timeout_s
        self.write_timeout_s = server.write_timeout_s
        self.keepalive_s = server.keepalive_s
        self.max_head_bytes = server.max_head_bytes
        self.max_headers = server.max_headers
        self.max_body_bytes = server.max_body_bytes
        self.max_connections = server.max_connections
        self.max_reading_connections = server.max_reading_connections
        # [routing] and [upstream]: failover and the waits on an engine
        routing, upstream = cfg.routing, cfg.upstream
        self.retry_deadline_s = routing.retry_deadline_s
        self.max_attempts = routing.max_attempts
        self.policy = routing.policy
        self.model_policies = {m: c.policy for m, c in routing.models.items() if c.policy}
        self.first_byte_timeout_s = upstream.first_byte_timeout_s
        self.ttft_deadline_s = dict(upstream.ttft_deadline_s)
        self.max_reply_bytes = upstream.max_reply_bytes
        self.max_error_bytes = upstream.max_error_bytes
        self.max_event_bytes = upstream.max_event_bytes
        self.stats_enabled = cfg.stats.enabled
        self.shape = cfg.shape
        self.admission = cfg.admission
        # [queue]: None when off (then [admission] refuses at once, as without a queue); the classes whose requests
        # in flight are counted per backend against their seat share.
        # An interactive backend keeps the shape policy's reserved slots (its validated params, default included).
        keep = ShapeParams(**cfg.routing.params).reserve_interactive_slots if cfg.routing.policy == "shape" else 0
        self.queue = QueueSettings(cfg.queue, cfg.admission, keep) if cfg.queue.enabled else None
        self.capped = frozenset(cfg.queue.seat_shares) if cfg.queue.enabled else frozenset()
        self.key_ids = frozenset(k.id for k in cfg.auth.keys)  # the queue's metrics label these keys by id
        self.limits = cfg.limits
        self.health = cfg.health

    def policy_name(self, model: str) -> str:
        """The routing policy's name for a model: its own, else the default."""
        return self.model_policies.get(model, self.policy)
