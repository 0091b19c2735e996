"""Accepting events: validate, find the recipients, write the event and its outbox rows.

Everything a request accepts is written in the one transaction that answers
it (the transactional outbox); the relay publishes from there. Finding the
recipients is one query for the whole request, whatever the batch holds.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from pydantic import ValidationError
from sqlalchemy import Row
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queuekeeper.common.schemas import as_uuid
from queuekeeper.common.signals import OutboxSignals, Signal
from queuekeeper.config import Settings
from queuekeeper.events import outbox, repository
from queuekeeper.events.outbox import OutboxDepth
from queuekeeper.events.payloads import PAYLOAD_MODELS
from queuekeeper.events.recipients import Recipients, find_recipients
from queuekeeper.events.schemas import DeliveryOut, EventAccepted, EventIn
from queuekeeper.exceptions import BadRequest, NotFound, TooLarge
from queuekeeper.models import DeliveryState, Event, utcnow
from queuekeeper.observability.metrics import (
    COPIES,
    EVENTS_ACCEPTED,
    EVENTS_DUPLICATE,
    SKIPPED_UNREGISTERED,
)

log = structlog.get_logger(__name__)

# A concurrent deletion of a recipient queue makes the insert fail its foreign key:
# the recipients are looked up again, this many times at most.
_ATTEMPTS = 3


def _field(prefix: str, *parts: object) -> str:
    return ".".join([prefix, *(str(part) for part in parts)] if prefix else map(str, parts))


def validate_payloads(events: Sequence[EventIn], prefix: str) -> list[dict[str, Any]]:
    """Check each payload against its type's model; returns the message bodies.

    The body is the payload as sent (extra fields kept) plus the envelope's
    `offering_uuid` (hex) and `object_type`, which win over the payload's own.
    """
    errors: list[dict[str, str]] = []
    bodies: list[dict[str, Any]] = []
    for index, event in enumerate(events):
        where = _field(prefix, index) if prefix else ""
        try:
            PAYLOAD_MODELS[event.object_type].model_validate(event.payload)
        except ValidationError as exc:
            for error in exc.errors():
                loc = [str(part) for part in error["loc"]]
                errors.append(
                    {
                        "field": _field(where, "payload", *loc),
                        "message": str(error["msg"]).removeprefix("Value error, "),
                    }
                )
        sent_offering = event.payload.get("offering_uuid")
        if sent_offering is not None and as_uuid(sent_offering) != event.offering_uuid:
            errors.append(
                {
                    "field": _field(where, "payload", "offering_uuid"),
                    "message": f"{sent_offering!r} differs from the event's offering_uuid "
                    f"{event.offering_uuid.hex}; leave it out or send the same offering",
                }
            )
        sent_type = event.payload.get("object_type")
        if sent_type is not None and sent_type != event.object_type:
            errors.append(
                {
                    "field": _field(where, "payload", "object_type"),
                    "message": f"{sent_type!r} differs from the event's object_type "
                    f"{event.object_type!r}; leave it out or send the same type",
                }
            )
        bodies.append(
            {
                **event.payload,
                "offering_uuid": event.offering_uuid.hex,
                "object_type": event.object_type,
            }
        )
    if errors:
        raise BadRequest(
            "; ".join(f"{error['field']}: {error['message']}" for error in errors),
            extra={"errors": errors},
        )
    return bodies


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


@dataclass
class Accepted:
    answers: list[EventAccepted]
    new_deliveries: int


async def accept(
    session: AsyncSession, events: Sequence[EventIn], *, field_prefix: str
) -> Accepted:
    """Validate and store `events` in one transaction; one answer per event, in order."""
    bodies = validate_payloads(events, field_prefix)
    offerings = {event.offering_uuid for event in events}
    for attempt in range(_ATTEMPTS):
        try:
            return await _store(session, events, bodies, offerings, field_prefix)
        except IntegrityError:
            await session.rollback()
            if attempt + 1 == _ATTEMPTS:
                raise
            log.info("event_recipients_changed_retrying", attempt=attempt + 1)
    raise AssertionError("unreachable")  # pragma: no cover


async def _store(
    session: AsyncSession,
    events: Sequence[EventIn],
    bodies: list[dict[str, Any]],
    offerings: set[uuid.UUID],
    field_prefix: str,
) -> Accepted:
    now = utcnow()
    recipient_index = await find_recipients(
        session, offerings, {event.object_type for event in events}, now
    )
    for index, event in enumerate(events):
        if event.offering_uuid not in recipient_index.known:
            raise BadRequest(
                f"Unknown offering {event.offering_uuid.hex}: the backend has not pushed it.",
                field=_field(field_prefix, index, "offering_uuid")
                if field_prefix
                else "offering_uuid",
            )

    event_ids = [event.event_id or uuid.uuid4().hex for event in events]
    first_of: dict[str, int] = {}
    event_rows: list[dict[str, Any]] = []
    recipients: dict[str, Recipients] = {}
    for position, (event, event_id) in enumerate(zip(events, event_ids, strict=True)):
        if event_id in first_of:  # repeated within this request: the first one counts
            continue
        first_of[event_id] = position
        found = recipient_index.recipients(event.offering_uuid, event.object_type, event.user_uuids)
        recipients[event_id] = found
        event_rows.append(
            {
                "event_id": event_id,
                "offering_uuid": event.offering_uuid,
                "object_type": event.object_type,
                "payload": bodies[position],
                "user_uuids": [u.hex for u in event.user_uuids]
                if event.user_uuids is not None
                else None,
                "queued": len(found.copies),
                "skipped_unregistered": len(found.skipped),
                "accepted": now,
            }
        )
    inserted = await repository.insert_new_events(session, event_rows)
    delivery_rows = [
        {
            "event_id": event_id,
            "queue_uuid": copy.queue_uuid,
            "consumer_uuid": copy.consumer_uuid,
            "queue_name": copy.queue_name,
            "vhost": copy.vhost,
            "state": DeliveryState.PENDING,
            "attempts": 0,
            "next_attempt_at": now,
            "created": now,
        }
        for event_id in first_of
        if event_id in inserted
        for copy in recipients[event_id].copies
    ]
    await repository.insert_deliveries(session, delivery_rows)
    earlier = await repository.event_counts(session, set(first_of) - inserted)
    await session.commit()

    answers = []
    for position, (event, event_id) in enumerate(zip(events, event_ids, strict=True)):
        new = event_id in inserted and first_of[event_id] == position
        found = recipients[event_id]
        if event_id in inserted:
            queued, skipped = len(found.copies), len(found.skipped)
        else:
            queued, skipped = earlier.get(event_id, (0, 0))
        answers.append(
            EventAccepted(
                event_id=event_id, queued=queued, skipped_unregistered=skipped, duplicate=not new
            )
        )
        if new and found.skipped:
            log.info(
                "queue not registered for this offering and object type; skipping",
                event_id=event_id,
                offering_uuid=event.offering_uuid.hex,
                object_type=event.object_type,
                subscriptions=[s.hex for s in found.skipped],
            )
    to_consumers = sum(1 for row in delivery_rows if row["consumer_uuid"] is not None)
    COPIES.labels(kind="consumer", stage="queued").inc(to_consumers)
    COPIES.labels(kind="legacy", stage="queued").inc(len(delivery_rows) - to_consumers)
    new_count = sum(1 for answer in answers if not answer.duplicate)
    EVENTS_ACCEPTED.inc(new_count)
    EVENTS_DUPLICATE.inc(len(answers) - new_count)
    SKIPPED_UNREGISTERED.inc(
        sum(answer.skipped_unregistered for answer in answers if not answer.duplicate)
    )
    log.info(
        "events_accepted",
        events=len(answers),
        new=new_count,
        duplicates=len(answers) - new_count,
        deliveries=len(delivery_rows),
    )
    return Accepted(answers=answers, new_deliveries=len(delivery_rows))


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
            state == DeliveryState.PENDING for rows in states.values() for *_, state in rows
        )
        remaining = deadline - loop.time()
        if not pending or remaining <= 0:
            break
        await settled.wait(min(interval, remaining), since=seen)
        interval = min(interval * 1.5, 0.25)
    for answer in answers:
        answer.deliveries = [
            DeliveryOut(queue_name=name, vhost=vhost, state=state)
            for name, vhost, state in states[answer.event_id]
        ]


async def publish(
    session: AsyncSession,
    sessions: async_sessionmaker[AsyncSession],
    signals: OutboxSignals,
    settings: Settings,
    events: Sequence[EventIn],
    *,
    batch: bool,
    wait: bool,
) -> list[EventAccepted]:
    """Accept `events` (a single event, or a batch whose fields are named `events.<i>.…`),
    wake the relays of this process, and with `wait` answer once every copy settled."""
    if batch and len(events) > settings.events_batch_max:
        raise BadRequest(
            f"A batch holds at most {settings.events_batch_max} events; this one has "
            f"{len(events)}. Split it into several requests.",
            field="events",
        )
    if batch:
        # A single event's body is bounded by this limit already (auth/guard.py).
        check_payload_sizes(events, settings.event_payload_max_bytes)
    accepted = await accept(session, events, field_prefix="events" if batch else "")
    if accepted.new_deliveries:
        signals.accepted.notify()
    if wait:
        await wait_settled(
            sessions, accepted.answers, signals.settled, settings.events_wait_timeout
        )
    return accepted.answers


async def event_record(session: AsyncSession, event_id: str) -> tuple[Event, Sequence[Row[Any]]]:
    """An event and its copies, oldest first."""
    event = await repository.get_event(session, event_id)
    if event is None:
        raise NotFound(f"Event {event_id!r} not found.")
    return event, await repository.deliveries_of(session, event_id)


async def outbox_depth(session: AsyncSession) -> OutboxDepth:
    return await outbox.outbox_depth(session, utcnow())
