"""Statements on parked copies and on presence; none commits (callers run them on
autocommit connections or in their unit of work).

A copy's acceptance order is its outbox id: copies are inserted in the order their
events were accepted, so "in acceptance order" is `ORDER BY id` within a queue, which the
partial index `ix_deliveries_parked` (migration 0011_parking) serves.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    String,
    Text,
    bindparam,
    cast,
    delete,
    exists,
    func,
    literal_column,
    or_,
    select,
    update,
)

from queuekeeper.db import Executor
from queuekeeper.events.outbox import Claimed
from queuekeeper.events.repository import DELIVERIES, EVENTS
from queuekeeper.models import (
    PARKED_OR_RELEASING,
    Base,
    DeliveryState,
    EventConsumer,
    EventSubscriptionQueue,
)

PRESENCE = Base.metadata.tables["queue_presence"]
_PARKED = literal_column(f"'{DeliveryState.PARKED.value}'", String)
# Written as the partial index is defined, so the planner uses it.
_PARKED_OR_RELEASING: ColumnElement[bool] = literal_column(PARKED_OR_RELEASING)
_WHEN = DELIVERIES.c.next_attempt_at.type

Queue = tuple[str, str]  # (vhost, queue_name)


def _backlog(presence: Any) -> Any:
    """Whether the presence row's queue has parked copies, or released ones not yet out:
    one probe of `ix_deliveries_parked` per queue, never a scan of the backlog."""
    return exists().where(
        _PARKED_OR_RELEASING,
        DELIVERIES.c.vhost == presence.c.vhost,
        DELIVERIES.c.queue_name == presence.c.queue_name,
    )


async def held_queues(session: Executor, away_before: datetime) -> set[Queue]:
    """Queues whose new copies park: away since before `away_before`, or still holding
    parked copies, or released ones not yet published (their order comes first). Every
    queue that ever parked has a presence row (nothing parks without one)."""
    rows = await session.execute(
        select(PRESENCE.c.vhost, PRESENCE.c.queue_name).where(
            or_(PRESENCE.c.away_since <= away_before, _backlog(PRESENCE))
        )
    )
    return {(vhost, queue) for vhost, queue in rows}


async def returned_queues(session: Executor) -> list[Queue]:
    """Queues with parked copies and a consumer again: the ones to release."""
    parked = exists().where(
        _PARKED_OR_RELEASING,
        DELIVERIES.c.state == _PARKED,
        DELIVERIES.c.vhost == PRESENCE.c.vhost,
        DELIVERIES.c.queue_name == PRESENCE.c.queue_name,
    )
    rows = await session.execute(
        select(PRESENCE.c.vhost, PRESENCE.c.queue_name).where(
            PRESENCE.c.consumers > 0, PRESENCE.c.away_since.is_(None), parked
        )
    )
    return [(vhost, queue) for vhost, queue in rows]


async def is_present(session: Executor, vhost: str, queue: str) -> bool:
    consumers = await session.scalar(
        select(PRESENCE.c.consumers).where(
            PRESENCE.c.vhost == vhost,
            PRESENCE.c.queue_name == queue,
            PRESENCE.c.away_since.is_(None),
        )
    )
    return bool(consumers)


async def in_flight(session: Executor, vhost: str, queue: str) -> bool:
    """Whether copies of the queue were released and are not settled yet: published by a
    release still going on, retried, or left by a replica that died mid-release."""
    found = await session.scalar(
        select(DELIVERIES.c.id)
        .where(
            _PARKED_OR_RELEASING,
            DELIVERIES.c.state == DeliveryState.PENDING,
            DELIVERIES.c.vhost == vhost,
            DELIVERIES.c.queue_name == queue,
        )
        .limit(1)
    )
    return found is not None


PARKED_REASON = (
    "parked: its queue has had no consumer for longer than park_after_seconds; published, "
    "in acceptance order, when one returns"
)
_PARK = (
    update(DELIVERIES)
    .where(
        DELIVERIES.c.id.in_(bindparam("b_ids", expanding=True)),
        DELIVERIES.c.state == DeliveryState.PENDING,
        DELIVERIES.c.claimed_by == bindparam("b_relay"),
    )
    .values(
        state=DeliveryState.PARKED,
        parked_at=func.coalesce(DELIVERIES.c.parked_at, bindparam("b_now", type_=_WHEN)),
        claimed_by=None,
        claimed_until=None,
        # Not an attempt: nothing was published.
        attempts=DELIVERIES.c.attempts - 1,
        last_error=PARKED_REASON,
    )
)


async def park(session: Executor, relay_id: str, ids: Collection[int], now: datetime) -> None:
    """Park copies `relay_id` holds (claimed or handed over): from pending to parked."""
    if ids:
        await session.execute(_PARK, {"b_ids": list(ids), "b_relay": relay_id, "b_now": now})


_EVENT_COLUMNS = (
    EVENTS.c.offering_uuid,
    EVENTS.c.object_type,
    EVENTS.c.accepted,
    cast(EVENTS.c.payload, Text),
)


async def release(
    session: Executor,
    relay_id: str,
    vhost: str,
    queue: str,
    limit: int,
    lease_until: datetime,
    now: datetime,
) -> list[Claimed]:
    """Move the queue's oldest `limit` parked copies back to pending, claimed for `relay_id`
    until `lease_until` (a relay that dies leaves them due, and they park again behind the
    queue's backlog: nothing is lost). Returns them in acceptance order."""
    oldest = (
        select(DELIVERIES.c.id)
        .where(
            _PARKED_OR_RELEASING,
            DELIVERIES.c.state == _PARKED,
            DELIVERIES.c.vhost == vhost,
            DELIVERIES.c.queue_name == queue,
        )
        .order_by(DELIVERIES.c.id)
        .limit(limit)
    )
    released = await session.execute(
        update(DELIVERIES)
        .where(DELIVERIES.c.id.in_(oldest.scalar_subquery()), DELIVERIES.c.state == _PARKED)
        .values(
            state=DeliveryState.PENDING,
            claimed_by=relay_id,
            claimed_until=lease_until,
            next_attempt_at=lease_until,
            attempts=DELIVERIES.c.attempts + 1,
        )
        .returning(DELIVERIES.c.id)
    )
    ids = sorted(released.scalars())
    if not ids:
        return []
    rows = await session.execute(
        select(
            DELIVERIES.c.id,
            DELIVERIES.c.event_id,
            DELIVERIES.c.queue_uuid,
            DELIVERIES.c.consumer_uuid,
            DELIVERIES.c.queue_name,
            DELIVERIES.c.vhost,
            DELIVERIES.c.attempts,
            DELIVERIES.c.last_error,
            DELIVERIES.c.offering_uuid,
            *_EVENT_COLUMNS,
            DELIVERIES.c.replay,
        )
        .join(EVENTS, EVENTS.c.event_id == DELIVERIES.c.event_id)
        .where(DELIVERIES.c.id.in_(ids))
        .order_by(DELIVERIES.c.id)
    )
    return [
        Claimed(
            id=row.id,
            event_id=row.event_id,
            queue_uuid=row.queue_uuid,
            consumer_uuid=row.consumer_uuid,
            queue_name=row.queue_name,
            vhost=row.vhost,
            attempts=row.attempts,
            # The relay's delivery_max_age counts from here: a copy parked for days is
            # not too old to publish (retention bounds it instead).
            created=now,
            last_error=row.last_error,
            copy_offering_uuid=row.offering_uuid,
            offering_uuid=row[9],
            object_type=row[10],
            accepted=row[11],
            body=row[12],
            replay=row.replay,
        )
        for row in rows
    ]


@dataclass(frozen=True)
class ParkedSummary:
    parked: int
    oldest_parked_at: datetime | None


async def parked_summary(session: Executor) -> ParkedSummary:
    row = (
        await session.execute(
            select(func.count(), func.min(DELIVERIES.c.created)).where(
                _PARKED_OR_RELEASING, DELIVERIES.c.state == _PARKED
            )
        )
    ).one()
    oldest = row[1]
    if isinstance(oldest, str):  # SQLite hands an aggregate back untyped
        oldest = datetime.fromisoformat(oldest)
    return ParkedSummary(int(row[0]), oldest)


# --- retention ----------------------------------------------------------------------------
RETENTION_REASON = "retention: parked longer than event_retention_days; not published"


async def give_up_expired(session: Executor, cutoff: datetime, limit: int, now: datetime) -> int:
    """Give up up to `limit` parked copies accepted before `cutoff`; returns how many."""
    expired = (
        select(DELIVERIES.c.id)
        .where(_PARKED_OR_RELEASING, DELIVERIES.c.state == _PARKED, DELIVERIES.c.created < cutoff)
        .limit(limit)
    )
    result = await session.execute(
        update(DELIVERIES)
        .where(DELIVERIES.c.id.in_(expired.scalar_subquery()), DELIVERIES.c.state == _PARKED)
        .values(
            state=DeliveryState.GIVEN_UP,
            finished=now,
            last_error=RETENTION_REASON,
        )
    )
    return int(getattr(result, "rowcount", 0) or 0)


async def prune_events(session: Executor, cutoff: datetime, limit: int) -> int:
    """Delete up to `limit` events accepted before `cutoff` whose copies all settled before
    it (their copies go with them: the foreign key cascades). A copy settled since, such as
    one given up for retention just now, keeps its event listed for another period."""
    unsettled = exists().where(
        DELIVERIES.c.event_id == EVENTS.c.event_id,
        or_(
            DELIVERIES.c.state.in_([DeliveryState.PENDING, DeliveryState.PARKED]),
            DELIVERIES.c.finished >= cutoff,
        ),
    )
    old = select(EVENTS.c.event_id).where(EVENTS.c.accepted < cutoff, ~unsettled).limit(limit)
    result = await session.execute(
        delete(EVENTS).where(EVENTS.c.event_id.in_(old.scalar_subquery()))
    )
    return int(getattr(result, "rowcount", 0) or 0)


async def oldest_event(session: Executor) -> datetime | None:
    oldest = await session.scalar(select(func.min(EVENTS.c.accepted)))
    if isinstance(oldest, str):  # SQLite hands an aggregate back untyped
        oldest = datetime.fromisoformat(oldest)
    if isinstance(oldest, datetime) and oldest.tzinfo is None:
        oldest = oldest.replace(tzinfo=UTC)
    return oldest if isinstance(oldest, datetime) else None


# --- replay -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayTarget:
    """A registered queue, as a replay's copies name it."""

    vhost: str
    queue_name: str
    queue_uuid: Any  # uuid.UUID | None: a legacy per-type queue
    consumer_uuid: Any  # uuid.UUID | None: a consumer's queue


async def find_queue(session: Executor, vhost: str, queue_name: str) -> ReplayTarget | None:
    consumer = await session.scalar(
        select(EventConsumer.uuid).where(
            EventConsumer.vhost == vhost, EventConsumer.queue_name == queue_name
        )
    )
    if consumer is not None:
        return ReplayTarget(vhost, queue_name, None, consumer)
    legacy = await session.scalar(
        select(EventSubscriptionQueue.uuid).where(
            EventSubscriptionQueue.vhost == vhost, EventSubscriptionQueue.queue_name == queue_name
        )
    )
    if legacy is not None:
        return ReplayTarget(vhost, queue_name, legacy, None)
    return None


async def copy_for_replay(
    session: Executor,
    target: ReplayTarget,
    since: datetime,
    until: datetime,
    object_types: Sequence[str] | None,
    now: datetime,
) -> int:
    """Write a new pending copy, marked as a replay, of every event accepted in
    [since, until) that had a copy for this queue (whatever became of it), in acceptance
    order (the order of the first copy of each); one INSERT ... SELECT. Returns how many."""
    first_copy = (
        select(
            func.min(DELIVERIES.c.id).label("first_id"),
            DELIVERIES.c.event_id,
            DELIVERIES.c.offering_uuid,
        )
        .join(EVENTS, EVENTS.c.event_id == DELIVERIES.c.event_id)
        .where(
            DELIVERIES.c.vhost == target.vhost,
            DELIVERIES.c.queue_name == target.queue_name,
            DELIVERIES.c.replay.is_(False),
            EVENTS.c.accepted >= since,
            EVENTS.c.accepted < until,
            *([EVENTS.c.object_type.in_(list(object_types))] if object_types else []),
        )
        .group_by(DELIVERIES.c.event_id, DELIVERIES.c.offering_uuid)
        .subquery()
    )
    source = select(
        first_copy.c.event_id,
        bindparam("r_queue", target.queue_uuid, type_=DELIVERIES.c.queue_uuid.type),
        bindparam("r_consumer", target.consumer_uuid, type_=DELIVERIES.c.consumer_uuid.type),
        bindparam("r_name", target.queue_name, type_=DELIVERIES.c.queue_name.type),
        bindparam("r_vhost", target.vhost, type_=DELIVERIES.c.vhost.type),
        first_copy.c.offering_uuid,
        bindparam("r_state", DeliveryState.PENDING, type_=DELIVERIES.c.state.type),
        bindparam("r_attempts", 0, type_=DELIVERIES.c.attempts.type),
        bindparam("r_now", now, type_=_WHEN),
        bindparam("r_created", now, type_=_WHEN),
        bindparam("r_replay", True, type_=DELIVERIES.c.replay.type),
    ).order_by(first_copy.c.first_id)
    result = await session.execute(
        DELIVERIES.insert().from_select(
            [
                "event_id",
                "queue_uuid",
                "consumer_uuid",
                "queue_name",
                "vhost",
                "offering_uuid",
                "state",
                "attempts",
                "next_attempt_at",
                "created",
                "replay",
            ],
            source,
        )
    )
    return int(getattr(result, "rowcount", 0) or 0)
