"""Events from the backend (contract §5), what became of them, and the outbox's depth."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query, Request, Response, status
from starlette.types import Scope

from queuekeeper.admin.routes import admin_router as make_admin_router
from queuekeeper.auth.dependencies import authorization_header, service_router
from queuekeeper.common import lean
from queuekeeper.common.access import BodyLimit, Caller, intake, router
from queuekeeper.common.input_guard import refuse, unstorable_body
from queuekeeper.common.openapi import error_responses
from queuekeeper.events import service
from queuekeeper.events.intake import Intake
from queuekeeper.events.schemas import (
    EventAccepted,
    EventBatchAccepted,
    EventBatchIn,
    EventDetail,
    EventIn,
    OutboxStats,
)
from queuekeeper.state import SessionDep

internal_router = service_router(prefix="/api/internal/events", tags=["internal"])
# The backend's two accept routes run no FastAPI dependency: a single event at the backend's
# pace is dominated by the HTTP stack, and each dependency FastAPI solves per request costs
# more than the statement it serves (docs/decisions/013-lean-accept-routes.md). The request
# guard authenticates them before the body is read, as it does every service route
# (auth/guard.py), and serves them on the lean path first (common/lean.py,
# docs/decisions/017-single-event-cost.md); FastAPI's route answers what the lean path
# leaves to it (every refusal of the body or the query). Both check for input no database
# can take, and encode their answer once, with pydantic.
# app.py includes this router first, so its routes are also the first the router tries.
accept_router = router(Caller.SERVICE, prefix="/api/internal/events", tags=["internal"])
SERVICE_SECURITY: dict[str, Any] = {"security": [{authorization_header.scheme_name: []}]}
admin_router = make_admin_router()
# Room for an event's envelope (event_id, offering_uuid, object_type, user_uuids) beside
# its payload.
ENVELOPE_BYTES = 4096
EVENT_BODY = BodyLimit(
    lambda settings: settings.event_payload_max_bytes + ENVELOPE_BYTES,
    "event_payload_max_bytes (+ 4 KiB for the envelope)",
)
BATCH_BODY = BodyLimit(
    lambda settings: (
        settings.events_batch_max * (settings.event_payload_max_bytes + ENVELOPE_BYTES)
    ),
    "events_batch_max * (event_payload_max_bytes + 4 KiB)",
)


def _intake(scope: Scope) -> Intake:
    accepting: Intake = scope["app"].state.queuekeeper.intake
    return accepting


AUTH_ERRORS: dict[int | str, dict[str, Any]] = error_responses(
    401,
    403,
    503,
    descriptions={
        401: "No or unknown service token.",
        403: "An agent token was sent.",
        503: "The database is unavailable; nothing was stored. Retry.",
    },
)
ACCEPT_ERRORS: dict[int | str, dict[str, Any]] = {
    **AUTH_ERRORS,
    **error_responses(
        400,
        descriptions={
            400: "A bad event: unknown offering or object type, a payload missing a field its "
            "type requires, a payload contradicting the envelope. `errors` names each field "
            "(`events.<index>.…` in a batch); nothing of the request was stored."
        },
    ),
}
Wait = Annotated[
    bool,
    Query(
        description="Answer only when every copy is confirmed by the broker or has failed "
        "(or QUEUEKEEPER_EVENTS_WAIT_TIMEOUT passed), with the state of each copy."
    ),
]


def _answer(answer: EventAccepted | EventBatchAccepted, *, ok: bool) -> Response:
    return Response(
        answer.model_dump_json(exclude_none=True),
        status_code=status.HTTP_200_OK if ok else status.HTTP_202_ACCEPTED,
        media_type="application/json",
    )


async def _publish_event(scope: Scope, raw: bytes, body: EventIn, wait: bool) -> Response:
    refuse(unstorable_body(raw))
    (answer,) = await service.publish(_intake(scope), [body], batch=False, wait=wait)
    return _answer(answer, ok=answer.duplicate or wait)


async def _lean_publish_event(scope: Scope, raw: bytes) -> Response | None:
    wait, body = lean.flag(scope, "wait"), lean.parsed(scope, raw, EventIn)
    if wait is None or body is None:
        return None
    return await _publish_event(scope, raw, body, wait)


async def _publish_batch(scope: Scope, raw: bytes, body: EventBatchIn, wait: bool) -> Response:
    refuse(unstorable_body(raw))
    answers = await service.publish(_intake(scope), body.events, batch=True, wait=wait)
    return _answer(EventBatchAccepted(events=answers), ok=wait)


async def _lean_publish_batch(scope: Scope, raw: bytes) -> Response | None:
    wait, body = lean.flag(scope, "wait"), lean.parsed(scope, raw, EventBatchIn)
    if wait is None or body is None:
        return None
    return await _publish_batch(scope, raw, body, wait)


@accept_router.post(
    "/",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=EventAccepted,
    summary="Publish an event",
    description="Stores the event and one outbox copy per recipient queue (the registered "
    "queues for its offering and object type whose owner has access, narrowed to "
    "`user_uuids`) in one transaction, then answers 202; the relay publishes the copies. "
    "A repeated `event_id` answers 200 with `duplicate: true` and the first answer's counts, "
    "and sends nothing again.",
    responses={
        **ACCEPT_ERRORS,
        200: {"description": "A duplicate, or `?wait=true`.", "model": EventAccepted},
    },
    openapi_extra=SERVICE_SECURITY,
)
@intake(EVENT_BODY, admission=True, lean=_lean_publish_event)
async def publish_event(request: Request, body: EventIn, wait: Wait = False) -> Response:
    return await _publish_event(request.scope, await request.body(), body, wait)


@accept_router.post(
    "/batch/",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=EventBatchAccepted,
    summary="Publish a batch of events",
    description="Up to QUEUEKEEPER_EVENTS_BATCH_MAX events, all stored in one transaction or "
    "none; one answer per event, in order.",
    responses={
        **ACCEPT_ERRORS,
        200: {"description": "With `?wait=true`.", "model": EventBatchAccepted},
    },
    openapi_extra=SERVICE_SECURITY,
)
@intake(BATCH_BODY, admission=True, lean=_lean_publish_batch)
async def publish_batch(request: Request, body: EventBatchIn, wait: Wait = False) -> Response:
    return await _publish_batch(request.scope, await request.body(), body, wait)


@internal_router.get(
    "/{event_id}/",
    summary="What became of an event",
    description="The event, its message body, and every copy's state (`pending`, "
    "`published` = confirmed by the broker, `rejected` = queue full and dead-lettered, "
    "`given_up` with the reason in `last_error`).",
    responses={
        **AUTH_ERRORS,
        **error_responses(404, descriptions={404: "No such event (or pruned)."}),
    },
)
async def get_event(event_id: str, session: SessionDep) -> EventDetail:
    event, deliveries = await service.event_record(session, event_id)
    return EventDetail.from_row(event, deliveries)


@admin_router.get(
    "/outbox/",
    summary="Outbox depth",
    description="Copies waiting to be published, how many a relay holds right now, and the "
    "age of the oldest (also exported as queuekeeper_outbox_* metrics).",
    responses=AUTH_ERRORS,
)
async def outbox(session: SessionDep) -> OutboxStats:
    return OutboxStats.from_row(await service.outbox_depth(session))
