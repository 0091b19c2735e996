"""What observability costs per request and per log line, against the same work without it.

* request: one GET through the ASGI app, called directly (no HTTP client or socket), with
  and without ObservabilityMiddleware (request id, access log line rendered as JSON,
  HTTP metrics). The baseline is the same app without the middleware.
* log line: one structlog event with a few fields, rendered to JSON through the stdlib
  handler, with and without secret masking.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from fastapi import FastAPI

import queuekeeper.logging as qk_logging
from queuekeeper.observability.http import ObservabilityMiddleware

REQUESTS = 5_000
LOG_LINES = 20_000
ROUNDS = 5


def _app(with_middleware: bool) -> Any:
    app = FastAPI()

    @app.get("/api/items/{item_id}/")
    async def item(item_id: str) -> dict[str, str]:
        return {"uuid": item_id}

    if with_middleware:
        app.add_middleware(ObservabilityMiddleware)
    return app


async def _requests(app: Any, count: int) -> float:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/api/items/5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b/",
        "raw_path": b"/api/items/5f0c4bb3a05f4c3a9f5e5b3a1f2d3c4b/",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"bench"), (b"x-request-id", b"bench-1")],
        "client": ("127.0.0.1", 1),
        "server": ("bench", 80),
        "state": {},
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    started = time.perf_counter()
    for _ in range(count):
        await app(dict(scope), receive, send)
    return time.perf_counter() - started


def _best(run: Callable[[], float]) -> float:
    return min(run() for _ in range(ROUNDS))


def _log_lines(count: int) -> float:
    log = structlog.get_logger("queuekeeper.bench")
    started = time.perf_counter()
    for index in range(count):
        log.info(
            "queue_registered",
            queue="subscription_0d5e8f7a1b2c4d3e9f8a7b6c5d4e3f2a_offering_5f0c_order",
            vhost="8b1a9953c4611296a827abf8c47804d7",
            new_row=True,
            attempt=index,
        )
    return time.perf_counter() - started


def _configure(masking: bool) -> io.StringIO:
    stream = io.StringIO()
    original = qk_logging._mask_secrets
    if not masking:
        qk_logging._mask_secrets = lambda _l, _m, event_dict: event_dict  # type: ignore[assignment]
    try:
        qk_logging.configure_logging(level="INFO", log_format="json", stream=stream)
    finally:
        qk_logging._mask_secrets = original  # type: ignore[assignment]
    return stream


def _per_call(seconds: float, count: int) -> float:
    return seconds / count * 1e6


def main() -> None:
    _configure(masking=True)
    bare, observed = _app(False), _app(True)

    def timed(app: Any) -> Callable[[], float]:
        def run() -> float:
            awaitable: Awaitable[float] = _requests(app, REQUESTS)
            return asyncio.run(awaitable)  # type: ignore[arg-type]

        return run

    base = _best(timed(bare))
    with_mw = _best(timed(observed))
    print(f"request, no middleware (baseline): {_per_call(base, REQUESTS):7.1f} µs")
    print(
        f"request, ObservabilityMiddleware:  {_per_call(with_mw, REQUESTS):7.1f} µs"
        f"  ratio {with_mw / base:.2f}x  (+{_per_call(with_mw - base, REQUESTS):.1f} µs)"
    )

    _configure(masking=False)
    plain = _best(lambda: _log_lines(LOG_LINES))
    _configure(masking=True)
    masked = _best(lambda: _log_lines(LOG_LINES))
    print(f"log line, no masking (baseline):   {_per_call(plain, LOG_LINES):7.1f} µs")
    print(
        f"log line, secrets masked:          {_per_call(masked, LOG_LINES):7.1f} µs"
        f"  ratio {masked / plain:.2f}x  (+{_per_call(masked - plain, LOG_LINES):.1f} µs)"
    )
    logging.getLogger().handlers[:] = [
        h for h in logging.getLogger().handlers if not isinstance(h, qk_logging.QueuekeeperHandler)
    ]


if __name__ == "__main__":
    main()
