"""Dashboard HTTP routes: admin sign-in, signed session cookie, the static page and its JSON feed."""

from __future__ import annotations

import html
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import orjson
from aiohttp import web

from gateway.dashboard.history import FeedHistory
from gateway.dashboard.session import Binding, bound_secret, check_secret, issue_token, verify_bound_token, verify_token
from gateway.dashboard.throttle import SignInThrottle
from gateway.errors import GatewayError

log = logging.getLogger(__name__)

COOKIE_NAME = "shapegate_dash"
DEFAULT_SESSION_TTL_S = 12 * 3600.0
STATIC_DIR = Path(__file__).parent / "static"

StatsProvider = Callable[[], Awaitable[dict[str, Any]] | dict[str, Any]]
# The usage view's report for the page's query (its `days`); a GatewayError answers with its own status.
UsageProvider = Callable[[Mapping[str, str]], Awaitable[dict[str, Any]]]

_CONTENT_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
}
# The page is all same-origin and script-built; nothing inline or remote may run in it.
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
_ERROR_MARK = b"<!--login-error-->"


@dataclass(frozen=True)
class DashboardSettings:
    admin_for_key: Callable[[str], str | None]
    secret: bytes
    stats_provider: StatsProvider
    secure_cookie: bool
    ttl_s: float
    clock: Callable[[], float]
    assets: Mapping[str, tuple[bytes, str]]
    binding: Binding | None  # None: any token signed with `secret` holds until it expires
    peer_header: str | None  # where the host's front puts the client's address; None: the socket's peer
    throttle: SignInThrottle
    history: FeedHistory | None  # the charts' recent past (sampled by the host on a timer); None: none kept
    keys_provider: StatsProvider | None  # the keys view's report; None: no keys view
    usage_provider: UsageProvider | None = None  # the usage view over days; None: no usage view


DASHBOARD = web.AppKey("shapegate_dashboard", DashboardSettings)


def setup_dashboard(
    app: web.Application,
    *,
    admin_for_key: Callable[[str], str | None],
    session_secret: bytes,
    stats_provider: StatsProvider,
    secure_cookie: bool = True,
    session_ttl_s: float = DEFAULT_SESSION_TTL_S,
    clock: Callable[[], float] = time.time,
    wrap: Callable[[Callable], Callable] = lambda handler: handler,
    session_binding: Binding | None = None,
    peer_header: str | None = None,
    throttle: SignInThrottle | None = None,
    history: FeedHistory | None = None,
    keys_provider: StatsProvider | None = None,
    usage_provider: UsageProvider | None = None,
) -> None:
    """Register /dashboard, /dashboard/{login,logout,feed,history,keys} and /dashboard/static/{file}.

    An admin is a request whose `Authorization: Bearer` or `x-api-key` key maps to a principal
    through `admin_for_key`, or one carrying a valid `shapegate_dash` session cookie. Anyone else
    asking for /dashboard gets the sign-in form (200) when the client accepts text/html, and a 401
    in OpenAI error shape otherwise; /dashboard/feed always answers 401 to them.

    `stats_provider` returns the feed dict, sync or async; its failure is a 503, not a traceback.
    `secure_cookie` must stay True whenever the gateway is reached over TLS; only a plain-HTTP
    loopback listener (tests, local use) may turn it off, since browsers drop Secure cookies there.
    Sessions are stateless: signing out clears the browser's copy, rotating the secret ends them all.
    With `session_binding` a session is signed for the key that opened it and checked against the live keys on
    every request (session.py): revoking that key, or its admin flag, ends the session at once.
    `wrap` is applied to every handler (the host application's request id and error handling).
    Failed sign-ins are throttled per client address (`peer_header`, set by the host's front, or the socket's
    peer): 429 with Retry-After once an address has used up its attempts (throttle.py).
    /dashboard/history serves `history` (the host samples the feed into it on a timer, never per request), so
    that the charts start filled; /dashboard/keys serves `keys_provider`'s report, /dashboard/usage?days=N
    `usage_provider`'s. All as admin-only as the feed.
    """
    check_secret(session_secret)
    if session_ttl_s <= 0:
        raise ValueError("session_ttl_s must be positive")
    app[DASHBOARD] = DashboardSettings(
        admin_for_key=admin_for_key,
        secret=session_secret,
        stats_provider=stats_provider,
        secure_cookie=secure_cookie,
        ttl_s=session_ttl_s,
        clock=clock,
        assets=_load_assets(STATIC_DIR),
        binding=session_binding,
        peer_header=peer_header,
        throttle=throttle or SignInThrottle(),
        history=history,
        keys_provider=keys_provider,
        usage_provider=usage_provider,
    )
    app.router.add_get("/dashboard", wrap(_page))
    app.router.add_post("/dashboard/login", wrap(_login))
    app.router.add_post("/dashboard/logout", wrap(_logout))
    app.router.add_get("/dashboard/feed", wrap(_feed))
    app.router.add_get("/dashboard/history", wrap(_history))
    app.router.add_get("/dashboard/keys", wrap(_keys))
    app.router.add_get("/dashboard/usage", wrap(_usage))
    app.router.add_get("/dashboard/static/{file}", wrap(_static))


def session_principal(request: web.Request, secret: bytes, *, now: float | None = None,
                      binding: Binding | None = None) -> str | None:
    """Admin principal carried by the request's dashboard cookie, if validly signed and unexpired (and, with
    `binding`, signed for a key that is still a live admin key)."""
    token, at = request.cookies.get(COOKIE_NAME), time.time() if now is None else now
    if binding is None:
        return verify_token(token, secret, now=at)
    return verify_bound_token(token, secret, binding, now=at)


def _load_assets(folder: Path) -> Mapping[str, tuple[bytes, str]]:
    # Read once at build time: a handful of small files, served from memory with no path
    # handling at request time, so no request can name anything outside this set.
    assets = {
        path.name: (path.read_bytes(), _CONTENT_TYPES[path.suffix])
        for path in folder.iterdir()
        if path.is_file() and path.suffix in _CONTENT_TYPES
    }
    for needed in ("index.html", "login.html", "charts.js", "dashboard.js", "experiments.js", "keys.js",
                   "usage.js", "dashboard.css"):
        if needed not in assets:
            raise RuntimeError(f"dashboard asset missing: {needed}")
    return MappingProxyType(assets)


def _header_key(request: web.Request) -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("x-api-key", "").strip() or None


def _principal(request: web.Request, settings: DashboardSettings) -> str | None:
    key = _header_key(request)
    if key is not None:
        principal = settings.admin_for_key(key)
        if principal:
            return principal
    return session_principal(request, settings.secret, now=settings.clock(), binding=settings.binding)


def _error(status: int, message: str, err_type: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return web.Response(
        status=status,
        body=orjson.dumps(body),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def _unauthorized() -> web.Response:
    return _error(
        401,
        "The dashboard needs an admin API key (Authorization: Bearer or x-api-key) or a session.",
        "authentication_error",
        "invalid_api_key",
    )


def _html(body: bytes, status: int = 200) -> web.Response:
    return web.Response(
        status=status,
        body=body,
        content_type="text/html",
        charset="utf-8",
        headers={**_SECURITY_HEADERS, "Cache-Control": "no-store"},
    )


def _login_page(settings: DashboardSettings, *, status: int, error: str | None) -> web.Response:
    body, _ = settings.assets["login.html"]
    if error:
        notice = f'<p class="login-error" role="alert" data-testid="login-error">{html.escape(error)}</p>'
        body = body.replace(_ERROR_MARK, notice.encode())
    return _html(body, status)


async def _page(request: web.Request) -> web.Response:
    settings = request.app[DASHBOARD]
    if _principal(request, settings):
        return _html(settings.assets["index.html"][0])
    # Browsers get the sign-in form; API clients get a machine-readable 401.
    if "text/html" in request.headers.get("Accept", ""):
        return _login_page(settings, status=200, error=None)
    return _unauthorized()


def _client_address(request: web.Request, settings: DashboardSettings) -> str:
    if settings.peer_header is not None:
        return request.headers.get(settings.peer_header, "")
    return request.remote or ""


def _throttled(request: web.Request, settings: DashboardSettings, wait_s: float) -> web.Response:
    seconds = max(1, math.ceil(wait_s))
    message = f"Too many sign-in attempts from this address; try again in {seconds} s."
    if "text/html" in request.headers.get("Accept", ""):
        response = _login_page(settings, status=429, error=message)
    else:
        response = _error(429, message, "rate_limit_error", "rate_limit_exceeded")
    response.headers["Retry-After"] = str(seconds)
    return response


async def _login(request: web.Request) -> web.Response:
    settings = request.app[DASHBOARD]
    address = _client_address(request, settings)
    wait_s = settings.throttle.retry_after(address)
    if wait_s > 0:  # before the key is even read: a throttled guess learns nothing
        return _throttled(request, settings, wait_s)
    form = await request.post()
    key = form.get("key")
    key = key.strip() if isinstance(key, str) else ""
    principal = settings.admin_for_key(key) if key else None
    secret: bytes | None = settings.secret
    if principal and settings.binding is not None:
        bound = settings.binding(principal)
        secret = bound_secret(settings.secret, bound) if bound is not None else None
    if not principal or secret is None:
        settings.throttle.failed(address)
        return _login_page(settings, status=401, error="That key is not an admin key.")
    token = issue_token(principal, secret, now=settings.clock(), ttl_s=settings.ttl_s)
    response = web.Response(status=303, headers={"Location": "/dashboard", "Cache-Control": "no-store"})
    response.set_cookie(
        COOKIE_NAME,
        token,
        max_age=int(settings.ttl_s),
        path="/",
        httponly=True,
        samesite="Strict",
        secure=settings.secure_cookie,
    )
    return response


async def _logout(request: web.Request) -> web.Response:
    # Tokens are stateless: this clears the browser's copy; rotating session_secret revokes all.
    settings = request.app[DASHBOARD]
    response = web.Response(status=303, headers={"Location": "/dashboard", "Cache-Control": "no-store"})
    response.del_cookie(
        COOKIE_NAME, path="/", httponly=True, samesite="Strict", secure=settings.secure_cookie
    )
    return response


async def _provided(request: web.Request, provider: StatsProvider | None, what: str) -> web.Response:
    """An admin's JSON from `provider` (sync or async); 404 when the host gave none, 503 when it fails."""
    settings = request.app[DASHBOARD]
    if not _principal(request, settings):
        return _unauthorized()
    if provider is None:
        return _error(404, "Not served by this gateway.", "invalid_request_error", "not_found")
    try:
        data = provider()
        if inspect.isawaitable(data):
            data = await data
        body = orjson.dumps(data)
    except GatewayError as e:  # the provider's own answer (a bad query, a store that does not answer)
        return web.Response(status=e.status, body=e.body(), content_type="application/json",
                            headers={"Cache-Control": "no-store"})
    except Exception:
        # The page shows the feed as stale (or its charts' past, or keys, missing); the traceback goes to the
        # log, not to the browser.
        log.exception("dashboard: %s unavailable", what)
        return _error(503, f"{what.capitalize()} unavailable right now.", "server_error", "stats_unavailable")
    return web.Response(
        body=body, content_type="application/json", headers={"Cache-Control": "no-store"}
    )


async def _feed(request: web.Request) -> web.Response:
    return await _provided(request, request.app[DASHBOARD].stats_provider, "stats are")


async def _history(request: web.Request) -> web.Response:
    history = request.app[DASHBOARD].history
    return await _provided(request, None if history is None else history.report, "the charts' history is")


async def _keys(request: web.Request) -> web.Response:
    return await _provided(request, request.app[DASHBOARD].keys_provider, "the keys view is")


async def _usage(request: web.Request) -> web.Response:
    provider = request.app[DASHBOARD].usage_provider
    query = request.query
    return await _provided(request, None if provider is None else lambda: provider(query), "the usage view is")


async def _static(request: web.Request) -> web.Response:
    asset = request.app[DASHBOARD].assets.get(request.match_info["file"])
    if asset is None:
        return _error(404, "No such dashboard asset.", "invalid_request_error", "not_found")
    body, content_type = asset
    return web.Response(
        body=body,
        content_type=content_type,
        charset="utf-8",
        headers={**_SECURITY_HEADERS, "Cache-Control": "no-cache"},
    )
