"""A real HTTP server for tests that need one (a fuzzer, a browser): the app built from the
test's settings, served by uvicorn on a free loopback port in a thread of its own (with its
own event loop, so the engine and the broker clients live there)."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from queuekeeper.app import create_app
from queuekeeper.config import Settings


@contextmanager
def live_server(settings: Settings, *, timeout: float = 60.0) -> Iterator[str]:
    """Serve `create_app(settings)` until the block ends; yields its base URL."""
    config = uvicorn.Config(
        create_app(settings),
        host="127.0.0.1",
        port=0,
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="live-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the test server stopped during start-up (see the log above)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the test server did not start within {timeout} s")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


async def run_beside_a_server(
    settings: Settings,
    command: Sequence[str],
    *,
    cwd: Path,
    home: Path,
    service_token: str | None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `command` as a newcomer would, against a served instance: only PATH, HOME, the
    instance's URL (`QK`) and the service token (when given) in its environment."""
    token = {} if service_token is None else {"QUEUEKEEPER_SERVICE_TOKENS": service_token}

    def run() -> subprocess.CompletedProcess[str]:
        with live_server(settings) as base_url:
            return subprocess.run(
                list(command),
                input=stdin,
                cwd=cwd,
                env={
                    "PATH": "/usr/local/bin:/usr/bin:/bin",
                    "HOME": str(home),
                    "QK": base_url,
                    **token,
                },
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )

    return await asyncio.to_thread(run)
