"""POST /admin/keys (make a key, shown once), GET /admin/keys (list them), DELETE /admin/keys/{id} (revoke);
and what ties a dashboard session to a live admin key."""

from __future__ import annotations

import logging
import re

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.config import KeyLimits
from gateway.config_queue import Priority
from gateway.errors import GatewayError, bad_request
from gateway.keys.keystore import ID_PATTERN, KeyExists, KeyNotFound, KeyRecord, StoreUnavailable
from gateway.keys.principal import hash_key
from gateway.keys.storage import MAX_RUNTIME_KEYS, TooManyKeys
from gateway.runtime import GATEWAY, Gateway

log = logging.getLogger("shapegate.keys")
# The reply to POST holds the only copy of the key: no cache along the way may keep it.
NO_STORE = {"Cache-Control": "no-store"}
# What `shapegate keys new` and POST /admin/keys make (gateway/keys/principal.py new_key): never an id.
GENERATED_KEY = re.compile(r"sg-[A-Za-z0-9_-]{43}")


class NewKey(BaseModel):
    """The body of POST /admin/keys; every field optional."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str | None = Field(None, pattern=ID_PATTERN)  # generated when absent
    admin: bool = False
    limits: KeyLimits | None = None  # None: the [limits] defaults
    priority: Priority | None = None  # where its requests wait in the queue; None: by each request's class
    priority_header: bool = False  # its requests may set their own priority (x-shapegate-priority)


def parse_new_key(raw: bytes) -> NewKey:
    """The request, checked strictly (no "5" for 5, no unknown fields); a 400 naming the field if not."""
    try:
        return NewKey.model_validate_json(raw if raw.strip() else b"{}", strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise bad_request("The request body is not valid JSON.", code="invalid_json") from None
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            msg = ("unknown field; expected id, admin, limits (rpm, tpm, tokens_per_day, tokens_per_month, models), "
                   "priority, priority_header")
        elif err["type"] == "string_pattern_mismatch":
            msg = "must be 1-64 characters (letters, digits, `_`, `.`, `:`, `-`)"
        else:
            msg = err["msg"]
        # The path is cut short: a client's own text is never echoed at length.
        where = f"{param[:100]}: " if param else ""
        raise bad_request(f"Invalid key request: {where}{msg}.", param=param[:100] if param else None,
                          code="invalid_value") from None


def unavailable(e: StoreUnavailable) -> GatewayError:
    log.error("API key store unavailable, nothing changed: %s", e)
    return GatewayError(503, "The key store cannot be reached; nothing was changed. Retry shortly.",
                        code="key_store_unavailable", headers={"Retry-After": "1"})


def _json(data: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json", headers=headers)


def _config_ids(g: Gateway) -> frozenset[str]:
    return frozenset(k.id for k in g.cfg.auth.keys)


def refuse_key_as_id(g: Gateway, text: str | None) -> None:
    """A 400 that neither echoes nor logs `text` when it is an API key (one of ours, or shaped like the ones the
    gateway makes) given where an id belongs: ids are shown in logs, listings, URLs and error messages."""
    if text is None:
        return
    if GENERATED_KEY.fullmatch(text) is None:
        digest = hash_key(text)
        if digest not in g.keys.by_digest and all(k.sha256 != digest for k in g.cfg.auth.keys):
            return
    log.warning("an API key was given where a key id belongs; refused (the key is not logged)")
    raise GatewayError(400, "That is an API key, not a key id: it was neither kept nor logged. Give the key's id "
                       "(GET /admin/keys lists them); if the key has been seen by others, revoke it.",
                       param="id", code="key_given_as_id")


def admin_binding(g: Gateway, principal_id: str) -> bytes | None:
    """What a dashboard session of `principal_id` is bound to (gateway/dashboard/session.py): the digest of its
    admin key, looked up afresh in the running configuration and the run-time keys; None when there is no such
    key now (revoked, no longer admin, or an id both the configuration and a run-time key hold)."""
    if not g.cfg.auth.enabled:
        return b"auth-disabled"  # every request is admin; such a session ends when auth is turned on
    runtime = g.keys.records.get(principal_id)
    configured = next((k for k in g.cfg.auth.keys if k.id == principal_id), None)
    if (runtime is None) == (configured is None):
        return None
    key = configured if configured is not None else runtime
    return key.sha256.encode() if key is not None and key.admin else None


async def create_key(request: web.Request) -> web.Response:
    g: Gateway = request.app[GATEWAY]
    g.auth.require_admin(request.headers)
    spec = parse_new_key(await request.read())
    refuse_key_as_id(g, spec.id)
    try:
        key, rec = await g.keys.create(spec.id, spec.admin, spec.limits, taken=_config_ids(g), priority=spec.priority,
                                       priority_header=spec.priority_header)
    except KeyExists:
        raise GatewayError(409, f"A key with id {spec.id or '(generated)'!r} exists already; choose another id "
                           "or revoke it first.",
                           param="id", code="key_exists") from None
    except TooManyKeys:
        raise GatewayError(409, f"The key store holds {MAX_RUNTIME_KEYS} run-time keys, the most it takes; revoke "
                           "keys no longer used first.", code="too_many_keys") from None
    except StoreUnavailable as e:
        raise unavailable(e) from None
    log.info("API key %s created (admin: %s, store: %s)", rec.id, rec.admin, g.keys.kind)
    return _json({"object": "api_key", "key": key, **_listed(rec, None)}, 201, NO_STORE)


def _listed(rec: KeyRecord, last_used: float | None) -> dict:
    return {"id": rec.id, "admin": rec.admin, "limits": rec.limits.model_dump() if rec.limits else None,
            "priority": rec.priority, "priority_header": rec.priority_header, "created": rec.created,
            "last_used": last_used, "source": "runtime"}


async def key_listing(g: Gateway) -> list[dict]:
    """Every key's id, admin flag, limits, when it was made and last used, and its token quotas with what they
    used this day and month (its own, or the [limits] defaults it falls back on); never a key or a digest."""
    used = {k: round(t, 3) for k, t in (await g.keys.last_used()).items()}
    data = [{"id": k.id, "admin": k.admin, "limits": k.limits.model_dump() if k.limits else None,
             "priority": k.priority, "priority_header": k.priority_header, "created": None,
             "last_used": used.get(k.id), "source": "config"} for k in g.cfg.auth.keys]
    data += [_listed(r, used.get(r.id)) for r in sorted(g.keys.records.values(), key=lambda r: (r.created, r.id))]
    limits = {k.id: k.limits for k in g.cfg.auth.keys} | {r.id: r.limits for r in g.keys.records.values()}
    quotas = await g.limiter.quota_report([(kid, own if own is not None else g.hot.limits)
                                           for kid, own in limits.items()])
    for row in data:
        row["quotas"] = quotas.get(row["id"], [])
    return data


async def list_keys(request: web.Request) -> web.Response:
    """GET /admin/keys: key_listing, for an admin key."""
    g: Gateway = request.app[GATEWAY]
    g.auth.require_admin(request.headers)
    return _json({"object": "list", "data": await key_listing(g), "store": g.keys.kind})


async def revoke_key(request: web.Request) -> web.Response:
    g: Gateway = request.app[GATEWAY]
    g.auth.require_admin(request.headers)
    key_id = request.match_info["id"]
    refuse_key_as_id(g, key_id)
    # A run-time key always can be revoked, even under an id the configuration also holds (a replica whose
    # configuration differs made it): only a configured key alone is read-only here.
    configured = key_id in _config_ids(g)
    if configured and key_id not in g.keys.records:
        raise GatewayError(409, f"Key {key_id!r} comes from the configuration file and is read-only here: remove "
                           "it from [[auth.keys]] and reload.", param="id", code="key_in_config")
    try:
        await g.keys.revoke(key_id)
    except KeyNotFound:
        raise GatewayError(404, f"No run-time key has id {key_id[:64]!r}.", param="id", code="key_not_found") \
            from None
    except StoreUnavailable as e:
        raise unavailable(e) from None
    log.info("API key %s revoked (store: %s)%s", key_id, g.keys.kind,
             "; the configured key of that id stays" if configured else "")
    return _json({"object": "api_key", "id": key_id, "deleted": True})
