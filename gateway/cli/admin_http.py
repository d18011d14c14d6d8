"""One blocking call to a running gateway's admin routes, for the admin commands (`shapegate keys`, `shapegate ab`).

urllib rather than the gateway's own clients: a command makes one call and exits, with no event loop or session
to run. A redirect is never followed, so the admin key never goes on to wherever it points.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any


class AdminError(Exception):
    """Why the call gave no answer, as one line for the user; `status`: the command's exit status."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class AdminRefused(Exception):
    """The gateway answered with an HTTP error other than a refused key or a redirect; the command phrases it."""

    def __init__(self, status: int, reason: str, base: str, endpoint: str) -> None:
        super().__init__(f"HTTP {status}{': ' + reason if reason else ''}")
        self.status, self.reason, self.base, self.endpoint = status, reason, base, endpoint


class _KeepAuthorizationHere(urllib.request.HTTPRedirectHandler):
    # urllib would send the Authorization header on to wherever a redirect points, another host included.
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_KeepAuthorizationHere)


def error_message(body: bytes, limit: int = 300) -> str:
    """The gateway's own reason from an OpenAI-shaped error body, on one line; "" if there is none."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return " ".join(str(message).split())[:limit]


def admin_call(url: str, key: str, timeout: float, method: str, path: str, body: dict | None = None) -> Any:
    """`method` `path` of the gateway at `url` with the admin `key`: its JSON answer. AdminError when it cannot be
    asked, refuses the key, redirects or answers no JSON; AdminRefused for any other HTTP error."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise AdminError(f"--url must start with http:// or https:// (got {url!r})")
    endpoint = base + path
    headers = {"Authorization": f"Bearer {key}", "Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(endpoint, data=data, method=method, headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        with e:
            status, reason = e.code, error_message(e.read())
        if status in (401, 403):
            raise AdminError(f"{base} refused the admin key (HTTP {status}){': ' + reason if reason else ''}") \
                from None
        if 300 <= status < 400:
            raise AdminError(f"{endpoint} redirects to {e.headers.get('Location', '?')}: give that address as "
                             "--url (the key was not sent on)") from None
        raise AdminRefused(status, reason, base, endpoint) from None
    except (TimeoutError, urllib.error.URLError, OSError, http.client.HTTPException) as e:
        cause = getattr(e, "reason", e)
        if isinstance(cause, TimeoutError):
            raise AdminError(f"no answer from {base} within {timeout:g} s") from None
        if not isinstance(e, urllib.error.URLError) and not isinstance(e, TimeoutError):
            # the connection was made, then closed or garbled before an answer
            raise AdminError(f"{base} did not answer: {type(e).__name__}: {e}") from None
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else cause
        raise AdminError(f"cannot connect to {base}: {why}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise AdminError(f"{endpoint} did not answer JSON: is it a shapegate gateway?") from None
