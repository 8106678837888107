"""A small Chrome DevTools Protocol client for tests and benchmarks: a real headless
chromium, driven over its DevTools websocket.

    async with Browser.launch() as browser:
        page = await browser.new_page(width=1280, height=800)
        await page.navigate(path.as_uri())
        await page.wait_for("window.__ready")
        await page.click(x, y)
        png = await page.screenshot()

One websocket to the browser; each page is a target attached in flat mode, so its
commands carry a session id on the same socket. Every wait has a deadline and raises
`BrowserTimeout` naming what it waited for. Uncaught exceptions, `console.error` and
error log entries of a page are collected in `Page.errors`, so a test can assert the
page ran clean.

Chromium runs here as root, which needs `--no-sandbox`; its profile lives in a
temporary directory removed on exit. `find_chromium()` returns None when no chromium
is installed, for tests to skip with a reason.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Chromium's default profile would fetch updates, components and safe-browsing lists;
# a test browser reaches nothing outside the machine.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-port=0",
)


class BrowserError(Exception):
    """The browser failed to start, or a command failed."""


class BrowserTimeout(BrowserError):
    """A wait ran past its deadline (the message says what it waited for)."""


class CommandError(BrowserError):
    """A DevTools command answered with an error."""


def find_chromium() -> str | None:
    """The chromium executable on PATH, or None."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    """A running headless chromium and its DevTools connection (use `launch`)."""

    def __init__(self, process: asyncio.subprocess.Process, ws: ClientConnection, profile: Path):
        self._process = process
        self._ws = ws
        self._profile = profile
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._listeners: list[tuple[str, str | None, Callable[[dict[str, Any]], None]]] = []
        self._reader = asyncio.create_task(self._read(), name="cdp-reader")

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(
        cls, *, executable: str | None = None, start_timeout_s: float = 30.0
    ) -> AsyncIterator[Browser]:
        """Start chromium, connect, and close both on exit."""
        exe = executable or find_chromium()
        if exe is None:
            raise BrowserError("no chromium on PATH")
        profile = Path(tempfile.mkdtemp(prefix="yb-chromium-"))
        stderr_path = profile / "stderr.log"
        with stderr_path.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                exe, *FLAGS, f"--user-data-dir={profile}", "about:blank",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=stderr,
            )  # fmt: skip
        browser: Browser | None = None
        try:
            url = await _devtools_url(process, profile, stderr_path, start_timeout_s)
            # Screenshots of a big page are several MB of base64 in one message.
            ws = await asyncio.wait_for(
                connect(url, max_size=256 << 20, ping_interval=None), start_timeout_s
            )
            browser = cls(process, ws, profile)
            yield browser
        finally:
            if browser is not None:
                await browser._close()
            await _stop(process)
            shutil.rmtree(profile, ignore_errors=True)

    async def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        session_id: str | None = None,
        timeout_s: float = 10.0,
    ) -> dict[str, Any]:
        """Send one command and wait for its result; `CommandError` on an error reply."""
        self._next_id += 1
        message_id = self._next_id
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session_id:
            message["sessionId"] = session_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[message_id] = future
        try:
            await self._ws.send(json.dumps(message))
            async with _deadline(timeout_s, f"the answer to {method}"):
                reply = await future
        finally:
            self._pending.pop(message_id, None)
        if "error" in reply:
            raise CommandError(f"{method}: {reply['error'].get('message')} ({reply['error']})")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def listen(
        self, method: str, session_id: str | None, callback: Callable[[dict[str, Any]], None]
    ) -> Callable[[], None]:
        """Call `callback(params)` for every event `method` (of a session, or of the
        browser when None); returns what stops it."""
        entry = (method, session_id, callback)
        self._listeners.append(entry)
        return lambda: self._listeners.remove(entry) if entry in self._listeners else None

    async def new_page(self, *, width: int = 1280, height: int = 800) -> Page:
        """A fresh tab with a viewport of `width` x `height` CSS pixels."""
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        page = Page(self, attached["sessionId"])
        await page.start(width, height)
        return page

    async def _read(self) -> None:
        async for raw in self._ws:
            message = json.loads(raw)
            if "id" in message:
                future = self._pending.get(message["id"])
                if future is not None and not future.done():
                    future.set_result(message)
                continue
            method, session = message.get("method"), message.get("sessionId")
            for wanted, wanted_session, callback in list(self._listeners):
                if wanted == method and wanted_session == session:
                    callback(message.get("params", {}))
        # The socket closed: nobody will answer what is pending.
        for future in self._pending.values():
            if not future.done():
                future.set_exception(BrowserError("the DevTools connection closed"))

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.send("Browser.close", timeout_s=5.0), 5.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._ws.close(), 5.0)
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader


class Page:
    """One tab. `errors` collects what the page reported as errors."""

    def __init__(self, browser: Browser, session_id: str) -> None:
        self.browser = browser
        self.session_id = session_id
        self.errors: list[str] = []

    async def send(
        self, method: str, params: dict[str, Any] | None = None, *, timeout_s: float = 10.0
    ) -> dict[str, Any]:
        """A command to this page's session."""
        return await self.browser.send(
            method, params, session_id=self.session_id, timeout_s=timeout_s
        )

    async def start(self, width: int, height: int) -> None:
        """Enable the domains the client uses and set the viewport."""
        listen = self.browser.listen
        listen("Runtime.exceptionThrown", self.session_id, self._on_exception)
        listen("Runtime.consoleAPICalled", self.session_id, self._on_console)
        listen("Log.entryAdded", self.session_id, self._on_log)
        for domain in ("Page.enable", "Runtime.enable", "Log.enable"):
            await self.send(domain)
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    async def navigate(self, url: str, *, timeout_s: float = 30.0) -> None:
        """Open `url` and wait for its load event."""
        loaded: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_load(_: dict[str, Any]) -> None:
            if not loaded.done():
                loaded.set_result(None)

        stop = self.browser.listen("Page.loadEventFired", self.session_id, on_load)
        try:
            result = await self.send("Page.navigate", {"url": url}, timeout_s=timeout_s)
            if result.get("errorText"):
                raise BrowserError(f"navigating to {url}: {result['errorText']}")
            async with _deadline(timeout_s, f"the load event of {url}"):
                await loaded
        finally:
            stop()

    async def evaluate(self, expression: str, *, timeout_s: float = 10.0) -> Any:
        """The value of a JS expression (promises awaited), or `BrowserError` with the
        exception it threw."""
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            timeout_s=timeout_s,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"evaluating {expression!r}: {text}")
        return result.get("result", {}).get("value")

    async def wait_for(
        self, expression: str, *, timeout_s: float = 10.0, poll_s: float = 0.05
    ) -> Any:
        """Poll a JS expression until it is truthy; its value."""
        async with _deadline(timeout_s, f"{expression!r} to become true"):
            while True:
                value = await self.evaluate(expression, timeout_s=timeout_s)
                if value:
                    return value
                await asyncio.sleep(poll_s)

    async def click(self, x: float, y: float) -> None:
        """A real left click at viewport coordinates (CSS pixels): move, press, release."""
        common = {"x": x, "y": y, "button": "left", "clickCount": 1}
        await self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
        await self.send(
            "Input.dispatchMouseEvent", {"type": "mousePressed", "buttons": 1, **common}
        )
        await self.send(
            "Input.dispatchMouseEvent", {"type": "mouseReleased", "buttons": 0, **common}
        )

    async def screenshot(self, *, full_page: bool = False, timeout_s: float = 30.0) -> bytes:
        """A PNG of the viewport (or of the whole page)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        result = await self.send("Page.captureScreenshot", params, timeout_s=timeout_s)
        return base64.b64decode(result["data"])

    def _on_exception(self, params: dict[str, Any]) -> None:
        details = params.get("exceptionDetails", {})
        text = details.get("exception", {}).get("description") or details.get("text", "")
        self.errors.append(f"uncaught: {text}")

    def _on_console(self, params: dict[str, Any]) -> None:
        if params.get("type") in ("error", "assert"):
            args = " ".join(
                str(a.get("value", a.get("description", ""))) for a in params.get("args", [])
            )
            self.errors.append(f"console.{params.get('type')}: {args}")

    def _on_log(self, params: dict[str, Any]) -> None:
        entry = params.get("entry", {})
        if entry.get("level") == "error":
            self.errors.append(f"log ({entry.get('source')}): {entry.get('text')}")


@contextlib.asynccontextmanager
async def _deadline(timeout_s: float, what: str) -> AsyncIterator[None]:
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise BrowserTimeout(f"waited {timeout_s:g}s for {what}") from None


async def _devtools_url(
    process: asyncio.subprocess.Process, profile: Path, stderr: Path, timeout_s: float
) -> str:
    """The browser's websocket URL, from the DevToolsActivePort file chromium writes
    once it listens (port on the first line, path on the second)."""
    port_file = profile / "DevToolsActivePort"
    async with _deadline(timeout_s, f"chromium to write {port_file}"):
        while True:
            if process.returncode is not None:
                raise BrowserError(f"chromium exited with {process.returncode}: {_tail(stderr)}")
            url = _read_port_file(port_file)
            if url:
                return url
            await asyncio.sleep(0.05)


def _read_port_file(port_file: Path) -> str | None:
    if not port_file.exists():
        return None
    lines = port_file.read_text().split()
    return f"ws://127.0.0.1:{lines[0]}{lines[1]}" if len(lines) >= 2 else None


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:]


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is not None:
        return
    process.terminate()
    try:
        await asyncio.wait_for(process.wait(), 10.0)
    except TimeoutError:
        process.kill()
        await asyncio.wait_for(process.wait(), 10.0)
