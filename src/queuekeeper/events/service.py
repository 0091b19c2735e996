"""Accepting events: validate, store through the intake, and with `?wait=true` wait.

Everything a request accepts is written in the transaction that answers it (the
transactional outbox; `intake.py` lets requests arriving together share one); the
relay publishes from there. Finding the recipients is one query per transaction,
whatever the batch holds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queuekeeper.common.schemas import as_uuid
from queuekeeper.common.signals import Signal
from queuekeeper.events import repository
from queuekeeper.events.intake import Intake
from queuekeeper.events.outbox import field_name
from queuekeeper.events.payloads import IDENTITY_TYPES, PAYLOAD_MODELS
from queuekeeper.events.repository import OutboxDepth
from queuekeeper.events.schemas import DeliveryOut, EventAccepted, EventIn
from queuekeeper.exceptions import BadRequest, NotFound, TooLarge, shown
from queuekeeper.models import DeliveryState, Event, utcnow


def validate_payloads(events: Sequence[EventIn], prefix: str) -> list[dict[str, Any]]:
    """Check each payload against its type's model; returns the message bodies.

    The body is the payload as sent (extra fields kept) plus the envelope's
    `offering_uuid` (hex) and `object_type`, which win over the payload's own.
    """
    errors: list[dict[str, str]] = []
    bodies: list[dict[str, Any]] = []
    for index, event in enumerate(events):
        where = field_name(prefix, index) if prefix else ""
        try:
            PAYLOAD_MODELS[event.object_type].model_validate(event.payload)
        except ValidationError as exc:
            for error in exc.errors():
                loc = [str(part) for part in error["loc"]]
                errors.append(
                    {
                        "field": field_name(where, "payload", *loc),
                        "message": str(error["msg"]).removeprefix("Value error, "),
                    }
                )
        errors.extend(_offering_errors(event, where))
        sent_type = event.payload.get("object_type")
        if sent_type is not None and sent_type != event.object_type:
            errors.append(
                {
                    "field": field_name(where, "payload", "object_type"),
                    "message": f"{sent_type!r} differs from the event's object_type "
                    f"{event.object_type!r}; leave it out or send the same type",
                }
            )
        offerings = event.offerings
        body = {**event.payload, "object_type": event.object_type}
        if offerings:  # a fan-out's copies each get their own offering when published
            body["offering_uuid"] = offerings[0].hex
        bodies.append(body)
    if errors:
        raise BadRequest(
            "; ".join(f"{error['field']}: {error['message']}" for error in errors),
            extra={"errors": errors},
        )
    return bodies


def _offering_errors(event: EventIn, where: str) -> list[dict[str, str]]:
    """Exactly one of `offering_uuid` and `offering_uuids` (or neither, for an identity event
    about `subject_user_uuid`), each offering once, and a payload `offering_uuid` (if any)
    that agrees."""
    if (
        event.offering_uuid is None
        and event.offering_uuids is None
        and event.subject_user_uuid is not None
    ):
        if event.object_type in IDENTITY_TYPES:
            return []
        return [
            {
                "field": field_name(where, "offering_uuid"),
                "message": f"required for {event.object_type!r}: only identity events "
                f"({', '.join(sorted(IDENTITY_TYPES))}) may name subject_user_uuid alone",
            }
        ]
    if (event.offering_uuid is None) == (event.offering_uuids is None):
        return [
            {
                "field": field_name(where, "offering_uuid"),
                "message": "send exactly one of offering_uuid (one offering) and "
                "offering_uuids (several)",
            }
        ]
    errors = []
    offerings = event.offerings
    if len(set(offerings)) != len(offerings):
        errors.append(
            {
                "field": field_name(where, "offering_uuids"),
                "message": "an offering is listed twice",
            }
        )
    sent_offering = event.payload.get("offering_uuid")
    if sent_offering is not None:
        if event.offering_uuids is not None:
            if as_uuid(sent_offering) not in offerings:
                errors.append(
                    {
                        "field": field_name(where, "payload", "offering_uuid"),
                        "message": f"{sent_offering!r} is not one of offering_uuids; leave "
                        "it out: each copy carries the offering of the queue it goes to",
                    }
                )
        elif as_uuid(sent_offering) != event.offering_uuid:
            errors.append(
                {
                    "field": field_name(where, "payload", "offering_uuid"),
                    "message": f"{sent_offering!r} differs from the event's offering_uuid "
                    f"{offerings[0].hex}; leave it out or send the same offering",
                }
            )
    return errors


def check_payload_sizes(events: Sequence[EventIn], limit: int) -> None:
    """Every payload of a batch, as JSON, fits `event_payload_max_bytes`."""
    for index, event in enumerate(events):
        size = len(json.dumps(event.payload, separators=(",", ":")).encode())
        if size > limit:
            raise TooLarge(
                f"events.{index}.payload is {size} bytes of JSON; one event's payload may be "
                f"at most {limit} (setting QUEUEKEEPER_EVENT_PAYLOAD_MAX_BYTES).",
                limit=limit,
                setting="event_payload_max_bytes",
                field=f"events.{index}.payload",
            )


_NOT_YET = (
    "not confirmed by the broker within {limit:g} s (QUEUEKEEPER_EVENTS_WAIT_TIMEOUT); it is "
    "stored and will be delivered: follow it with GET /api/internal/events/{{event_id}}/"
)


async def wait_settled(
    sessions: async_sessionmaker[AsyncSession],
    answers: list[EventAccepted],
    settled: Signal,
    limit: float,
) -> None:
    """Fill each answer's `deliveries` once every copy is settled or `limit` seconds passed.

    Polls the rows (so copies published by another replica count), and wakes
    early when this process's relay settles something.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    event_ids = {answer.event_id for answer in answers}
    interval = 0.02
    while True:
        seen = settled.generation
        async with sessions() as session:
            states = await repository.delivery_states(session, event_ids)
        pending = any(
            state == DeliveryState.PENDING
            for rows in states.values()
            for _name, _vhost, state, _error in rows
        )
        remaining = deadline - loop.time()
        if not pending or remaining <= 0:
            break
        await settled.wait(min(interval, remaining), since=seen)
        interval = min(interval * 1.5, 0.25)
    for answer in answers:
        answer.deliveries = [
            DeliveryOut(
                queue_name=name,
                vhost=vhost,
                state=state,
                # Why a copy is still pending (or was given up): the relay's last failure,
                # or, with none yet, that it was not published within the wait.
                reason=(last_error or _NOT_YET.format(limit=limit))
                if state != DeliveryState.PUBLISHED
                else None,
            )
            for name, vhost, state, last_error in states[answer.event_id]
        ]


async def publish(
    intake: Intake, events: Sequence[EventIn], *, batch: bool, wait: bool
) -> list[EventAccepted]:
    """Accept `events` (a single event, or a batch whose fields are named `events.<i>.…`)
    through the intake, and with `wait` answer once every copy settled.

    The intake carries the accept path's collaborators (settings, sessions, signals): a
    single event at the backend's pace is dominated by the HTTP stack, and each endpoint
    dependency FastAPI resolves per request costs more than the statement it serves.
    """
    settings = intake.settings
    if batch and len(events) > settings.events_batch_max:
        raise BadRequest(
            f"A batch holds at most {settings.events_batch_max} events; this one has "
            f"{len(events)}. Split it into several requests.",
            field="events",
        )
    if batch:
        # A single event's body is bounded by this limit already (auth/guard.py).
        check_payload_sizes(events, settings.event_payload_max_bytes)
    prefix = "events" if batch else ""
    bodies = validate_payloads(events, prefix)
    if not wait:
        return (await intake.accept(events, bodies, prefix)).answers
    signals = intake.signals
    signals.waiting += 1
    try:
        accepted = await intake.accept(events, bodies, prefix)
        await wait_settled(
            intake.sessions, accepted.answers, signals.settled, settings.events_wait_timeout
        )
    finally:
        signals.waiting -= 1
    return accepted.answers


async def event_record(session: AsyncSession, event_id: str) -> tuple[Event, Sequence[Row[Any]]]:
    """An event and its copies, oldest first."""
    event = await repository.get_event(session, event_id)
    if event is None:
        raise NotFound(f"Event {shown(event_id)} not found.")
    return event, await repository.deliveries_of(session, event_id)


async def outbox_depth(session: AsyncSession) -> OutboxDepth:
    return await repository.outbox_depth(session, utcnow())
