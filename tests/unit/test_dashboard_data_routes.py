"""/dashboard/history and /dashboard/keys: admin only like the feed, absent when the host gives none, a 503 on failure."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.dashboard import FeedHistory, setup_dashboard

SECRET = b"unit-test-secret-0123456789abcdef"
ADMIN_KEY = "sk-admin-9c2e4f6a8b0d1e3f5a7c"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _admin_for_key(key: str) -> str | None:
    return "admin-1" if key == ADMIN_KEY else None


async def _client(**extra) -> TestClient:
    app = web.Application()
    setup_dashboard(app, admin_for_key=_admin_for_key, session_secret=SECRET,
                    stats_provider=lambda: {"now": 1.0, "backends": []}, **extra)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return client


async def test_history_and_keys_are_served_to_an_admin_only() -> None:
    history = FeedHistory()
    history.add({"now": 5.0, "scope": "group", "backends": [{"id": "a", "in_flight": 2}]})

    async def keys() -> dict:
        return {"keys": [{"id": "user"}]}

    client = await _client(history=history, keys_provider=keys)
    try:
        for path in ("/dashboard/history", "/dashboard/keys"):
            for headers in ({}, {"Authorization": "Bearer sk-not-a-key"}):
                resp = await client.get(path, headers=headers)
                assert resp.status == 401 and resp.headers["Cache-Control"] == "no-store"
        resp = await client.get("/dashboard/history", headers=ADMIN)
        body = await resp.json()
        assert resp.status == 200 and resp.headers["Cache-Control"] == "no-store"
        assert body["t"] == [5.0] and body["backends"]["a"]["in_flight"] == [2.0] and body["scope"] == "group"
        resp = await client.get("/dashboard/keys", headers=ADMIN)
        assert (resp.status, await resp.json()) == (200, {"keys": [{"id": "user"}]})
    finally:
        await client.close()


async def test_without_them_both_are_404_and_a_failing_one_is_503() -> None:
    def broken() -> dict:
        raise RuntimeError("store down")

    client = await _client()
    try:
        for path in ("/dashboard/history", "/dashboard/keys"):
            resp = await client.get(path, headers=ADMIN)
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    finally:
        await client.close()
    client = await _client(keys_provider=broken)
    try:
        resp = await client.get("/dashboard/keys", headers=ADMIN)
        error = (await resp.json())["error"]
        assert resp.status == 503 and error["message"] == "The keys view is unavailable right now."
        assert "store down" not in error["message"]
    finally:
        await client.close()


@pytest.mark.parametrize("name", ["charts.js", "keys.js"])
async def test_the_new_scripts_are_served_and_reach_nothing_off_the_page_origin(name: str) -> None:
    client = await _client()
    try:
        resp = await client.get(f"/dashboard/static/{name}")
        text = await resp.text()
    finally:
        await client.close()
    assert resp.status == 200 and resp.content_type == "text/javascript"
    assert "http://" not in text and "https://" not in text and "credentials: 'same-origin'" in text
