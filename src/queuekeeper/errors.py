"""Errors the API answers with, and the handlers that turn them into JSON.

Every body has `detail` in words a person can act on; validation errors also
list each offending field. Nothing reaches a 500: a dependency that is down is
a 503 with `Retry-After`.
"""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from queuekeeper.broker.management import BrokerUnavailable, ManagementError, UnsafeName
from queuekeeper.broker.provisioner import ForeignVhost, QueueConflict
from queuekeeper.config import Settings
from queuekeeper.exceptions import (
    BadRequest,
    Conflict,
    DomainError,
    Forbidden,
    NotFound,
    RateLimited,
    TooLarge,
    Unauthorized,
    Unavailable,
)

log = structlog.get_logger(__name__)


# Each domain error's status; a subclass takes its nearest listed ancestor's.
STATUS: dict[type[DomainError], int] = {
    BadRequest: 400,
    Unauthorized: 401,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    TooLarge: 413,
    RateLimited: 429,
    Unavailable: 503,
}

# A validation error names the field and says what is wrong; it never echoes a huge input
# back (a 2 MB field once answered with a 4 MB body): long messages are cut, and only the
# first errors of a list with thousands of bad items are listed.
MESSAGE_MAX_CHARS = 300
ERRORS_LISTED = 20


def status_of(exc: DomainError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 400


def _field_name(location: tuple[Any, ...]) -> str:
    parts = [str(part) for part in location if part not in ("body", "query", "path", "header")]
    return ".".join(parts) or str(location[-1] if location else "body")


def _validation_message(error: dict[str, Any]) -> str:
    message = str(error.get("msg", "invalid value"))
    # pydantic prefixes custom errors with "Value error, "; the rest reads well alone.
    return truncated(message.removeprefix("Value error, "))


def truncated(text: str, limit: int = MESSAGE_MAX_CHARS) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… (truncated; {len(text)} characters)"


def domain_error_response(exc: DomainError, retry_after_seconds: int) -> JSONResponse:
    """The one mapping of a domain error to HTTP (also used by middleware that answers
    before the app runs)."""
    status = status_of(exc)
    headers: dict[str, str] | None = None
    if isinstance(exc, Unauthorized):
        headers = {"WWW-Authenticate": exc.scheme}
    elif isinstance(exc, RateLimited):
        headers = {"Retry-After": str(exc.retry_after)}
    elif status == 503:
        headers = {"Retry-After": str(retry_after_seconds)}
    return JSONResponse(exc.body(), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, settings: Settings) -> None:
    retry_after = {"Retry-After": str(settings.retry_after_seconds)}

    @app.exception_handler(DomainError)
    async def _domain_error(_request: Request, exc: DomainError) -> JSONResponse:
        return domain_error_response(exc, settings.retry_after_seconds)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        found = exc.errors()
        errors = [
            {
                "field": truncated(_field_name(tuple(error.get("loc", ())))),
                "message": _validation_message(error),
            }
            for error in found[:ERRORS_LISTED]
        ]
        detail = "; ".join(f"{error['field']}: {error['message']}" for error in errors)
        if len(found) > ERRORS_LISTED:
            detail += f"; and {len(found) - ERRORS_LISTED} more errors"
        return JSONResponse({"detail": detail or "invalid request", "errors": errors}, 400)

    @app.exception_handler(UnsafeName)
    async def _unsafe_name(_request: Request, exc: UnsafeName) -> JSONResponse:
        # Names come from our own rows or are checked first; this is the last line only.
        return JSONResponse({"detail": f"Refused before reaching RabbitMQ: {exc}"}, 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            path = request.url.path
            # No redirect (agents do not follow them): say what to send instead, and
            # suggest a slash only to a path that lacks one.
            detail = (
                f"No such endpoint: {path}. Paths end with a slash: did you mean {path}/ ?"
                if not path.endswith("/")
                else f"No such endpoint: {path}."
            )
        return JSONResponse({"detail": detail}, exc.status_code, headers=exc.headers)

    @app.exception_handler(QueueConflict)
    async def _queue_conflict(_request: Request, exc: QueueConflict) -> JSONResponse:
        return JSONResponse(
            {
                "detail": exc.reason,
                "queue_name": exc.name,
                "vhost": exc.vhost,
                "action": "The queue holds messages or has consumers, so queuekeeper will not "
                "delete it. Drain it (or stop its consumers), then delete it with "
                "`rabbitmqctl delete_queue` or the Management UI and call create_queue again.",
            },
            409,
        )

    @app.exception_handler(ForeignVhost)
    async def _foreign_vhost(_request: Request, exc: ForeignVhost) -> JSONResponse:
        return JSONResponse(
            {
                "detail": f"vhost {exc.vhost!r} exists on the broker but is not tagged "
                f"{settings.instance_tag!r}, so this queuekeeper will not use it "
                f"(its tags: {exc.tags}). Delete it or tag it, then retry.",
            },
            409,
        )

    @app.exception_handler(BrokerUnavailable)
    async def _broker_down(_request: Request, exc: BrokerUnavailable) -> JSONResponse:
        log.warning("broker_unavailable", error=str(exc))
        return JSONResponse(
            {"detail": f"RabbitMQ is unavailable, nothing was changed; retry later. ({exc})"},
            503,
            headers=retry_after,
        )

    @app.exception_handler(ManagementError)
    async def _broker_refused(_request: Request, exc: ManagementError) -> JSONResponse:
        # A refusal we did not anticipate: the broker's state is not what we
        # expect, which is a dependency problem, not the caller's fault.
        log.error("broker_refused", error=str(exc), reason=exc.reason, status=exc.status)
        return JSONResponse(
            {"detail": f"RabbitMQ refused the change: {exc.reason or exc}"},
            503,
            headers=retry_after,
        )

    async def _database_down(_request: Request, exc: Exception) -> JSONResponse:
        log.error("database_unavailable", error=str(exc)[:500])
        return JSONResponse(
            {"detail": "The database is unavailable; retry later."}, 503, headers=retry_after
        )

    for exc_type in (OperationalError, DBAPIError, PoolTimeout, ConnectionError, OSError):
        app.add_exception_handler(exc_type, _database_down)
