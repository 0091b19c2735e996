"""Serve under a path prefix (QUEUEKEEPER_ROOT_PATH) whether or not a proxy strips it.

waldur-site-agent derives its REST base from its configured URL with
`rstrip("/api")`, so `https://h/qk/api/` sends requests to `/qk/api/...`. A
proxy in front may forward that path as it is, or strip `/qk`. Both must reach
the same routes, so every request is brought to Starlette's canonical form (the
path includes the prefix, `root_path` names it); routing then strips it, and the
URLs we build (pagination `Link` headers, `/docs`) carry it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class PathPrefixMiddleware:
    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app = app
        self.prefix = prefix.rstrip("/")
        self.raw_prefix = self.prefix.encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self.prefix:
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if not (path == self.prefix or path.startswith(self.prefix + "/")):
            # The proxy stripped the prefix (or there is no proxy): put it back.
            scope = dict(scope)
            scope["path"] = self.prefix + path
            raw_path = scope.get("raw_path")
            if raw_path is not None:
                scope["raw_path"] = self.raw_prefix + raw_path
        else:
            scope = dict(scope)
        scope["root_path"] = self.prefix
        await self.app(scope, receive, send)
