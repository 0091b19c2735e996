"""Who is calling: an agent (`Token`/`Bearer` API token) or the backend (service token)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.security import APIKeyHeader
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import Scope

from queuekeeper.auth.repository import user_with_token
from queuekeeper.auth.tokens import is_service_token
from queuekeeper.common.access import Caller, router
from queuekeeper.config import Settings
from queuekeeper.exceptions import Forbidden, Unauthorized
from queuekeeper.models import User
from queuekeeper.state import EngineDep, SessionDep, SettingsDep

# Declared as an API key header so /docs offers an "Authorize" box; parsed by hand
# because agents send `Token <t>` (Waldur's scheme) and the backend `Bearer <t>`.
authorization_header = APIKeyHeader(
    name="Authorization",
    auto_error=False,
    description="Agents: `Token <api token>`. Backend and operators: `Bearer <service token>`.",
)
AuthorizationHeader = Annotated[str | None, Depends(authorization_header)]


AGENT_HEADER = "Authorization: Token <api token>"
SERVICE_HEADER = "Authorization: Bearer <service token>"
NO_SERVICE_TOKEN = (
    "No service token is configured on this server: set QUEUEKEEPER_SERVICE_TOKENS "
    "(comma-separated) and restart it."
)


def credentials(header: str | None, *, service: bool = False) -> str:
    """The token of an `Authorization` header; Unauthorized naming the header the route
    wants (`service`: the backend's and operators' routes) when it is missing or malformed."""
    wanted = SERVICE_HEADER if service else AGENT_HEADER
    scheme_name = "Bearer" if service else "Token"
    if not header:
        raise Unauthorized(
            f"Authentication credentials were not provided: send `{wanted}`.",
            scheme=scheme_name,
        )
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() not in ("token", "bearer") or not token.strip():
        raise Unauthorized(
            f"Malformed Authorization header: expected `{wanted}`.", scheme=scheme_name
        )
    return token.strip()


async def authenticate_agent(engine: AsyncEngine, token: str, settings: Settings) -> User:
    """The active user whose unexpired API token this is, detached; else Unauthorized
    (Forbidden for a service token)."""
    user = await user_with_token(engine, token)
    if user is None:
        if is_service_token(token, settings.service_tokens):
            raise Forbidden("A service token cannot act as an agent; use an agent's API token.")
        raise Unauthorized("Invalid token.")
    if not user.is_active:
        raise Unauthorized("User is inactive.")
    if user.token_expires_at is not None and user.token_expires_at <= datetime.now(UTC):
        raise Unauthorized("Token has expired.")
    return user


async def authenticate_service(engine: AsyncEngine, token: str, settings: Settings) -> None:
    """A configured service token passes; an agent's token is Forbidden, anything else
    Unauthorized."""
    if is_service_token(token, settings.service_tokens):
        return
    if await user_with_token(engine, token) is not None:
        raise Forbidden("This endpoint needs a service token; an agent token is not enough.")
    if not settings.service_tokens:
        raise Unauthorized(f"Invalid service token. {NO_SERVICE_TOKEN}", scheme="Bearer")
    raise Unauthorized(
        f"Invalid service token. Send `{SERVICE_HEADER}` with one of QUEUEKEEPER_SERVICE_TOKENS.",
        scheme="Bearer",
    )


# Where the request guard leaves the user it authenticated (every agent POST and PUT, before
# the body is read), so that `current_agent` does not look the same token up a second time.
_GUARDED_USER = "guarded_user"


def hand_over(scope: Scope, user: User) -> None:
    """Called by the guard once `user` is authenticated for this request."""
    scope.setdefault("state", {})[_GUARDED_USER] = user


async def current_agent(
    request: Request, header: AuthorizationHeader, engine: EngineDep, settings: SettingsDep
) -> User:
    """The calling agent's user, detached: for a route that needs no session."""
    user: User | None = getattr(request.state, _GUARDED_USER, None)
    if user is None:
        user = await authenticate_agent(engine, credentials(header), settings)
    request.state.user_uuid = user.uuid
    return user


CurrentAgent = Annotated[User, Depends(current_agent)]


async def current_user(user: CurrentAgent, session: SessionDep) -> User:
    """The calling agent's user in this request's session, as it was read, without a query."""
    return await session.merge(user, load=False)


async def service_caller(
    header: AuthorizationHeader, engine: EngineDep, settings: SettingsDep
) -> None:
    # Only a refused token needs the database (to say which refusal): the backend's calls,
    # single events at its pace among them, cost no query.
    await authenticate_service(engine, credentials(header, service=True), settings)


async def agent_or_service(
    request: Request,
    header: AuthorizationHeader,
    engine: EngineDep,
    session: SessionDep,
    settings: SettingsDep,
) -> User | None:
    """An agent (its user) or the backend/an operator (None) with a service token."""
    if is_service_token(credentials(header), settings.service_tokens):
        return None
    return await current_user(await current_agent(request, header, engine, settings), session)


CurrentUser = Annotated[User, Depends(current_user)]


def caller_token(header: AuthorizationHeader) -> str:
    """The token the request came with (for what a registration records of it)."""
    return credentials(header)


CallerToken = Annotated[str, Depends(caller_token)]
# None for a service token: routes that show an agent its own things show an operator all.
AgentOrService = Annotated[User | None, Depends(agent_or_service)]
ServiceCaller = Depends(service_caller)


def service_router(**kwargs: Any) -> APIRouter:
    """A router of service routes that also authenticate as a dependency, so the document
    shows what they need (`kwargs` as for `APIRouter`)."""
    return router(Caller.SERVICE, dependencies=[ServiceCaller], **kwargs)
