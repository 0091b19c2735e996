"""Who may call a route, declared once, on its router.

A router is made with `router(Caller.X, ...)`; every route it holds (and keeps when the app
includes it) is of that caller's route class. The request guard (`auth/guard.py`) and the
OpenAPI document (`common/openapi.py`) read the declaration from the app's routes at start-up,
so where a route lives decides nothing: an admin route outside `/api/admin/` is still a
service route. A route the OpenAPI document shows must declare its caller
(`declared_routes` refuses to start otherwise); the documentation pages and static assets,
which it does not show, are public.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from fastapi import APIRouter
from fastapi.params import Depends
from fastapi.routing import APIRoute, iter_route_contexts
from starlette.routing import BaseRoute

from queuekeeper.common.lean import LeanEndpoint
from queuekeeper.config import Settings


class Caller(enum.Enum):
    PUBLIC = "public"
    AGENT = "agent"
    SERVICE = "service"


@dataclass(frozen=True)
class BodyLimit:
    """A route's largest request body, and how a 413 names the setting behind it."""

    size: Callable[[Settings], int]
    setting: str


DEFAULT_BODY = BodyLimit(lambda settings: settings.body_max_bytes, "body_max_bytes")


@dataclass(frozen=True)
class Intake:
    """What an endpoint adds to its router's declaration: a body limit of its own, whether
    its POSTs are admitted only up to `events_max_in_flight` at once, and a lean endpoint
    tried before FastAPI's (common/lean.py)."""

    body: BodyLimit
    admission: bool = False
    lean: LeanEndpoint | None = None


_INTAKE = "__queuekeeper_intake__"
Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


def intake(
    body: BodyLimit, *, admission: bool = False, lean: LeanEndpoint | None = None
) -> Callable[[Endpoint], Endpoint]:
    """Decorates an endpoint (under its route decorator) with its own `Intake`."""

    def mark(endpoint: Endpoint) -> Endpoint:
        setattr(endpoint, _INTAKE, Intake(body, admission, lean))
        return endpoint

    return mark


def accepts_events(route: object) -> bool:
    """Whether `route` is one of the backend's accept routes (its endpoint's intake is
    admitted): the service's high-volume calls."""
    declared = getattr(getattr(route, "endpoint", None), _INTAKE, None)
    return isinstance(declared, Intake) and declared.admission


_COUNTED = "__queuekeeper_counted__"
_SERVICE_TOO = "__queuekeeper_service_too__"


def rate_limited(endpoint: Endpoint) -> Endpoint:
    """Decorates an agent endpoint (under its route decorator) that is counted against the
    per-token rate limit although it is no POST or PUT (those always are)."""
    setattr(endpoint, _COUNTED, True)
    return endpoint


def service_too(endpoint: Endpoint) -> Endpoint:
    """Decorates an agent endpoint that a service token may call as well (the backend acting
    for any agent): the guard lets that token through, uncounted, to the endpoint's own
    dependency. On other agent routes a service token is refused before the body is read."""
    setattr(endpoint, _SERVICE_TOO, True)
    return endpoint


class CallerRoute(APIRoute):
    caller: ClassVar[Caller]


class PublicRoute(CallerRoute):
    caller = Caller.PUBLIC


class AgentRoute(CallerRoute):
    caller = Caller.AGENT


class ServiceRoute(CallerRoute):
    caller = Caller.SERVICE


_ROUTE_CLASSES: dict[Caller, type[CallerRoute]] = {
    Caller.PUBLIC: PublicRoute,
    Caller.AGENT: AgentRoute,
    Caller.SERVICE: ServiceRoute,
}


def router(caller: Caller, *, dependencies: Sequence[Depends] = (), **kwargs: Any) -> APIRouter:
    """An `APIRouter` whose routes are `caller`'s (`kwargs` as for `APIRouter`)."""
    return APIRouter(route_class=_ROUTE_CLASSES[caller], dependencies=dependencies, **kwargs)


@dataclass(frozen=True)
class Declared:
    path: str
    path_format: str
    methods: frozenset[str]
    caller: Caller
    intake: Intake | None
    rate_limited: bool = False
    service_too: bool = False
    route: BaseRoute | None = None


def declared_routes(routes: Sequence[BaseRoute]) -> list[Declared]:
    """Each route of the app (included routers' routes with their prefixes) with its caller;
    RuntimeError for a documented route that declares none."""
    found: list[Declared] = []
    for context in iter_route_contexts(routes):
        route = context.original_route
        if context.path is None:
            continue  # a mount's own assets (the documentation pages'), which take no caller
        if isinstance(route, CallerRoute):
            caller = route.caller
        elif isinstance(route, APIRoute) and route.include_in_schema:
            raise RuntimeError(
                f"Route {context.path} declares no caller: make its router with "
                "queuekeeper.common.access.router(Caller.…)."
            )
        else:
            caller = Caller.PUBLIC
        found.append(
            Declared(
                context.path,
                context.path_format or context.path,
                frozenset(context.methods or ()),
                caller,
                getattr(context.endpoint, _INTAKE, None),
                bool(getattr(context.endpoint, _COUNTED, False)),
                bool(getattr(context.endpoint, _SERVICE_TOO, False)),
                route,
            )
        )
    return found
