"""One ASGI middleware per request: its request id, its access log line, its HTTP metrics.

Pure ASGI (not BaseHTTPMiddleware), so the request id bound here is in the same context
as the endpoint and every log line of the request carries it.
"""

from __future__ import annotations

import logging
import random
import re
import time
from typing import Any

import structlog
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from queuekeeper.common.access import accepts_events
from queuekeeper.observability.metrics import HTTP_LATENCY, HTTP_REQUESTS

log = structlog.get_logger("queuekeeper.http")
_stdlib_log = logging.getLogger("queuekeeper.http")

REQUEST_ID_HEADER = "X-Request-ID"
# A caller's id is kept when it is short and plain, so it can be searched for in logs;
# anything else (too long, spaces, control characters) is replaced.
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=/-]{0,127}")
# Route templates that are not traffic: probes and scrapes.
UNTRACKED_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})
# Raw paths of unmatched requests would give one time series per scanner probe.
UNMATCHED_ROUTE = "unmatched"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def request_id_from(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = bytes(value).decode("latin-1").strip()
            if _SANE_REQUEST_ID.fullmatch(candidate):
                return candidate
            break
    # 128 random bits as uuid4().hex reads, without its system call for 16 fresh bytes per
    # request: an id to find a request's lines by, not a secret (the generator is reseeded
    # in a forked child; docs/decisions/033-intake-keeps-its-connection.md).
    return f"{random.getrandbits(128):032x}"


def route_template(scope: Scope) -> str:
    path: object = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) else UNMATCHED_ROUTE


class ObservabilityMiddleware:
    def __init__(self, app: ASGIApp, log_accepted_events: bool = True) -> None:
        self.app = app
        # The accept routes' successful answers at DEBUG unless asked for: a log line costs
        # about a tenth of a single event's CPU (docs/decisions/017-single-event-cost.md).
        self.log_accepted_events = log_accepted_events
        # (method, route template, status) -> its request counter and latency histogram;
        # bounded by the routes, methods and statuses (an unmatched path is one route).
        self._series: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope)
        status = 500  # what the server answers when an exception escapes the app
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        # Bound and reset by token: `bound_contextvars` reads every bound variable first.
        tokens = structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._record(scope, status, time.perf_counter() - started)
            structlog.contextvars.reset_contextvars(**tokens)

    def _record(self, scope: Scope, status: int, seconds: float) -> None:
        route = route_template(scope)
        method = scope["method"] if scope["method"] in _METHODS else "OTHER"
        fields = {
            "method": method,
            "path": scope["path"],
            "route": route,
            "status": status,
            "duration_ms": round(seconds * 1000, 2),
            "client": (scope.get("client") or ("", 0))[0],
        }
        if route in UNTRACKED_ROUTES:
            log.debug("http_request", **fields)
            return
        counted = self._series.get((method, route, status))
        if counted is None:  # bound once per series: a lookup per request costs more
            counted = (
                HTTP_REQUESTS.labels(method=method, route=route, status=str(status)),
                HTTP_LATENCY.labels(method=method, route=route),
            )
            self._series[(method, route, status)] = counted
        counted[0].inc()
        counted[1].observe(seconds)
        if status >= 500:
            log.warning("http_request", **fields)
        elif status < 400 and not self.log_accepted_events and accepts_events(scope.get("route")):
            if _stdlib_log.isEnabledFor(logging.DEBUG):  # a dropped line still costs its call
                log.debug("http_request", **fields)
        else:
            log.info("http_request", **fields)
