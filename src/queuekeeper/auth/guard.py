"""Authenticate and bound a request before its body is read (pure ASGI).

FastAPI reads and parses a body before it runs the dependencies that authenticate: four
concurrent 63 MB POSTs without credentials once took the service from 509 to 1,401 MiB
and stalled every request for 3 s. So, in front of the app:

* every call to a service route, and a request with a body to an agent's route, is
  authenticated here first (the same functions as the dependencies: a service token needs
  no database, an agent token one indexed lookup); the agents' registration calls are also
  counted against the per-token rate limit here, so a refused call costs nothing more;
* a `Content-Length` over the route's limit is a 413 before anything is read;
* a body without one (chunked) is counted as it streams, and refused at the limit;
* the backend's accept routes are admitted up to `events_max_in_flight` requests at once;
  past it a request is a 503 with Retry-After before its body is read. Past capacity the
  excess is then refused in microseconds, where it would otherwise slow every request
  down (measured: the service's own part of an answer reached 0.3-0.4 s at 600-1,500/s
  offered with 128 client connections; docs/decisions/005-group-commit.md).

Which caller a route wants, its body limit and whether it is admitted are what its router
declares (`common/access.py`), read from the app's routes at start-up; never its path.

The guard hands the agent it authenticated to the `current_agent` dependency, which then
needs no second lookup; a request the guard did not authenticate (an agent's GET) is
authenticated by the dependency. The backend's two accept routes have no dependency: this
guard is their authentication.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.routing import BaseRoute, Match, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from queuekeeper.auth.dependencies import (
    authenticate_agent,
    authenticate_service,
    credentials,
    hand_over,
)
from queuekeeper.auth.ratelimit import RegistrationLimiter
from queuekeeper.auth.tokens import is_service_token, token_digest
from queuekeeper.common import lean
from queuekeeper.common.access import DEFAULT_BODY, Caller, declared_routes
from queuekeeper.common.lean import LeanEndpoint
from queuekeeper.config import Settings
from queuekeeper.errors import DATABASE_ERRORS, database_error_response, domain_error_response
from queuekeeper.exceptions import DomainError, TooLarge, Unavailable

REGISTRATION_METHODS = frozenset({"POST", "PUT"})


@dataclass(frozen=True)
class Policy:
    caller: Caller
    limit: int
    setting: str
    # An agent's registration call (every agent POST/PUT): rate limited per token.
    registration: bool = False
    # The backend's accept routes: admitted up to `events_max_in_flight` at once.
    admission: bool = False
    # An agent route that a service token may call too (`access.service_too`).
    service_too: bool = False
    # The accept routes' lean endpoint and the route it serves (common/lean.py).
    lean: LeanEndpoint | None = None
    route: BaseRoute | None = None


class Policies:
    """Each route's policy, from what its router declares (`common/access.py`), built once
    from the app's routes. A path without parameters is one dict lookup (the accept routes
    among them); the others are matched in the router's order."""

    def __init__(self, routes: list[BaseRoute], settings: Settings) -> None:
        self.default = Policy(Caller.PUBLIC, DEFAULT_BODY.size(settings), DEFAULT_BODY.setting)
        self.exact: dict[tuple[str, str], Policy] = {}
        self.patterned: list[tuple[re.Pattern[str], dict[str, Policy]]] = []
        for found in declared_routes(routes):
            body = found.intake.body if found.intake is not None else DEFAULT_BODY
            admitted = found.intake is not None and found.intake.admission
            by_method = {
                method: Policy(
                    found.caller,
                    body.size(settings),
                    body.setting,
                    registration=found.caller is Caller.AGENT
                    and (method in REGISTRATION_METHODS or found.rate_limited),
                    admission=admitted and method == "POST",
                    service_too=found.service_too,
                    lean=found.intake.lean if found.intake and method == "POST" else None,
                    route=found.route,
                )
                for method in found.methods
            }
            by_method[""] = Policy(found.caller, body.size(settings), body.setting)
            if "{" in found.path:
                self.patterned.append((compile_path(found.path)[0], by_method))
            else:
                for method, rule in by_method.items():
                    self.exact.setdefault((found.path, method), rule)

    def __call__(self, path: str, method: str) -> Policy:
        rule = self.exact.get((path, method)) or self.exact.get((path, ""))
        if rule is not None:
            return rule
        for pattern, by_method in self.patterned:
            if pattern.match(path):
                return by_method.get(method) or by_method[""]
        return self.default


def too_large(policy: Policy, size: int | None) -> TooLarge:
    told = f" ({size} bytes)" if size is not None else ""
    return TooLarge(
        f"The request body{told} is over this route's limit of {policy.limit} bytes "
        f"(setting {policy.setting}).",
        limit=policy.limit,
        setting=policy.setting,
    )


def _content_length(headers: Headers) -> int | None:
    value = headers.get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None  # the server refuses it before we are called


def _routed(scope: Scope) -> bool:
    """Whether a route takes the request: asked only where the answer changes what the guard
    does (a refusal, the rate limit, a streamed body), so an accepted call, single events
    among them, does not match every route twice."""
    routes = scope["app"].router.routes
    return any(route.matches(scope)[0] is Match.FULL for route in routes)


def _answered_for(scope: Scope, rule: Policy) -> None:
    """Name the route of a request the guard answers itself, as the router names those it
    routes (the route the policy was declared by, found by the route's own path pattern):
    the HTTP metrics and the access line label it by its template, not `unmatched`."""
    if rule.route is not None:
        scope["route"] = rule.route


class RequestGuard:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.limiter = RegistrationLimiter(settings.registration_rate_limit)
        self.accepting = 0  # accept requests admitted and not yet answered
        self.policies: Policies | None = None

    def _policies(self, scope: Scope) -> Policies:
        # Built at start-up from the app's routes (app.py's lifespan has checked that each
        # declares its caller), or at the first request where no lifespan ran.
        if self.policies is None:
            self.policies = Policies(scope["app"].router.routes, self.settings)
        return self.policies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan" and self.policies is None:
                # At start-up; a route that declares no caller is the lifespan's to report.
                with contextlib.suppress(RuntimeError):
                    self._policies(scope)
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        root_path: str = scope.get("root_path", "")
        if root_path and path.startswith(root_path):
            path = path[len(root_path) :]
        rule = self._policies(scope)(path, scope["method"])
        if not rule.admission:
            await self._guard(scope, receive, send, rule)
            return
        limit = self.settings.events_max_in_flight
        if self.accepting >= limit:
            refused = Unavailable(
                f"The service is handling {limit} accept requests already (setting "
                "events_max_in_flight); nothing of this request was read or stored. Retry."
            )
            _answered_for(scope, rule)
            await domain_error_response(refused, self.settings.retry_after_seconds)(
                scope, receive, send
            )
            return
        self.accepting += 1
        try:
            await self._guard(scope, receive, send, rule)
        finally:
            self.accepting -= 1

    async def _guard(self, scope: Scope, receive: Receive, send: Send, rule: Policy) -> None:
        headers = Headers(scope=scope)
        length = _content_length(headers)
        streamed = "transfer-encoding" in headers
        try:
            # Every service call (the accept routes rely on it: they run no dependency),
            # and an agent's call with a body or counted against the rate limit.
            if rule.caller is Caller.SERVICE or (
                rule.caller is Caller.AGENT and (rule.registration or streamed or (length or 0) > 0)
            ):
                await self._authenticate(scope, headers, rule)
            if length is not None and length > rule.limit:
                raise too_large(rule, length)
        except DomainError as exc:
            if not _routed(scope):
                # No such route: the router's 404 (or 405) reads no body, and says what to send.
                await self.app(scope, receive, send)
                return
            _answered_for(scope, rule)
            response = domain_error_response(exc, self.settings.retry_after_seconds)
            await response(scope, receive, send)
            return
        except DATABASE_ERRORS as exc:
            # Raised here, outside the app, its exception handlers would not see it.
            _answered_for(scope, rule)
            failed = database_error_response(Request(scope), exc, self.settings.retry_after_seconds)
            await failed(scope, receive, send)
            return
        if length is not None and not streamed and rule.lean is not None and rule.route:
            await lean.serve(rule.lean, rule.route, self.app, scope, receive, send)
            return
        if (length is not None and not streamed) or not _routed(scope):
            # The server delivers no more than Content-Length bytes; an unknown route reads none.
            await self.app(scope, receive, send)
            return
        await _CountedBody(self.app, rule, self.settings)(scope, receive, send)

    async def _authenticate(self, scope: Scope, headers: Headers, rule: Policy) -> None:
        token = credentials(headers.get("authorization"), service=rule.caller is Caller.SERVICE)
        if rule.caller is Caller.SERVICE and is_service_token(token, self.settings.service_tokens):
            return  # the backend's calls, single events among them, cost no session
        if rule.service_too and is_service_token(token, self.settings.service_tokens):
            return  # the backend acting for any agent: not counted against an agent's limit
        engine: AsyncEngine = scope["app"].state.queuekeeper.engine
        if rule.caller is Caller.SERVICE:
            await authenticate_service(engine, token, self.settings)
            return
        hand_over(scope, await authenticate_agent(engine, token, self.settings))
        if rule.registration and _routed(scope):
            await self.limiter.hit(token_digest(token))


class _CountedBody:
    """Counts a streamed body; at the limit the app sees a disconnect and the caller a 413
    in place of whatever the app answers."""

    def __init__(self, app: ASGIApp, rule: Policy, settings: Settings) -> None:
        self.app, self.rule, self.settings = app, rule, settings
        self.received = 0
        self.exceeded = False
        self.refused = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted_receive() -> Message:
            if self.exceeded:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
                if self.received > self.rule.limit:
                    self.exceeded = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not self.exceeded:
                await send(message)
            elif message["type"] == "http.response.start":
                await self._refuse(scope, receive, send)

        await self.app(scope, counted_receive, guarded_send)
        if self.exceeded:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.refused:
            return
        self.refused = True
        response = domain_error_response(
            too_large(self.rule, None), self.settings.retry_after_seconds
        )
        await response(scope, receive, send)
