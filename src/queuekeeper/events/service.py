"""Accepting events: validate, find the recipients, write the event and its outbox rows.

Everything a request accepts is written in the one transaction that answers
it (the transactional outbox); the relay publishes from there. Finding the
recipients is one query for the whole request, whatever the batch holds.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queuekeeper.common.signals import Signal
from queuekeeper.events import repository
from queuekeeper.events.payloads import PAYLOAD_MODELS
from queuekeeper.events.repository import SubscriptionQueueRow
from queuekeeper.events.schemas import DeliveryOut, EventAccepted, EventIn
from queuekeeper.exceptions import BadRequest
from queuekeeper.models import utcnow
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
        if sent_offering is not None and _as_uuid(sent_offering) != event.offering_uuid:
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


def _as_uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def _lists_type(observable_objects: list[Any], offering_uuid: uuid.UUID, object_type: str) -> bool:
    """Whether a subscription asked for this type (an empty list asks for everything)."""
    if not observable_objects:
        return True
    for item in observable_objects:
        if not isinstance(item, dict) or item.get("object_type") != object_type:
            continue
        named = item.get("offering_uuid")
        if named is None or _as_uuid(named) == offering_uuid:
            return True
    return False


@dataclass(frozen=True)
class Copy:
    """One outbox copy: to a subscription's queue (`queue_uuid`) or a consumer's."""

    queue_uuid: uuid.UUID | None
    consumer_uuid: uuid.UUID | None
    queue_name: str
    vhost: str

    @property
    def kind(self) -> str:
        return "consumer" if self.consumer_uuid is not None else "legacy"


@dataclass
class _Recipients:
    copies: list[Copy]
    skipped: list[uuid.UUID]  # subscriptions with no queue registered


@dataclass(frozen=True)
class _Consumer:
    owner: uuid.UUID
    object_types: frozenset[str]  # empty: every type
    copy: Copy


class RecipientIndex:
    """Who receives what, from the one query's rows; the rest is done in memory.

    A consumer receives an event of its offering when its filter holds the type. Its
    owner's legacy queues get no copy of that event (SPEC 9, as Waldur does): an agent
    upgraded from 1.0.5 to 1.0.7 must not fill the per-type queues it no longer reads,
    and a user on both protocols gets each event once.
    """

    def __init__(self, rows: Sequence[SubscriptionQueueRow]) -> None:
        self._subscriptions: dict[uuid.UUID, dict[uuid.UUID, tuple[uuid.UUID, list[Any]]]] = (
            defaultdict(dict)
        )
        self._queues: dict[tuple[uuid.UUID, uuid.UUID, str], Copy] = {}
        self._consumers: dict[uuid.UUID, dict[uuid.UUID, _Consumer]] = defaultdict(dict)
        for row in rows:
            if row.kind == repository.CONSUMER:
                if row.queue_name and row.vhost:
                    self._consumers[row.offering_uuid][row.recipient_uuid] = _Consumer(
                        row.owner_uuid,
                        frozenset(str(t) for t in row.filter or []),
                        Copy(None, row.recipient_uuid, row.queue_name, row.vhost),
                    )
                continue
            self._subscriptions[row.offering_uuid][row.recipient_uuid] = (
                row.owner_uuid,
                list(row.filter or []),
            )
            if row.queue_uuid is not None and row.object_type and row.queue_name and row.vhost:
                key = (row.recipient_uuid, row.offering_uuid, row.object_type)
                self._queues[key] = Copy(row.queue_uuid, None, row.queue_name, row.vhost)
        self._cache: dict[tuple[Any, ...], _Recipients] = {}

    def recipients(
        self, offering_uuid: uuid.UUID, object_type: str, user_uuids: Sequence[uuid.UUID] | None
    ) -> _Recipients:
        users = frozenset(user_uuids) if user_uuids is not None else None
        key = (offering_uuid, object_type, users)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        found = _Recipients(copies=[], skipped=[])
        served: set[uuid.UUID] = set()  # owners a consumer of theirs receives this for
        for consumer in self._consumers[offering_uuid].values():
            if users is not None and consumer.owner not in users:
                continue
            if not consumer.object_types or object_type in consumer.object_types:
                found.copies.append(consumer.copy)
                served.add(consumer.owner)
        for subscription_uuid, (owner, observable) in self._subscriptions[offering_uuid].items():
            if (users is not None and owner not in users) or owner in served:
                continue
            queue = self._queues.get((subscription_uuid, offering_uuid, object_type))
            if queue is not None:
                found.copies.append(queue)
            elif _lists_type(observable, offering_uuid, object_type):
                found.skipped.append(subscription_uuid)
        self._cache[key] = found
        return found


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
    known, reachable = await repository.recipients_of(
        session, offerings, {event.object_type for event in events}, now
    )
    for index, event in enumerate(events):
        if event.offering_uuid not in known:
            raise BadRequest(
                f"Unknown offering {event.offering_uuid.hex}: the backend has not pushed it.",
                field=_field(field_prefix, index, "offering_uuid")
                if field_prefix
                else "offering_uuid",
            )
    recipient_index = RecipientIndex(reachable)

    event_ids = [event.event_id or uuid.uuid4().hex for event in events]
    first_of: dict[str, int] = {}
    event_rows: list[dict[str, Any]] = []
    recipients: dict[str, _Recipients] = {}
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
            "state": repository.PENDING,
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
    for kind in ("legacy", "consumer"):
        COPIES.labels(kind=kind, stage="queued").inc(
            sum(
                1
                for row in delivery_rows
                if (row["consumer_uuid"] is not None) == (kind == "consumer")
            )
        )
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
        pending = any(state == repository.PENDING for rows in states.values() for *_, state in rows)
        remaining = deadline - loop.time()
        if not pending or remaining <= 0:
            break
        await settled.wait(min(interval, remaining), since=seen)
        interval = min(interval * 1.5, 0.25)
    for answer in answers:
        answer.deliveries = [
            DeliveryOut(queue_name=name, vhost=vhost, state=state)  # type: ignore[arg-type]
            for name, vhost, state in states[answer.event_id]
        ]
