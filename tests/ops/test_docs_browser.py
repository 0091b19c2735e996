"""/docs and /redoc render in a real browser with nothing fetched from outside.

Headless Chromium (Debian's) opens each page from a live server; the rendered DOM lists
every operation by its summary, and Chromium's network log shows that every request went
to the server on 127.0.0.1 (any other host is also made unresolvable, so a CDN reference
would leave the page blank and fail the first check too).
"""

from __future__ import annotations

import html
import json
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from queuekeeper.config import Settings
from tests.ops.live import live_server
from tests.ops.tools import require

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    # The browser's own calls (autofill hints, optimisation guides), not the page's.
    "--disable-features=AutofillServerCommunication,OptimizationHints,MediaRouter",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--virtual-time-budget=20000",
]


def render(chromium: str, url: str, workdir: Path) -> tuple[str, NetLog]:
    """The DOM after the page's scripts ran, and the browser's network log."""
    net_log = workdir / "netlog.json"
    result = subprocess.run(
        [
            chromium,
            *FLAGS,
            f"--user-data-dir={workdir / 'profile'}",
            f"--log-net-log={net_log}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    site = f"{urlsplit(url).scheme}://{urlsplit(url).hostname}"
    return result.stdout, NetLog(json.loads(net_log.read_text()), site)


class NetLog:
    """What Chromium's network log says: the requests the page made (those in the page's
    network partition) and every address a TCP connection was attempted to. (Chromium also
    `connect`s a UDP socket to a public DNS address to learn its own route; that sends no
    packet, and QUIC is off.)"""

    CONNECTS = {"TCP_CONNECT_ATTEMPT": "address", "TCP_CONNECT": "remote_address"}

    def __init__(self, log: dict[str, Any], site: str) -> None:
        types = {number: name for name, number in log["constants"]["logEventTypes"].items()}
        self.page_requests: set[str] = set()
        self.connected: set[str] = set()
        for event in log.get("events", []):
            kind, params = types.get(event["type"]), event.get("params") or {}
            if kind == "URL_REQUEST_START_JOB" and site in params.get("network_isolation_key", ""):
                self.page_requests.add(params["url"])
            if kind in self.CONNECTS and isinstance(params.get(self.CONNECTS[kind]), str):
                self.connected.add(params[self.CONNECTS[kind]].rsplit(":", 1)[0])


def summaries(document: dict[str, Any]) -> set[str]:
    return {
        operation["summary"]
        for path in document["paths"].values()
        for operation in path.values()
        if isinstance(operation, dict) and operation.get("summary")
    }


@pytest.mark.timeout(400)
async def test_docs_and_redoc_render_offline_in_chromium(
    settings: Settings, clean_state: None, tmp_path: Path
) -> None:
    chromium = require("chromium")
    import asyncio

    def run() -> tuple[set[str], dict[str, tuple[str, NetLog]]]:
        with live_server(settings) as base_url:
            document = httpx.get(f"{base_url}/openapi.json", timeout=30).json()
            pages = {}
            for page in ("docs", "redoc"):
                workdir = tmp_path / page
                workdir.mkdir()
                pages[page] = render(chromium, f"{base_url}/{page}", workdir)
            return summaries(document), pages

    expected, pages = await asyncio.to_thread(run)
    assert len(expected) > 20
    # The introduction's quickstart, rendered (README.md, Quickstart, in short).
    expected |= {"Quickstart", "The backend's pushes come first", "Authorization: Bearer"}
    for page, (dom, net) in pages.items():
        text = html.unescape(dom)
        missing = {summary for summary in expected if summary not in text}
        assert missing == set(), f"/{page} does not list: {sorted(missing)}"
        web = net.page_requests
        assert any(url.endswith(f"/{page}") for url in web), web
        assert any(url.endswith("/openapi.json") for url in web), web
        assert any("/docs-assets/" in url for url in web), web
        outside = {url for url in web if urlsplit(url).hostname != "127.0.0.1"}
        assert outside == set(), f"/{page} requested from outside the machine: {outside}"
        # Nor did the browser itself reach anything else (its own update and time checks
        # are attempted, and fail to resolve).
        assert net.connected <= {"127.0.0.1", "[::1]"}, net.connected
