"""Headless Chromium over the DevTools protocol: sign in, read live DOM values, take a screenshot."""

from __future__ import annotations

import asyncio
import base64
import os
import tempfile
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
)
# Every element a test may read carries data-testid; data-value holds the raw number behind the text.
READ_JS = """Object.fromEntries(Array.from(document.querySelectorAll('[data-testid]'), e =>
  [e.dataset.testid, {text: e.textContent.trim(), value: e.dataset.value ?? null, hidden: e.hidden}]))"""
BOXES_JS = """Object.fromEntries(Array.from(document.querySelectorAll('[data-testid]'), e => {
  const r = e.getBoundingClientRect();
  return [e.dataset.testid, {x: r.x, y: r.y, width: r.width, height: r.height}];
}))"""
LIVE_JS = """document.documentElement.dataset.feed === 'live' &&
  document.querySelector('[data-testid^="ttft_p50:"]:not([data-value=""])') !== null"""


def chromium_available() -> bool:
    return CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)


@dataclass(frozen=True)
class FormLogin:
    """Sign in the way a person does: type the key into the sign-in form and submit it."""

    key: str


@dataclass(frozen=True)
class Cookie:
    name: str
    value: str


@dataclass(frozen=True)
class Headers:
    headers: Mapping[str, str]


Auth = FormLogin | Cookie | Headers


@dataclass
class Reading:
    first: dict[str, dict[str, Any]]
    second: dict[str, dict[str, Any]]
    page_errors: list[str] = field(default_factory=list)


class CDPError(RuntimeError):
    pass


class Page:
    """One page target on a flattened DevTools session; errors the page reports are collected."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.session_id: str | None = None
        self.errors: list[str] = []

    async def read_loop(self) -> None:
        try:
            async for msg in self._ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    continue
                self._dispatch(orjson.loads(msg.data))
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(CDPError("DevTools connection closed"))

    def _dispatch(self, data: dict[str, Any]) -> None:
        if "id" in data:
            fut = self._pending.pop(data["id"], None)
            if fut is None or fut.done():
                return
            if "error" in data:
                fut.set_exception(CDPError(str(data["error"])))
            else:
                fut.set_result(data.get("result", {}))
            return
        params = data.get("params", {})
        method = data.get("method")
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(details.get("exception", {}).get("description") or details.get("text", "?"))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.errors.append(params["entry"].get("text", "?"))
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))

    async def call(self, method: str, params: dict[str, Any] | None = None, *, browser: bool = False,
                   timeout: float = 10.0) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if not browser and self.session_id:
            msg["sessionId"] = self.session_id
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = fut
        await self._ws.send_str(orjson.dumps(msg).decode())
        return await asyncio.wait_for(fut, timeout)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise CDPError(result["exceptionDetails"].get("text", "evaluation failed"))
        return result.get("result", {}).get("value")

    async def navigate(self, url: str) -> None:
        result = await self.call("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise CDPError(f"navigation to {url} failed: {result['errorText']}")

    async def wait_for(self, expression: str, timeout: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                if await self.evaluate(expression):
                    return
            except CDPError:
                pass  # the document is between navigations; ask again
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"page never satisfied: {expression}")
            await asyncio.sleep(0.1)

    async def read(self) -> dict[str, dict[str, Any]]:
        return await self.evaluate(READ_JS)

    async def boxes(self) -> dict[str, dict[str, float]]:
        """The rendered box (x, y, width, height in CSS pixels) of every data-testid element."""
        return await self.evaluate(BOXES_JS)

    async def resize(self, width: int, height: int) -> None:
        await self.call("Emulation.setDeviceMetricsOverride",
                        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    async def screenshot(self, out_png: Path) -> None:
        result = await self.call("Page.captureScreenshot", {"format": "png"}, timeout=20.0)
        out_png.parent.mkdir(parents=True, exist_ok=True)
        out_png.write_bytes(base64.b64decode(result["data"]))

    async def authenticate(self, url: str, auth: Auth) -> None:
        """Leave the page signed in at `url`."""
        if isinstance(auth, Cookie):
            origin = "{0.scheme}://{0.netloc}/".format(urlsplit(url))
            await self.call("Network.setCookie", {"name": auth.name, "value": auth.value, "url": origin,
                                                  "httpOnly": True, "sameSite": "Strict"})
        elif isinstance(auth, Headers):
            await self.call("Network.setExtraHTTPHeaders", {"headers": dict(auth.headers)})
        await self.navigate(url)
        if isinstance(auth, FormLogin):
            await self.wait_for("document.querySelector('form input[name=key]') !== null")
            await self.evaluate(
                f"document.querySelector('form input[name=key]').value = {orjson.dumps(auth.key).decode()};"
                "document.querySelector('form input[name=key]').form.submit(); true"
            )
            await self.wait_for("document.querySelector('[data-testid=\"charts\"]') !== null")


async def _devtools_url(profile: Path, proc: asyncio.subprocess.Process, log: Path) -> str:
    port_file = profile / "DevToolsActivePort"
    for _ in range(300):
        if proc.returncode is not None:
            raise CDPError(f"chromium exited {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        if port_file.is_file():
            lines = port_file.read_text().split()
            if len(lines) >= 2:
                return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
        await asyncio.sleep(0.05)
    raise CDPError(f"chromium wrote no DevToolsActivePort: {log.read_text(errors='replace')[-2000:]}")


async def _reap(proc: asyncio.subprocess.Process, *, grace_s: float) -> None:
    # Always wait for the child, so no zombie or unclosed transport outlives the test.
    if proc.returncode is None and grace_s > 0:
        with suppress(TimeoutError):  # still running after Browser.close: killed below
            await asyncio.wait_for(proc.wait(), grace_s)
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


@asynccontextmanager
async def open_page(*, width: int = 1440, height: int = 900) -> AsyncIterator[Page]:
    """Start a throwaway headless Chromium and yield one attached page of the given viewport."""
    with tempfile.TemporaryDirectory(prefix="shapegate-chromium-", ignore_cleanup_errors=True) as tmp:
        profile, log = Path(tmp) / "profile", Path(tmp) / "chromium.log"
        profile.mkdir()
        with log.open("wb") as log_fh:
            proc = await asyncio.create_subprocess_exec(
                str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                f"--window-size={width},{height}", "about:blank",
                stdin=asyncio.subprocess.DEVNULL, stdout=log_fh, stderr=log_fh,
            )
        closing = False
        try:
            url = await _devtools_url(profile, proc, log)
            async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=64 << 20) as ws:
                page = Page(ws)
                reader = asyncio.create_task(page.read_loop())
                try:
                    target = await page.call("Target.createTarget", {"url": "about:blank"}, browser=True)
                    attached = await page.call("Target.attachToTarget",
                                               {"targetId": target["targetId"], "flatten": True}, browser=True)
                    page.session_id = attached["sessionId"]
                    for domain in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
                        await page.call(domain)
                    await page.resize(width, height)
                    yield page
                    # The browser may drop the socket before answering; either way it is exiting.
                    with suppress(CDPError, TimeoutError):
                        await page.call("Browser.close", browser=True, timeout=5.0)
                    closing = True
                finally:
                    reader.cancel()
                    await asyncio.gather(reader, return_exceptions=True)
        finally:
            await _reap(proc, grace_s=5.0 if closing else 0.0)


async def screenshot_and_read(url: str, auth: Auth, out_png: Path, *, ready_js: str = LIVE_JS,
                              settle_s: float = 0.0, interval_s: float = 2.5,
                              width: int = 1440, height: int = 900) -> Reading:
    """Sign in at `url`, wait until `ready_js` holds, read every data-testid twice `interval_s`
    apart (so a caller can assert the page is live), then save a PNG of the viewport."""
    async with open_page(width=width, height=height) as page:
        await page.authenticate(url, auth)
        await page.wait_for(ready_js, timeout=15.0)
        await asyncio.sleep(settle_s)
        first = await page.read()
        await asyncio.sleep(interval_s)
        second = await page.read()
        await page.screenshot(out_png)
        return Reading(first=first, second=second, page_errors=list(page.errors))
