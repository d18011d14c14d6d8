"""Config reload (SIGHUP, POST /admin/reload): re-read the TOML, validate it all, swap it in at once."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from aiohttp import web

from gateway.keys.auth import Authenticator
from gateway.config import BackendConfig, ConfigError, GatewayConfig, load_config
from gateway.errors import GatewayError
from gateway.experiments.experiment import Experiments
from gateway.runtime import GATEWAY, build_policy, build_routing

log = logging.getLogger("shapegate.reload")

# Settings baked into objects made at start-up (listening socket, connection pools, state store):
# a reload keeps the running values and says a restart is needed for them.
RESTART_ONLY = (("server", "host"), ("server", "port"), ("server", "shutdown_grace_s"),
                ("upstream", "connect_timeout_s"), ("upstream", "idle_timeout_s"), ("upstream", "pool_limit"),
                ("upstream", "pool_limit_per_backend"), ("upstream", "keepalive_s"), ("state", None),
                ("auth", "keys_file"))
# What identifies an engine connection: a backend whose id stays but one of these changes is replaced.
IDENTITY = ("url", "engine", "api_key_env")


@dataclass
class ReloadPlan:
    """What a new configuration changes, backend by backend (pure: computed from the two configs)."""

    added: list[BackendConfig] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    replaced: list[BackendConfig] = field(default_factory=list)  # same id, another engine or URL: drain + start
    updated: list[BackendConfig] = field(default_factory=list)  # same engine, other models/classes/weight
    restart_needed: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"added": [b.id for b in self.added], "removed": self.removed,
                "replaced": [b.id for b in self.replaced], "updated": [b.id for b in self.updated],
                "restart_needed": self.restart_needed}


def plan(old: GatewayConfig, new: GatewayConfig) -> ReloadPlan:
    p = ReloadPlan()
    before = {b.id: b for b in old.backends}
    for bc in new.backends:
        o = before.get(bc.id)
        if o is None:
            p.added.append(bc)
        elif any(getattr(o, k) != getattr(bc, k) for k in IDENTITY):
            p.replaced.append(bc)
        elif o != bc:
            p.updated.append(bc)
    keep = {b.id for b in new.backends}
    p.removed = [i for i in before if i not in keep]
    for section, key in RESTART_ONLY:
        a, b = getattr(old, section), getattr(new, section)
        if (a != b) if key is None else (getattr(a, key) != getattr(b, key)):
            p.restart_needed.append(section if key is None else f"{section}.{key}")
    return p


def held_at_run_time(g, new: GatewayConfig) -> None:
    """ConfigError when a configured key's id is one a run-time key holds: the two would answer to one id, and
    the run-time key could no longer be revoked by it. The reload is refused (the running configuration stays)
    rather than the run-time key revoked behind its owner's back: the operator revokes it, or picks another id."""
    held = sorted({k.id for k in new.auth.keys} & g.keys.records.keys())
    if held:
        raise ConfigError(f"[[auth.keys]] id(s) {', '.join(map(repr, held))} are held by run-time keys (POST "
                          "/admin/keys): revoke those first (DELETE /admin/keys/<id>) or give the configured keys "
                          "other ids")


def apply(g, new: GatewayConfig) -> ReloadPlan:
    """Build everything the new config needs, then swap it in with no await in between."""
    held_at_run_time(g, new)
    p = plan(g.cfg, new)
    auth = Authenticator(new.auth, g.keys)  # the run-time keys belong to the gateway: they stay
    # Unchanged routing keeps the policies and what they learned.
    routing = build_routing(new) if new.routing != g.cfg.routing else (g.default_policy, g.model_policies)
    old_cfg = g.cfg
    g.cfg = new  # adapters take their timeouts from g.cfg
    try:
        fresh = [g.make_backend(bc) for bc in (*p.added, *p.replaced)]
    except Exception:
        g.cfg = old_cfg  # nothing else was touched yet
        raise
    g.auth = auth
    g.experiments = Experiments(new.experiments, previous=g.experiments)  # same experiments keep their samples
    g.set_routing(*routing)
    g.access_log.enabled = new.server.access_log
    pool = g.pool
    for backend_id in (*p.removed, *(bc.id for bc in p.replaced)):
        pool.drain(backend_id)  # in-flight requests finish; no new ones
        g.affinity_index.forget_backend(backend_id)  # its cached prefixes are gone (a replacement starts cold)
    for b in fresh:
        pool.add(b)  # starts in "starting": the probe loop picks it up within a tick
    for bc in p.updated:
        b = pool.remove(bc.id)
        if b is not None:
            b.reconfigure(bc)
            pool.add(b)
    for b in pool.all():
        b.apply_settings(new)
    return p


class Reloader:
    """Reloads one gateway from its configuration file."""

    def __init__(self, g, path: str | Path | None) -> None:
        self.g = g
        self.path = Path(path) if path is not None else None

    def reload(self) -> dict:
        """Raises ConfigError (and keeps the running configuration) when the file is not valid."""
        if self.path is None:
            raise ConfigError("the gateway was started without a configuration file")
        # A few kilobytes from local disk, read on an operator's action: not worth a thread.
        try:
            new = load_config(self.path, build_policy)
            p = apply(self.g, new)
        except ConfigError as e:
            self.g.metrics.reload("refused")
            log.error("configuration reload refused, the running configuration stays: %s", e)
            raise
        self.g.metrics.reload("ok")
        s = p.summary()
        log.info("configuration reloaded from %s: %s", self.path, s)
        if p.restart_needed:
            log.warning("changed settings that take effect only after a restart: %s", ", ".join(p.restart_needed))
        return s

    def on_signal(self) -> None:
        """SIGHUP: reload, or log why not; a signal has nobody to answer to."""
        try:
            self.reload()
        except ConfigError:
            pass  # already logged with the reason; the old configuration keeps running


RELOADER: web.AppKey[Reloader] = web.AppKey("reloader", Reloader)


async def admin_reload(request: web.Request) -> web.Response:
    """POST /admin/reload (admin key): 200 with what changed, or 400 with why the file was refused."""
    request.app[GATEWAY].auth.require_admin(request.headers)
    try:
        summary = request.app[RELOADER].reload()
    except ConfigError as e:
        raise GatewayError(400, str(e), code="invalid_config") from None
    return web.Response(body=orjson.dumps({"reloaded": True, **summary}), content_type="application/json")
