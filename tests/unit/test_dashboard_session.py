"""Dashboard sessions: signed tokens, expiry, tampering, and the sign-in routes that issue them."""

from __future__ import annotations

import base64
import hmac
from collections.abc import AsyncIterator
from http.cookies import SimpleCookie

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from gateway.dashboard import COOKIE_NAME, session_principal, setup_dashboard
from gateway.dashboard.routes import DASHBOARD
from gateway.dashboard.session import issue_token, verify_token

SECRET = b"unit-test-secret-0123456789abcdef"
OTHER = b"another-secret-0123456789abcdef!"
ADMIN_KEY = "sk-admin-9c2e4f6a8b0d1e3f5a7c"
USER_KEY = "sk-user-1a3c5e7f9b2d4f6a8c0e"
NOW = 1_764_460_000.0


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _forged(payload: dict, secret: bytes = OTHER) -> str:
    body = _b64(orjson.dumps(payload))
    sig = hmac.new(secret, b"shapegate-dash-v1." + body.encode(), "sha256").digest()
    return f"{body}.{_b64(sig)}"


def _flip(text: str, i: int) -> str:
    return text[:i] + ("A" if text[i] != "A" else "B") + text[i + 1 :]


def test_round_trip_returns_the_principal() -> None:
    token = issue_token("admin-1", SECRET, now=NOW, ttl_s=3600)
    assert verify_token(token, SECRET, now=NOW) == "admin-1"
    assert verify_token(token, SECRET, now=NOW + 3599) == "admin-1"


@pytest.mark.parametrize(("offset", "ok"), [(-10, True), (0, True), (3599.0, True), (3600, False), (10**6, False)])
def test_expiry(offset: float, ok: bool) -> None:
    token = issue_token("admin-1", SECRET, now=NOW, ttl_s=3600)
    assert (verify_token(token, SECRET, now=NOW + offset) == "admin-1") is ok


GOOD = issue_token("admin-1", SECRET, now=NOW, ttl_s=3600)
BODY, SIG = GOOD.split(".")


@pytest.mark.parametrize(
    "token",
    [
        None,
        "",
        "no-dot-at-all",
        GOOD + ".extra",
        f"{_flip(BODY, 3)}.{SIG}",  # payload changed
        f"{BODY}.{_flip(SIG, 5)}",  # signature changed
        f"{BODY}.{SIG}A",  # a second spelling of the signature
        f"{BODY}.",
        f".{SIG}",
        f"{_b64(orjson.dumps({'p': 'admin-1', 'exp': int(NOW) + 10**6}))}.{SIG}",  # longer expiry, old MAC
        _forged({"p": "admin-1", "exp": int(NOW) + 3600}),  # signed with another secret
        f"{BODY}.{SIG}=",  # padded: also a second spelling
        f"{BODY}.{SIG.replace('-', '+').replace('_', '/')}" if set(SIG) & {"-", "_"} else f"{BODY}.{SIG[:-1]}",
        _forged(["admin-1"], SECRET),  # valid MAC, wrong payload shape
        _forged({"p": "", "exp": int(NOW) + 3600}, SECRET),
        _forged({"p": "admin-1", "exp": "never"}, SECRET),
        _forged({"p": "admin-1"}, SECRET),
        f"{BODY}.{SIG}é",
        "x" * 5000,
    ],
)
def test_tampered_or_malformed_tokens_are_rejected(token: str | None) -> None:
    assert verify_token(token, SECRET, now=NOW) is None


def test_a_well_formed_token_signed_here_is_accepted() -> None:
    # Guards the table above: the forging helper matches the real format.
    assert verify_token(_forged({"p": "admin-1", "exp": int(NOW) + 60}, SECRET), SECRET, now=NOW) == "admin-1"


@pytest.mark.parametrize("secret", [b"", b"short", "a-str-secret-0123456789"])
def test_weak_secrets_are_refused(secret) -> None:
    with pytest.raises(ValueError):
        issue_token("admin-1", secret, now=NOW, ttl_s=60)
    with pytest.raises(ValueError):
        setup_dashboard(web.Application(), admin_for_key=lambda k: None, session_secret=secret,
                        stats_provider=dict)


def test_session_principal_reads_the_cookie() -> None:
    token = issue_token("admin-1", SECRET, now=NOW, ttl_s=60)
    request = make_mocked_request("GET", "/stats", headers={"Cookie": f"{COOKIE_NAME}={token}"})
    assert session_principal(request, SECRET, now=NOW) == "admin-1"
    assert session_principal(request, OTHER, now=NOW) is None
    assert session_principal(request, SECRET, now=NOW + 61) is None
    assert session_principal(make_mocked_request("GET", "/stats"), SECRET) is None


def _admin_for_key(key: str) -> str | None:
    return "admin-1" if hmac.compare_digest(key.encode(), ADMIN_KEY.encode()) else None


@pytest.fixture(params=[False, True], ids=["plain", "secure"])
async def client(request) -> AsyncIterator[TestClient]:
    app = web.Application()
    setup_dashboard(app, admin_for_key=_admin_for_key, session_secret=SECRET,
                    stats_provider=lambda: {"now": 1.0, "backends": []}, secure_cookie=request.param)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        yield c


async def test_login_sets_a_signed_cookie_that_never_carries_the_key(client: TestClient) -> None:
    resp = await client.post("/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False)
    assert resp.status == 303 and resp.headers["Location"] == "/dashboard"
    raw = resp.headers.getall("Set-Cookie")
    assert len(raw) == 1
    header = raw[0]
    for encoded in (ADMIN_KEY, _b64(ADMIN_KEY.encode()), base64.b64encode(ADMIN_KEY.encode()).decode(),
                    ADMIN_KEY[-12:]):
        assert encoded not in header
    morsel = SimpleCookie(header)[COOKIE_NAME]
    body = morsel.value.split(".")[0]
    assert orjson.loads(base64.urlsafe_b64decode(body + "==")).keys() == {"p", "exp"}
    assert morsel["httponly"] is True
    assert morsel["samesite"] == "Strict"
    assert morsel["path"] == "/"
    assert bool(morsel["secure"]) is client.server.app[DASHBOARD].secure_cookie


async def test_wrong_key_reshows_the_form_with_401(client: TestClient) -> None:
    for key in (USER_KEY, "", ADMIN_KEY + "x"):
        resp = await client.post("/dashboard/login", data={"key": key}, allow_redirects=False)
        assert resp.status == 401
        assert "Set-Cookie" not in resp.headers
        text = await resp.text()
        assert 'data-testid="login-error"' in text and 'name="key"' in text


async def _error_of(resp) -> dict:
    assert resp.content_type == "application/json"
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


async def test_page_and_feed_need_an_admin(client: TestClient) -> None:
    html = await client.get("/dashboard", headers={"Accept": "text/html"})
    assert html.status == 200 and 'action="/dashboard/login"' in await html.text()
    api = await client.get("/dashboard", headers={"Accept": "application/json"})
    assert api.status == 401 and (await _error_of(api))["type"] == "authentication_error"
    for headers in ({}, {"Authorization": f"Bearer {USER_KEY}"}, {"x-api-key": USER_KEY},
                    {"Cookie": f"{COOKIE_NAME}={issue_token('admin-1', OTHER, now=NOW, ttl_s=10**9)}"}):
        feed = await client.get("/dashboard/feed", headers=headers)
        assert feed.status == 401
        await _error_of(feed)


@pytest.mark.parametrize("header", ["Authorization", "x-api-key"])
async def test_admin_key_header_opens_page_and_feed(client: TestClient, header: str) -> None:
    value = f"Bearer {ADMIN_KEY}" if header == "Authorization" else ADMIN_KEY
    page = await client.get("/dashboard", headers={header: value})
    assert page.status == 200 and 'data-testid="charts"' in await page.text()
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    feed = await client.get("/dashboard/feed", headers={header: value})
    assert feed.status == 200 and orjson.loads(await feed.read()) == {"now": 1.0, "backends": []}
    assert feed.headers["Cache-Control"] == "no-store"


async def test_cookie_session_then_logout(client: TestClient) -> None:
    login = await client.post("/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False)
    token = SimpleCookie(login.headers["Set-Cookie"])[COOKIE_NAME].value
    cookie = {"Cookie": f"{COOKIE_NAME}={token}"}
    assert (await client.get("/dashboard/feed", headers=cookie)).status == 200
    page = await client.get("/dashboard", headers=cookie)
    assert 'data-testid="charts"' in await page.text()
    out = await client.post("/dashboard/logout", allow_redirects=False)
    assert out.status == 303
    cleared = SimpleCookie(out.headers["Set-Cookie"])[COOKIE_NAME]
    assert cleared.value == "" and cleared["max-age"] == "0"


async def test_static_assets_are_a_fixed_set(client: TestClient) -> None:
    js = await client.get("/dashboard/static/dashboard.js")
    assert js.status == 200 and js.content_type == "text/javascript"
    assert "credentials: 'same-origin'" in await js.text()
    css = await client.get("/dashboard/static/dashboard.css")
    assert css.status == 200 and css.content_type == "text/css"
    for name in ("nope.js", "..%2Froutes.py", "%2E%2E%2Fsession.py", "__init__.py"):
        resp = await client.get(f"/dashboard/static/{name}")
        assert resp.status == 404
        await _error_of(resp)


async def test_assets_reach_nothing_off_the_page_origin(client: TestClient) -> None:
    for name in ("index.html", "login.html", "dashboard.js", "dashboard.css"):
        text = await (await client.get(f"/dashboard/static/{name}")).text()
        assert "http://" not in text and "https://" not in text and "@import" not in text and "//" + "cdn" not in text


async def test_failing_provider_is_a_503_in_error_shape() -> None:
    async def broken() -> dict:
        raise RuntimeError("store down")

    app = web.Application()
    setup_dashboard(app, admin_for_key=_admin_for_key, session_secret=SECRET, stats_provider=broken)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        resp = await c.get("/dashboard/feed", headers={"x-api-key": ADMIN_KEY})
        assert resp.status == 503
        assert (await _error_of(resp))["code"] == "stats_unavailable"


# Sessions bound to the key that opened them (what the gateway uses: gateway/ops/admin_keys.py admin_binding).
LIVE = {"admin-1": b"digest-of-admin-key"}


async def test_a_bound_session_holds_only_while_its_key_is_a_live_admin() -> None:
    live = dict(LIVE)
    app = web.Application()
    setup_dashboard(app, admin_for_key=_admin_for_key, session_secret=SECRET, stats_provider=dict,
                    session_binding=live.get)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        login = await c.post("/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False)
        token = SimpleCookie(login.headers["Set-Cookie"])[COOKIE_NAME].value
        assert orjson.loads(base64.urlsafe_b64decode(token.split(".")[0] + "==")).keys() == {"p", "exp"}
        cookie = {"Cookie": f"{COOKIE_NAME}={token}"}
        assert (await c.get("/dashboard/feed", headers=cookie)).status == 200
        # Signed with the plain secret, the token would not do: it is signed for that key only.
        assert verify_token(token, SECRET, now=NOW) is None
        live["admin-1"] = b"digest-of-another-key"  # the id now names another key
        assert (await c.get("/dashboard/feed", headers=cookie)).status == 401
        del live["admin-1"]  # revoked, or no longer admin
        assert (await c.get("/dashboard/feed", headers=cookie)).status == 401
        login = await c.post("/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False)
        assert login.status == 401 and "Set-Cookie" not in login.headers
        live["admin-1"] = LIVE["admin-1"]
        assert (await c.get("/dashboard/feed", headers=cookie)).status == 200


def test_session_principal_with_a_binding_checks_the_live_key() -> None:
    from gateway.dashboard.session import bound_secret

    token = issue_token("admin-1", bound_secret(SECRET, LIVE["admin-1"]), now=NOW, ttl_s=60)
    request = make_mocked_request("GET", "/stats", headers={"Cookie": f"{COOKIE_NAME}={token}"})
    assert session_principal(request, SECRET, now=NOW, binding=LIVE.get) == "admin-1"
    assert session_principal(request, SECRET, now=NOW, binding={}.get) is None
    assert session_principal(request, SECRET, now=NOW + 61, binding=LIVE.get) is None
    plain = issue_token("admin-1", SECRET, now=NOW, ttl_s=60)  # an unbound token is no bound session
    request = make_mocked_request("GET", "/stats", headers={"Cookie": f"{COOKIE_NAME}={plain}"})
    assert session_principal(request, SECRET, now=NOW, binding=LIVE.get) is None
    forged = _forged({"p": "admin-1", "exp": int(NOW) + 60}, bound_secret(OTHER, LIVE["admin-1"]))
    request = make_mocked_request("GET", "/stats", headers={"Cookie": f"{COOKIE_NAME}={forged}"})
    assert session_principal(request, SECRET, now=NOW, binding=LIVE.get) is None
