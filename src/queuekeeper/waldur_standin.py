"""A stand-in for Waldur's own API, for trying an agent behind the site proxy
(deploy/nginx/queuekeeper-beside-waldur.conf) with no Waldur behind it: `queuekeeper
waldur-standin` (docs/agents.md).

The proxy sends every path but queuekeeper's to Waldur; with nothing there an agent logs a
502 for every call it makes of Waldur (an order's details, its offering, its processor).
This answers those calls as a Waldur that holds nothing would: a list is empty (200, `[]`,
`X-Result-Count: 0`), anything else is 404 `{"detail": "Not found."}`; the agent then logs
that the order it was told about is not found, and goes on. Each answer carries
`X-Served-By: waldur-standin`, and each request is one log line: what the agent asked of
Waldur. It stores nothing and knows no token.
"""

from __future__ import annotations

import json
import re
from typing import Any

import structlog
from starlette.types import Receive, Scope, Send

log = structlog.get_logger("queuekeeper.waldur_standin")

SERVED_BY = (b"x-served-by", b"waldur-standin")
# The last segment of an object's path: a uuid (hex or dashed), a number, or `me`.
_OBJECT = re.compile(r"[0-9a-fA-F]{32}|[0-9a-fA-F-]{36}|\d+|me")


def answer(method: str, path: str) -> tuple[int, Any]:
    """(status, JSON body) of an empty Waldur for `method` on `path`."""
    segments = [segment for segment in path.split("/") if segment]
    listing = method in ("GET", "HEAD") and segments[:1] == ["api"] and len(segments) >= 2
    if listing and not _OBJECT.fullmatch(segments[-1]):
        return 200, []
    return 404, {"detail": "Not found."}


class WaldurStandIn:
    """The ASGI app; `requests` keeps (method, path) of each request, in order."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # served with lifespan off: nothing to start
            return
        method, path = scope["method"], scope["path"]
        self.requests.append((method, path))
        status, body = answer(method, path)
        log.info("waldur_standin_request", method=method, path=path, status=status)
        headers = [(b"content-type", b"application/json"), SERVED_BY]
        if status == 200:
            headers.append((b"x-result-count", b"0"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})
