"""Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol.

The protocol runs over a pipe (``--remote-debugging-pipe``: commands in on fd 3,
replies out on fd 4, each message JSON ended by a NUL byte), so the browser
opens no debugging port. Every wait is bounded; the browser is killed on exit.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--disable-extensions", "--mute-audio",
         "--hide-scrollbars", "--remote-debugging-pipe")


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One tab: send commands, collect events."""

    def __init__(self, proc: subprocess.Popen, to_browser: int, from_browser: int) -> None:
        self._proc = proc
        self._out = to_browser
        self._ids = itertools.count(1)
        self._replies: queue.Queue[dict] = queue.Queue()
        self.events: list[dict] = []
        self.session: str | None = None
        threading.Thread(target=self._read, args=(from_browser,), daemon=True,
                         name="cdp-reader").start()

    def _read(self, fd: int) -> None:
        buffer = b""
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                buffer += chunk
                *messages, buffer = buffer.split(b"\0")
                for raw in messages:
                    message = json.loads(raw)
                    if "id" in message:
                        self._replies.put(message)
                    else:
                        self.events.append(message)

    def send(self, method: str, params: dict | None = None, timeout: float = 15.0,
             browser: bool = False) -> dict:
        """Send a command (to this tab unless ``browser``) and return its result."""
        message: dict[str, Any] = {"id": next(self._ids), "method": method,
                                   "params": params or {}}
        if self.session is not None and not browser:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._proc.poll() is not None:
                raise AssertionError(f"no reply from chromium to {method}")
            try:
                reply = self._replies.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if reply["id"] != message["id"]:
                continue  # a late reply to a command that timed out
            if "error" in reply:
                raise AssertionError(f"{method} failed: {reply['error']}")
            return reply.get("result", {})

    def evaluate(self, expression: str, timeout: float = 10.0) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, timeout)
        if "exceptionDetails" in result:
            raise AssertionError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """Evaluate ``expression`` until it is truthy; return that value. A
        script error (the page still loading) counts as not yet."""
        deadline = time.monotonic() + timeout
        last_error = None
        while True:
            try:
                value = self.evaluate(expression)
            except AssertionError as exc:
                value, last_error = None, exc
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                                     + (f" (last error: {last_error})" if last_error else ""))
            time.sleep(0.1)

    def screenshot(self, path: os.PathLike | str) -> None:
        result = self.send("Page.captureScreenshot",
                           {"format": "png", "captureBeyondViewport": True}, timeout=20)
        with open(path, "wb") as f:
            f.write(base64.b64decode(result["data"]))


@contextlib.contextmanager
def open_page(url: str, width: int = 1280, height: int = 1000,
              timeout: float = 30.0) -> Iterator[Page]:
    """Launch headless Chromium, open ``url`` in a fresh tab and yield it."""
    binary = chromium_binary()
    assert binary is not None, "chromium is not installed"
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    with tempfile.TemporaryDirectory(prefix="baton-chromium-") as profile:
        # bash puts the pipe ends on fds 3 and 4, by way of 10 and 11 in case
        # the pipes themselves landed on 3 or 4
        script = ('exec 10<&"$CDP_IN" 11>&"$CDP_OUT"; '
                  'exec 3<&10 4>&11 10<&- 11>&-; exec "$@"')
        argv = ["bash", "-c", script, "chromium", binary, *FLAGS,
                f"--user-data-dir={profile}", "about:blank"]
        env = {**os.environ, "CDP_IN": str(to_browser_r), "CDP_OUT": str(from_browser_w)}
        proc = subprocess.Popen(argv, env=env, pass_fds=(to_browser_r, from_browser_w),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(to_browser_r)
        os.close(from_browser_w)
        page = Page(proc, to_browser_w, from_browser_r)
        try:
            target = page.send("Target.createTarget", {"url": "about:blank"}, timeout)
            attached = page.send("Target.attachToTarget",
                                 {"targetId": target["targetId"], "flatten": True}, timeout)
            page.session = attached["sessionId"]
            page.send("Network.enable")
            page.send("Page.enable")
            page.send("Emulation.setDeviceMetricsOverride",
                      {"width": width, "height": height, "deviceScaleFactor": 1,
                       "mobile": False})
            page.send("Page.navigate", {"url": url}, timeout)
            yield page
        finally:
            with contextlib.suppress(AssertionError, OSError):
                page.send("Browser.close", browser=True, timeout=5)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            # the session this call started (browser, renderers), and only it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(10)
            os.close(to_browser_w)
