"""Group commit: accept requests that arrive together share one transaction.

A backend sends events one at a time, as they happen. Each request in its own
transaction costs a connection checkout, four round trips and a commit (an fsync)
per event; here the requests waiting while one transaction runs are stored
together in the next one, so under load a transaction carries many requests and
the per-event cost falls, while a lone request still goes straight through. Each
request is answered only after the commit that holds it (nothing is answered
before it is durable), and each keeps its own outcome: an unknown offering in one
request fails that request alone.

When this process runs a relay, the copies are written already claimed by it (the
lease is in the insert) and handed to it in memory: it publishes them without a
poll or a claim query. Other relays take them over if the lease runs out, as with
any claim. Without a relay (or when its queue of handed copies is full) the copies
are written pending and the relays find them as usual.

Past what it can store in time, the intake refuses at once (`Unavailable`, a 503
with Retry-After) instead of letting waiting requests pile up into seconds.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

import structlog
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from queuekeeper.common.signals import OutboxSignals
from queuekeeper.config import Settings
from queuekeeper.db import Transaction, transaction
from queuekeeper.events import repository
from queuekeeper.events.outbox import Claimed
from queuekeeper.events.recipients import Copy, RecipientIndex, Recipients, find_recipients
from queuekeeper.events.schemas import EventAccepted, EventIn
from queuekeeper.exceptions import BadRequest, DomainError, Unavailable
from queuekeeper.models import DeliveryState, utcnow
from queuekeeper.observability.metrics import (
    COPIES,
    EVENTS_ACCEPTED,
    EVENTS_DUPLICATE,
    SKIPPED_UNREGISTERED,
)

log = structlog.get_logger(__name__)

# A concurrent deletion of a recipient queue makes the insert fail its foreign key:
# the recipients are looked up again, this many times at most.
ATTEMPTS = 3


class Receiver(Protocol):
    """The relay of this process, as the intake sees it."""

    id: str

    def takes_handoff(self) -> bool: ...

    def hand_over(self, claimed: list[Claimed]) -> None: ...


def field_name(prefix: str, *parts: object) -> str:
    return ".".join([prefix, *(str(part) for part in parts)] if prefix else map(str, parts))


@dataclass
class Accepted:
    answers: list[EventAccepted]
    new_deliveries: int


@dataclass
class _Request:
    events: Sequence[EventIn]
    bodies: list[dict[str, Any]]
    field_prefix: str
    future: asyncio.Future[Accepted]
    since: float  # loop time it arrived


@dataclass
class _Group:
    """What one transaction stored, before it is committed."""

    results: list[Accepted | DomainError | None] = field(default_factory=list)
    handed: list[Claimed] = field(default_factory=list)
    deliveries: int = 0


class Intake:
    def __init__(
        self,
        engine: AsyncEngine,
        sessions: async_sessionmaker[AsyncSession],
        settings: Settings,
        signals: OutboxSignals,
    ) -> None:
        self.engine = engine
        self.sessions = sessions  # for `?wait=true`, which reads the copies' states
        self.settings = settings
        self.signals = signals
        self.relay: Receiver | None = None  # set when this process starts its relay
        self._waiting: list[_Request] = []
        self._waiting_events = 0
        self._flusher: asyncio.Task[None] | None = None

    async def accept(
        self, events: Sequence[EventIn], bodies: list[dict[str, Any]], field_prefix: str
    ) -> Accepted:
        """Store validated events (with their message bodies); returns once committed."""
        loop = asyncio.get_running_loop()
        limit = self.settings.events_accept_queue
        if self._waiting and self._waiting_events + len(events) > limit:
            raise Unavailable(
                f"More than {limit} events are waiting to be stored; nothing of this request "
                "was stored. Retry."
            )
        # The oldest waiting request says how far behind the service is: past the limit
        # (a process starved of CPU, a slow database) refuse now rather than in seconds.
        waited = loop.time() - self._waiting[0].since if self._waiting else 0.0
        if waited > self.settings.events_accept_max_wait:
            raise Unavailable(
                f"Events wait {waited:.2f} s to be stored (the service is overloaded); nothing "
                "of this request was stored. Retry."
            )
        future: asyncio.Future[Accepted] = loop.create_future()
        self._waiting.append(_Request(events, bodies, field_prefix, future, loop.time()))
        self._waiting_events += len(events)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="events-intake")
        return await future

    async def _flush(self) -> None:
        """Store what is waiting, one transaction per round, until nothing is."""
        while self._waiting:
            group: list[_Request] = []
            size = 0
            while self._waiting and (not group or size + len(self._waiting[0].events) <= 2000):
                request = self._waiting.pop(0)
                group.append(request)
                size += len(request.events)
            self._waiting_events -= size
            try:
                results = await self._commit(group)
            except Exception as exc:  # each request answers with what went wrong
                for request in group:
                    if not request.future.done():
                        request.future.set_exception(exc)
                continue
            for request, result in zip(group, results, strict=True):
                if request.future.done():  # the caller went away; its events are stored
                    continue
                if isinstance(result, DomainError):
                    request.future.set_exception(result)
                else:
                    request.future.set_result(result)

    async def _commit(self, group: list[_Request]) -> list[Accepted | DomainError]:
        relay = self.relay
        for attempt in range(ATTEMPTS):
            now = utcnow()
            lease = None
            if relay is not None and relay.takes_handoff():
                lease = (relay.id, now + timedelta(seconds=self.settings.relay_lease_seconds))
            try:
                async with transaction(self.engine) as unit:
                    stored = await _store(unit, group, now, lease)
            except IntegrityError:
                if attempt + 1 == ATTEMPTS:
                    raise
                log.info("event_recipients_changed_retrying", attempt=attempt + 1)
                continue
            # Committed: only now may anyone hear of it.
            if stored.handed and relay is not None:
                relay.hand_over(stored.handed)
            elif stored.deliveries:
                self.signals.accepted.notify()
            return [result for result in stored.results if result is not None]
        raise AssertionError("unreachable")  # pragma: no cover


async def _store(
    unit: Transaction,
    group: list[_Request],
    now: datetime,
    lease: tuple[str, datetime] | None,
) -> _Group:
    offerings = {o for request in group for event in request.events for o in event.offerings}
    object_types = {event.object_type for request in group for event in request.events}
    index = await find_recipients(unit, offerings, object_types, now)
    stored = _Group()
    valid: list[tuple[int, _Request]] = []
    for slot, request in enumerate(group):
        error = _unknown_offering(request, index)
        stored.results.append(error)  # the valid ones' answers are filled in below
        if error is None:
            valid.append((slot, request))

    # Every event of the group, in order: a repeated event_id (within a request or across
    # the group) is the first occurrence's duplicate, as if the requests came one by one.
    first_of: dict[str, tuple[int, int]] = {}
    event_ids: list[list[str]] = []
    recipients: dict[str, Recipients] = {}
    # A fan-out event's copies, each with the offering of the queue it goes to.
    copy_offerings: dict[str, dict[Copy, uuid.UUID]] = {}
    event_rows: list[dict[str, Any]] = []
    bodies: dict[str, str] = {}
    for r, (_slot, request) in enumerate(valid):
        ids = [event.event_id or uuid.uuid4().hex for event in request.events]
        event_ids.append(ids)
        for position, (event, event_id) in enumerate(zip(request.events, ids, strict=True)):
            if event_id in first_of:
                continue
            first_of[event_id] = (r, position)
            if event.offering_uuids is None:
                found = index.recipients(event.offerings[0], event.object_type, event.user_uuids)
            else:
                found, copy_offerings[event_id] = _fan_out(index, event)
            recipients[event_id] = found
            body = request.bodies[position]
            bodies[event_id] = json.dumps(body)  # as the JSON column stores it
            event_rows.append(
                {
                    "event_id": event_id,
                    "offering_uuid": event.offerings[0],
                    "offering_uuids": [o.hex for o in event.offering_uuids]
                    if event.offering_uuids is not None
                    else None,
                    "object_type": event.object_type,
                    "payload": body,
                    "user_uuids": [u.hex for u in event.user_uuids]
                    if event.user_uuids is not None
                    else None,
                    "queued": len(found.copies),
                    "skipped_unregistered": len(found.skipped),
                    "accepted": now,
                }
            )
    inserted = await repository.insert_new_events(unit, event_rows)
    copies = [
        (event_id, copy)
        for event_id in first_of
        if event_id in inserted
        for copy in recipients[event_id].copies
    ]
    claimed_by, lease_until = lease if lease else (None, now)
    delivery_ids = await repository.insert_deliveries(
        unit,
        [
            {
                "event_id": event_id,
                "queue_uuid": copy.queue_uuid,
                "consumer_uuid": copy.consumer_uuid,
                "queue_name": copy.queue_name,
                "vhost": copy.vhost,
                "offering_uuid": copy_offerings.get(event_id, {}).get(copy),
                "state": DeliveryState.PENDING,
                # Handed to this process's relay: claimed in the insert, as a claim would.
                "attempts": 1 if lease else 0,
                "claimed_by": claimed_by,
                "claimed_until": lease_until if lease else None,
                "next_attempt_at": lease_until,
                "created": now,
            }
            for event_id, copy in copies
        ],
        ids=lease is not None,
    )
    stored.deliveries = len(copies)
    to_consumers = sum(1 for _, copy in copies if copy.consumer_uuid is not None)
    if lease:
        events_by_id = {row["event_id"]: row for row in event_rows}
        stored.handed = [
            Claimed(
                id=delivery_ids[(event_id, copy.queue_uuid or copy.consumer_uuid)],
                event_id=event_id,
                queue_uuid=copy.queue_uuid,
                consumer_uuid=copy.consumer_uuid,
                queue_name=copy.queue_name,
                vhost=copy.vhost,
                attempts=1,
                created=now,
                last_error=None,
                copy_offering_uuid=copy_offerings.get(event_id, {}).get(copy),
                offering_uuid=events_by_id[event_id]["offering_uuid"],
                object_type=events_by_id[event_id]["object_type"],
                accepted=now,
                body=bodies[event_id],
            )
            for event_id, copy in copies
        ]
    earlier = await repository.event_counts(unit, set(first_of) - inserted)

    for r, (slot, request) in enumerate(valid):
        answers = []
        for position, event_id in enumerate(event_ids[r]):
            found = recipients[event_id]
            new = event_id in inserted and first_of[event_id] == (r, position)
            if event_id in inserted:
                queued, skipped = len(found.copies), len(found.skipped)
            else:
                queued, skipped = earlier.get(event_id, (0, 0))
            answers.append(
                EventAccepted(
                    event_id=event_id,
                    queued=queued,
                    skipped_unregistered=skipped,
                    duplicate=not new,
                )
            )
            if new and found.skipped:
                event = request.events[position]
                log.info(
                    "queue not registered for this offering and object type; skipping",
                    event_id=event_id,
                    offering_uuids=[o.hex for o in event.offerings],
                    object_type=event.object_type,
                    subscriptions=[s.hex for s in found.skipped],
                )
        new_count = sum(1 for answer in answers if not answer.duplicate)
        EVENTS_ACCEPTED.inc(new_count)
        EVENTS_DUPLICATE.inc(len(answers) - new_count)
        SKIPPED_UNREGISTERED.inc(
            sum(answer.skipped_unregistered for answer in answers if not answer.duplicate)
        )
        own = sum(
            len(recipients[e].copies)
            for e in set(event_ids[r])
            if e in inserted and first_of[e][0] == r
        )
        stored.results[slot] = Accepted(answers, own)
    COPIES.labels(kind="consumer", stage="queued").inc(to_consumers)
    COPIES.labels(kind="legacy", stage="queued").inc(len(copies) - to_consumers)
    log.debug(
        "events_accepted",
        requests=len(group),
        events=len(event_rows),
        new=len(inserted),
        deliveries=len(copies),
        handed=len(stored.handed),
    )
    return stored


def _unknown_offering(request: _Request, index: RecipientIndex) -> BadRequest | None:
    for position, event in enumerate(request.events):
        for number, offering in enumerate(event.offerings):
            if offering not in index.known:
                prefix = request.field_prefix
                where = (
                    ("offering_uuid",)
                    if event.offering_uuids is None
                    else ("offering_uuids", number)
                )
                return BadRequest(
                    f"Unknown offering {offering.hex}: the backend has not pushed it.",
                    field=field_name(prefix, position, *where)
                    if prefix
                    else field_name("", *where),
                )
    return None


def _fan_out(index: RecipientIndex, event: EventIn) -> tuple[Recipients, dict[Copy, uuid.UUID]]:
    """An event sent to several offerings: each offering's recipients, as for an event of
    that offering alone, and one copy per queue (a consumer scoped to several of them gets
    one copy, carrying the first of them in the event's order)."""
    found = Recipients()
    offering_of: dict[Copy, uuid.UUID] = {}
    for offering in event.offerings:
        each = index.recipients(offering, event.object_type, event.user_uuids)
        for copy in each.copies:
            if copy not in offering_of:
                offering_of[copy] = offering
                found.copies.append(copy)
        found.skipped.extend(s for s in each.skipped if s not in found.skipped)
    return found, offering_of
