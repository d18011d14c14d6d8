"""POST /admin/keys (make a key, shown once), GET /admin/keys (list them), DELETE /admin/keys/{id} (revoke)."""

from __future__ import annotations

import logging

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.config import KeyLimits
from gateway.errors import GatewayError, bad_request
from gateway.keys.keystore import (
    ID_PATTERN,
    KeyExists,
    KeyNotFound,
    KeyRecord,
    StoreUnavailable,
)
from gateway.routing.request import GATEWAY
from gateway.runtime import Gateway

log = logging.getLogger("shapegate.keys")
# The reply to POST holds the only copy of the key: no cache along the way may keep it.
NO_STORE = {"Cache-Control": "no-store"}


class NewKey(BaseModel):
    """The body of POST /admin/keys; every field optional."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str | None = Field(None, pattern=ID_PATTERN)  # generated when absent
    admin: bool = False
    limits: KeyLimits | None = None  # None: the [limits] defaults


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
            msg = "unknown field; expected id, admin, limits (rpm, tpm, models)"
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


async def create_key(request: web.Request) -> web.Response:
    g: Gateway = request.app[GATEWAY]
    g.auth.require_admin(request.headers)
    spec = parse_new_key(await request.read())
    try:
        key, rec = await g.keys.create(spec.id, spec.admin, spec.limits, taken=_config_ids(g))
    except KeyExists:
        raise GatewayError(409, f"A key with id {spec.id or '(generated)'!r} exists already; choose another id "
                           "or revoke it first.",
                           param="id", code="key_exists") from None
    except StoreUnavailable as e:
        raise unavailable(e) from None
    log.info("API key %s created (admin: %s, store: %s)", rec.id, rec.admin, g.keys.kind)
    return _json({"object": "api_key", "key": key, **_listed(rec, None)}, 201, NO_STORE)


def _listed(rec: KeyRecord, last_used: float | None) -> dict:
    return {"id": rec.id, "admin": rec.admin, "limits": rec.limits.model_dump() if rec.limits else None,
            "created": rec.created, "last_used": last_used, "source": "runtime"}


async def list_keys(request: web.Request) -> web.Response:
    """Every key's id, admin flag, limits, when it was made and last used; never a key or a digest."""
    g: Gateway = request.app[GATEWAY]
    g.auth.require_admin(request.headers)
    used = {k: round(t, 3) for k, t in (await g.keys.last_used()).items()}
    data = [{"id": k.id, "admin": k.admin, "limits": k.limits.model_dump() if k.limits else None,
             "created": None, "last_used": used.get(k.id), "source": "config"} for k in g.cfg.auth.keys]
    data += [_listed(r, used.get(r.id)) for r in sorted(g.keys.records.values(), key=lambda r: (r.created, r.id))]
    return _json({"object": "list", "data": data, "store": g.keys.kind})


async def revoke_key(request: web.Request) -> web.Response:
    g: Gateway = request.app[GATEWAY]
    g.auth.require_admin(request.headers)
    key_id = request.match_info["id"]
    if key_id in _config_ids(g):
        raise GatewayError(409, f"Key {key_id!r} comes from the configuration file and is read-only here: remove "
                           "it from [[auth.keys]] and reload.", param="id", code="key_in_config")
    try:
        await g.keys.revoke(key_id)
    except KeyNotFound:
        raise GatewayError(404, f"No run-time key has id {key_id[:64]!r}.", param="id", code="key_not_found") \
            from None
    except StoreUnavailable as e:
        raise unavailable(e) from None
    log.info("API key %s revoked (store: %s)", key_id, g.keys.kind)
    return _json({"object": "api_key", "id": key_id, "deleted": True})
