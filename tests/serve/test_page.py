"""The web page at / in headless Chromium (DevTools protocol): entities highlighted, images appear.

The screenshot is written to the test's tmp folder (and to $RAPIDDIFF_ARTIFACTS when set).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from .conftest import MODEL

CHROMIUM = next(
    (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None
)
STATUS = "document.getElementById('status').textContent"
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (apt-get install chromium)")


class DevTools:
    """A minimal Chrome DevTools protocol client over one page's websocket."""

    def __init__(self, ws_url: str) -> None:
        import websocket  # websocket-client

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params: object) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        for _ in range(10_000):  # events arrive between the answers; bounded
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
        raise RuntimeError(f"{method}: no answer")

    def js(self, expression: str) -> object:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, describe: Callable[[], str] | None = None) -> object:
        """The expression's first truthy value; on timeout, the error says ``describe()`` too."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.25)
        raise TimeoutError(
            f"not true after {timeout} s: {expression}" + (f"\n{describe()}" if describe else "")
        )


def server_state(url: str) -> str:
    """The served queue and workers (Prometheus samples), for a failure message."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError as err:
        return f"/metrics unreachable: {err}"
    keep = (
        "rapiddiff_queue_depth",
        "rapiddiff_workers",
        "rapiddiff_images_total",
        "rapiddiff_requests_total",
    )
    return "server: " + "; ".join(line for line in text.splitlines() if line.startswith(keep))


@contextlib.contextmanager
def chromium(profile: Path):
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
         f"--user-data-dir={profile}", "--window-size=1200,900", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.is_file() or not port_file.read_text().strip():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in pages if t["type"] == "page")
        tools = DevTools(page["webSocketDebuggerUrl"])
        try:
            yield tools
        finally:
            tools.ws.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_page_generates_and_shows_images_with_entities(server, tmp_path):
    with chromium(tmp_path / "profile") as tab:
        tab.call(
            "Emulation.setDeviceMetricsOverride", width=1200, height=900, deviceScaleFactor=1, mobile=False
        )
        tab.call("Page.enable")
        tab.call("Page.navigate", url=f"{server}/")
        # The form fills from /v1/settings and the linker highlights the default prompt's entities.
        tab.wait_for("document.querySelectorAll('#size option').length > 0", timeout=60)
        assert tab.js("document.getElementById('model').textContent") == f"model: {MODEL}"
        tab.js("""(() => { const p = document.getElementById('prompt');
                  p.value = '绿色背景上有一个番茄和香蕉'; p.dispatchEvent(new Event('input')); })()""")
        marked = tab.wait_for(
            "(() => { const m = [...document.querySelectorAll('#linked mark.entity')].map(e => e.textContent);"
            " return m.includes('香蕉') ? m : null; })()",
            timeout=30,
        )
        assert marked == ["绿色", "番茄", "香蕉"]
        tab.js("document.getElementById('seed').value = '5'; document.getElementById('go').click()")
        # Knowledge on and off side by side: two images, each decoded by the browser (or the page's
        # error message, at once, instead of waiting out the timeout).
        shown = tab.wait_for(
            "(() => { const s = document.getElementById('status');"
            " if (s.className === 'error') return s.textContent;"
            " const imgs = [...document.querySelectorAll('#gallery img.generated')];"
            " return imgs.length === 2 && imgs.every(i => i.complete && i.naturalWidth === 128) ? 'shown' : null; })()",
            timeout=180,
            describe=lambda: f"page status {tab.js(STATUS)!r}; {server_state(server)}",
        )
        assert shown == "shown", shown
        sides = tab.js("[...document.querySelectorAll('.card .side')].map(s => s.dataset.knowledge)")
        assert sides == ["true", "false"]
        settings = tab.js("document.querySelector('.card .settings').textContent")
        assert "seed 5" in settings and "2 steps" in settings
        assert tab.js("document.querySelectorAll('.card .prompt mark.entity').length") == 3
        status = tab.js(STATUS)
        assert "done" in status, status
        shot = base64.b64decode(tab.call("Page.captureScreenshot", format="png")["data"])
    path = tmp_path / "serve_page.png"
    path.write_bytes(shot)
    if os.environ.get("RAPIDDIFF_ARTIFACTS"):
        folder = Path(os.environ["RAPIDDIFF_ARTIFACTS"])
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, folder / path.name)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000
