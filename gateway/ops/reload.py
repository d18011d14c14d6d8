"""Config reload (SIGHUP, POST /admin/reload): re-read the TOML, validate it all, swap it in at once."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from aiohttp import web

from gateway.config import BackendConfig, ConfigError, GatewayConfig, RoutingConfig, load_config
from gateway.errors import GatewayError
from gateway.experiments.experiment import Experiments
from gateway.keys.auth import Authenticator
from gateway.keys.keystore import with_default_keys_file
from gateway.runtime import GATEWAY, build_policy, build_routing

log = logging.getLogger("shapegate.reload")

# Settings baked into objects made at start-up (listening socket, connection pools, state store):
# a reload keeps the running values and says a restart is needed for them.
RESTART_ONLY = (("server", "host"), ("server", "port"), ("server", "shutdown_grace_s"),
                ("upstream", "connect_timeout_s"), ("upstream", "idle_timeout_s"), ("upstream", "pool_limit"),
                ("upstream", "pool_limit_per_backend"), ("upstream", "keepalive_s"), ("state", None),
                ("auth", "keys_file"), ("usage", "enabled"), ("observe", None))
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


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _by_name(verbs: tuple[tuple[str, list[str]], ...]) -> str:
    """"added a and b, removed c" for the verbs that have names."""
    return ", ".join(f"{verb} {_and(names)}" for verb, names in verbs if names)


def _compared(old: dict, new: dict) -> tuple[list[str], list[str], list[str]]:
    """The names only in new, only in old, and in both but different."""
    return ([n for n in new if n not in old], [n for n in old if n not in new],
            [n for n in new if n in old and old[n] != new[n]])


def _routing_words(old: RoutingConfig, new: RoutingConfig) -> list[str]:
    words = []
    if old.policy != new.policy:
        words.append(f"policy {old.policy} -> {new.policy}")
    elif old.params != new.params:
        words.append(f"policy {new.policy}'s params changed")
    for model in dict.fromkeys((*old.models, *new.models)):
        a, b = old.models.get(model), new.models.get(model)
        was, now = (a.policy if a else None) or "default", (b.policy if b else None) or "default"
        if was != now:
            words.append(f"model {model} policy {was} -> {now}")
        elif a != b:
            words.append(f"model {model} routing params changed")
    if (old.max_attempts, old.retry_deadline_s) != (new.max_attempts, new.retry_deadline_s):
        words.append("failover settings changed")
    return words


def in_words(old: GatewayConfig, new: GatewayConfig, p: ReloadPlan) -> str:
    """What a reload changed, for its log line: "backends added a, removed b; policy shape -> least_loaded;
    2 keys added" (ReloadPlan.summary() is the same for the admin route, as data)."""
    parts = []
    backends = _by_name((("added", [b.id for b in p.added]), ("removed", p.removed),
                         ("replaced", [b.id for b in p.replaced]), ("updated", [b.id for b in p.updated])))
    if backends:
        parts.append(f"backends {backends}")
    parts += _routing_words(old.routing, new.routing)
    # The configured keys counted, not named (as /admin/keys would): "2 keys added, 1 removed".
    keys = [(verb, len(ids)) for verb, ids in zip(("added", "removed", "changed"), _compared(
        {k.id: k for k in old.auth.keys}, {k.id: k for k in new.auth.keys})) if ids]
    if keys:
        (verb, n), rest = keys[0], keys[1:]
        parts.append(", ".join([f"{n} key{'' if n == 1 else 's'} {verb}", *(f"{m} {v}" for v, m in rest)]))
    experiments = _by_name(tuple(zip(("added", "removed", "changed"), _compared(
        {x.name: x for x in old.experiments}, {x.name: x for x in new.experiments}))))
    if experiments:
        parts.append(f"experiments {experiments}")
    others = [name for name in GatewayConfig.model_fields if name not in ("backends", "routing", "experiments", "auth")
              and getattr(old, name) != getattr(new, name)]
    if old.auth.model_copy(update={"keys": ()}) != new.auth.model_copy(update={"keys": ()}):
        others.insert(0, "auth")
    if others:
        parts.append("also " + ", ".join(f"[{name}]" for name in others))
    return "; ".join(parts) or "no changes"


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
    g.queue.wake()  # new seats, shares or backends (or the queue off): the waiting requests are looked at again
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
        old = self.g.cfg
        try:
            new = with_default_keys_file(old, load_config(self.path, build_policy), str(self.path))
            p = apply(self.g, new)
        except ConfigError as e:
            self.g.metrics.reload("refused")
            log.error("configuration reload refused, the running configuration stays: %s", e)
            raise
        self.g.metrics.reload("ok")
        s = p.summary()
        log.info("configuration reloaded from %s: %s", self.path, in_words(old, new, p))
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
