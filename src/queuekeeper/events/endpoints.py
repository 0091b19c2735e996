"""Events from the backend (SPEC 5), what became of them, and the outbox's depth."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response, status

from queuekeeper.auth.dependencies import ServiceCaller
from queuekeeper.common.openapi import error_responses
from queuekeeper.events import service
from queuekeeper.events.schemas import (
    EventAccepted,
    EventBatchAccepted,
    EventBatchIn,
    EventDetail,
    EventIn,
    OutboxStats,
)
from queuekeeper.state import SessionDep, SessionsDep, SettingsDep, SignalsDep

internal_router = APIRouter(
    prefix="/api/internal/events", tags=["internal"], dependencies=[ServiceCaller]
)
admin_router = APIRouter(prefix="/api/admin", tags=["admin"], dependencies=[ServiceCaller])

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


@internal_router.post(
    "/",
    status_code=status.HTTP_202_ACCEPTED,
    response_model_exclude_none=True,
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
)
async def publish_event(
    body: EventIn,
    response: Response,
    session: SessionDep,
    sessions: SessionsDep,
    signals: SignalsDep,
    settings: SettingsDep,
    wait: Wait = False,
) -> EventAccepted:
    (answer,) = await service.publish(
        session, sessions, signals, settings, [body], batch=False, wait=wait
    )
    if answer.duplicate or wait:
        response.status_code = status.HTTP_200_OK
    return answer


@internal_router.post(
    "/batch/",
    status_code=status.HTTP_202_ACCEPTED,
    response_model_exclude_none=True,
    summary="Publish a batch of events",
    description="Up to QUEUEKEEPER_EVENTS_BATCH_MAX events, all stored in one transaction or "
    "none; one answer per event, in order.",
    responses={
        **ACCEPT_ERRORS,
        200: {"description": "With `?wait=true`.", "model": EventBatchAccepted},
    },
)
async def publish_batch(
    body: EventBatchIn,
    response: Response,
    session: SessionDep,
    sessions: SessionsDep,
    signals: SignalsDep,
    settings: SettingsDep,
    wait: Wait = False,
) -> EventBatchAccepted:
    answers = await service.publish(
        session, sessions, signals, settings, body.events, batch=True, wait=wait
    )
    if wait:
        response.status_code = status.HTTP_200_OK
    return EventBatchAccepted(events=answers)


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
