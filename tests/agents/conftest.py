"""Fixtures of the site-agent end-to-end tests (helpers in harness.py)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn

from queuekeeper.app import create_app
from queuekeeper.config import Settings
from tests.agents.harness import RequestLog, Server
from tests.agents.site_agent_venv import LEGACY_VERSION, UNIFIED_VERSION, ensure_site_agent_venv


@pytest.fixture
async def server(settings: Settings, clean_state: None) -> AsyncIterator[Server]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = RequestLog(create_app(settings.model_copy(update={"public_url": url})))
    # The agents meet `serve`'s keep-alive, as in production (decision 037).
    config = uvicorn.Config(
        log,
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_keep_alive=settings.http_keep_alive_seconds,
    )
    uvicorn_server = uvicorn.Server(config)
    task = asyncio.create_task(uvicorn_server.serve(sockets=[sock]))
    deadline = time.monotonic() + 30
    while not uvicorn_server.started:
        assert not task.done(), "queuekeeper did not start"
        assert time.monotonic() < deadline, "queuekeeper did not start within 30 s"
        await asyncio.sleep(0.05)
    try:
        yield Server(url, log)
    finally:
        uvicorn_server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


@pytest.fixture(scope="session")
def site_agent_python() -> Path:
    return ensure_site_agent_venv(LEGACY_VERSION)


@pytest.fixture(scope="session")
def site_agent_107_python() -> Path:
    return ensure_site_agent_venv(UNIFIED_VERSION)
