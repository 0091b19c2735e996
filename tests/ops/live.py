"""A real HTTP server for tests that need one (a fuzzer, a browser): the app built from the
test's settings, served by uvicorn on a free loopback port in a thread of its own (with its
own event loop, so the engine and the broker clients live there)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

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
