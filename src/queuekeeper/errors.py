"""Errors the API answers with, and the handlers that turn them into JSON.

Every body has `detail` in words a person can act on; validation errors also
list each offending field. A dependency that is really down (the database or
RabbitMQ unreachable) is a 503 with `Retry-After`; a value the database cannot take
is a 400, never a 503 (`classify_database_error`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
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
    capped,
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
# An unknown path is quoted whole up to this length (a route's path plus a uuid or two).
PATH_SHOWN_CHARS = 200


def status_of(exc: DomainError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 400


def _field_name(location: tuple[Any, ...]) -> str:
    parts = [str(part) for part in location if part not in ("body", "query", "path", "header")]
    return ".".join(parts) or str(location[-1] if location else "body")


JSON_MEDIA = "application/json"
SEND_JSON = f"send JSON with Content-Type: {JSON_MEDIA}"


def _body_not_json(request: Request, errors: Sequence[Any]) -> str | None:
    """The whole body was not a JSON object: say what to send, once, instead of pydantic's
    words (or, for malformed JSON, a character offset reported as the field name)."""
    if len(errors) != 1:
        return None
    error = errors[0]
    location = tuple(error.get("loc", ()))
    if error.get("type") == "json_invalid":
        at = location[1] if len(location) > 1 else "?"
        reason = (error.get("ctx") or {}).get("error", "invalid JSON")
        return f"The body is not valid JSON ({reason} at character {at}): {SEND_JSON}."
    if location != ("body",) or error.get("type") not in ("model_attributes_type", "dict_type"):
        return None
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media == JSON_MEDIA:
        return f"The body must be a JSON object: {SEND_JSON}."
    return f"The body is {media or 'not declared (no Content-Type)'}: {SEND_JSON}."


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
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        found = exc.errors()
        body_error = _body_not_json(request, found)
        if body_error is not None:
            return JSONResponse(
                {"detail": body_error, "errors": [{"field": "body", "message": body_error}]}, 400
            )
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
            # suggest a slash only to a path that lacks one (and is short enough to quote).
            detail = (
                f"No such endpoint: {path}. Paths end with a slash: did you mean {path}/ ?"
                if not path.endswith("/") and len(path) <= PATH_SHOWN_CHARS
                else f"No such endpoint: {capped(path, PATH_SHOWN_CHARS)}."
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
                "detail": f"vhost {exc.vhost!r} exists on the broker but is not this "
                f"installation's: {exc.reason}. This queuekeeper will not use it "
                "(docs/howto/backup-and-restore.md, One instance name per installation).",
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

    async def _database_error(request: Request, exc: Exception) -> JSONResponse:
        return database_error_response(request, exc, settings.retry_after_seconds)

    for exc_type in DATABASE_ERRORS:
        app.add_exception_handler(exc_type, _database_error)


# What a failed statement or connection raises (an integer too large for the driver can
# surface as Python's OverflowError): `database_error_response` answers each.
DATABASE_ERRORS = (DBAPIError, PoolTimeout, OSError, OverflowError)


def database_error_response(
    request: Request, exc: Exception, retry_after_seconds: int
) -> JSONResponse:
    """The one mapping of a database error to HTTP (also used by the request guard, which
    looks tokens up before the app runs): 503 down, 400 a value it refuses, 409 a
    conflict, 500 a bug."""
    kind = classify_database_error(exc)
    if kind is DatabaseProblem.BAD_VALUE:
        log.info("database_refused_value", error=str(exc).splitlines()[0][:300])
        fields = _suspect_parameters(request)
        detail = (
            "A value in the request cannot be stored or compared by the database "
            "(a number out of range, a NUL character, NaN or Infinity)"
        )
        body: dict[str, Any] = {"detail": detail + "."}
        if fields:
            body["detail"] = f"{detail}: {', '.join(fields)}."
            body["errors"] = [{"field": field, "message": detail} for field in fields]
        return JSONResponse(body, 400)
    if kind is DatabaseProblem.CONFLICT:
        log.warning("database_conflict", error=str(exc).splitlines()[0][:300])
        return JSONResponse(
            {"detail": "The change conflicts with a concurrent one; retry the request."}, 409
        )
    if kind is DatabaseProblem.UNREACHABLE:
        log.error("database_unavailable", error=str(exc)[:500])
        return JSONResponse(
            {"detail": "The database is unavailable; retry later."},
            503,
            headers={"Retry-After": str(retry_after_seconds)},
        )
    log.exception("database_error", exc_info=exc)
    return JSONResponse({"detail": "Internal error (database); it was logged."}, 500)


class DatabaseProblem(enum.Enum):
    UNREACHABLE = "unreachable"  # 503 with Retry-After: retrying later can succeed
    BAD_VALUE = "bad_value"  # 400: the same request will always fail
    CONFLICT = "conflict"  # 409: a constraint, e.g. a concurrent insert of the same key
    OTHER = "other"  # 500: a bug (a wrong statement); logged with its traceback


# PostgreSQL SQLSTATE classes: 08 connection exception, 53 insufficient resources,
# 57 operator intervention (shutdown, cannot connect now), 58 system error (I/O).
_UNREACHABLE_CLASSES = frozenset({"08", "53", "57", "58"})


def _causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain and len(chain) < 8:
        chain.append(current)
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
    return chain


def classify_database_error(exc: BaseException) -> DatabaseProblem:
    """Whether a database error means "down, retry later" or "this value cannot be stored".

    A connection that is refused, closed, timed out or invalidated, a full pool and a
    server shutting down are UNREACHABLE. A value the database refuses (SQLSTATE class 22:
    an integer beyond int64, a NUL character in text, NaN in JSON; the driver's own
    "invalid input for query argument", an OverflowError beneath it) is BAD_VALUE.
    """
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return DatabaseProblem.UNREACHABLE
    for cause in _causes(exc):
        if isinstance(cause, PoolTimeout | OSError):
            return DatabaseProblem.UNREACHABLE
        sqlstate = getattr(cause, "sqlstate", None)
        if isinstance(sqlstate, str) and len(sqlstate) == 5:
            if sqlstate[:2] == "22":
                return DatabaseProblem.BAD_VALUE
            if sqlstate[:2] in ("23", "40"):  # a constraint; a deadlock or serialization
                return DatabaseProblem.CONFLICT
            if sqlstate[:2] in _UNREACHABLE_CLASSES:
                return DatabaseProblem.UNREACHABLE
        if isinstance(cause, OverflowError):
            return DatabaseProblem.BAD_VALUE
        if type(cause).__name__ in _DRIVER_CONNECTION_ERRORS:
            return DatabaseProblem.UNREACHABLE
    if isinstance(exc, OperationalError):
        return DatabaseProblem.UNREACHABLE
    return DatabaseProblem.OTHER


# asyncpg's client-side errors for a connection that went away carry no SQLSTATE.
_DRIVER_CONNECTION_ERRORS = frozenset(
    {"ConnectionDoesNotExistError", "ConnectionFailureError", "InterfaceError"}
)

_INT64_MAX = 2**63 - 1
_NOT_FINITE = frozenset({"nan", "inf", "-inf", "infinity", "-infinity"})


def _suspect_parameters(request: Request) -> list[str]:
    """Query parameters that hold a value a database refuses (the body was consumed)."""
    suspects = []
    for name, value in request.query_params.multi_items():
        text = value.strip()
        too_big = text.lstrip("+-").isdigit() and abs(int(text)) > _INT64_MAX
        if too_big or "\x00" in value or text.lower() in _NOT_FINITE:
            suspects.append(name)
    return sorted(set(suspects))
