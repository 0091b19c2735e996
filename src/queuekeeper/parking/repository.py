"""Parking's reads of parked copies, of presence and of the oldest event; none commits
(callers run them on autocommit connections or in their unit of work). Every write of a
copy's state (park, unpark, the retention's give-up and prune, a replay's copies) is the
outbox's (`events.outbox.Outbox`; docs/decisions/032-one-owner-of-copy-state.md).

A copy's acceptance order is its outbox id: copies are inserted in the order their
events were accepted, so "in acceptance order" is `ORDER BY id` within a queue, which the
partial index `ix_deliveries_parked` (migration 0011_parking) serves.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    String,
    exists,
    func,
    literal_column,
    or_,
    select,
    tuple_,
    update,
)

from queuekeeper.db import Executor
from queuekeeper.events.recipients import Copy
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

Queue = tuple[str, str]  # (vhost, queue_name)


def _backlog(presence: Any) -> Any:
    """Whether the presence row's queue has parked copies, or released ones not yet out:
    one probe of `ix_deliveries_parked` per queue, never a scan of the backlog."""
    return exists().where(
        _PARKED_OR_RELEASING,
        DELIVERIES.c.vhost == presence.c.vhost,
        DELIVERIES.c.queue_name == presence.c.queue_name,
    )


@dataclass(frozen=True)
class ParkView:
    """What the gate decides by: the queues without a consumer and since when, and the
    queues still holding parked copies or released ones not yet out."""

    away: dict[Queue, datetime]
    backlog: frozenset[Queue]


async def park_view(session: Executor) -> ParkView:
    """One statement: every presence row away or with a backlog. Every queue that ever
    parked has a presence row (nothing parks without one)."""
    backlog = _backlog(PRESENCE)
    rows = await session.execute(
        select(PRESENCE.c.vhost, PRESENCE.c.queue_name, PRESENCE.c.away_since, backlog).where(
            or_(PRESENCE.c.away_since.is_not(None), backlog)
        )
    )
    away: dict[Queue, datetime] = {}
    held: set[Queue] = set()
    for vhost, queue, away_since, has_backlog in rows:
        if away_since is not None:
            away[(vhost, queue)] = _aware(away_since)
        if has_backlog:
            held.add((vhost, queue))
    return ParkView(away, frozenset(held))


async def backlogged(session: Executor, queues: Collection[Queue]) -> set[Queue]:
    """Which of `queues` hold parked copies or released ones not yet out, now."""
    if not queues:
        return set()
    rows = await session.execute(
        select(PRESENCE.c.vhost, PRESENCE.c.queue_name).where(
            tuple_(PRESENCE.c.vhost, PRESENCE.c.queue_name).in_(list(queues)),
            _backlog(PRESENCE),
        )
    )
    return {(vhost, queue) for vhost, queue in rows}


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)


async def returned_queues(session: Executor) -> list[Queue]:
    """Queues with a consumer again and parked copies, or back from an absence whose dead
    letters are not yet redriven (`returned_from`): the ones to release."""
    parked = exists().where(
        _PARKED_OR_RELEASING,
        DELIVERIES.c.state == _PARKED,
        DELIVERIES.c.vhost == PRESENCE.c.vhost,
        DELIVERIES.c.queue_name == PRESENCE.c.queue_name,
    )
    rows = await session.execute(
        select(PRESENCE.c.vhost, PRESENCE.c.queue_name).where(
            PRESENCE.c.consumers > 0,
            PRESENCE.c.away_since.is_(None),
            or_(parked, PRESENCE.c.returned_from.is_not(None)),
        )
    )
    return [(vhost, queue) for vhost, queue in rows]


async def redriven(session: Executor, vhost: str, queue: str) -> None:
    """The queue's dead letters are back: its return needs no more redrive."""
    await session.execute(
        update(PRESENCE)
        .where(PRESENCE.c.vhost == vhost, PRESENCE.c.queue_name == queue)
        .values(returned_from=None)
    )


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
    return ParkedSummary(int(row[0]), row[1])


# --- retention ----------------------------------------------------------------------------
async def oldest_event(session: Executor) -> datetime | None:
    oldest = await session.scalar(select(func.min(EVENTS.c.accepted)))
    if isinstance(oldest, datetime) and oldest.tzinfo is None:
        oldest = oldest.replace(tzinfo=UTC)
    return oldest if isinstance(oldest, datetime) else None


# --- replay -------------------------------------------------------------------------------
async def find_queue(session: Executor, vhost: str, queue_name: str) -> Copy | None:
    """The registered queue of that name, as its copies name it."""
    consumer = await session.scalar(
        select(EventConsumer.uuid).where(
            EventConsumer.vhost == vhost, EventConsumer.queue_name == queue_name
        )
    )
    if consumer is not None:
        return Copy(None, consumer, queue_name, vhost)
    legacy = await session.scalar(
        select(EventSubscriptionQueue.uuid).where(
            EventSubscriptionQueue.vhost == vhost, EventSubscriptionQueue.queue_name == queue_name
        )
    )
    if legacy is not None:
        return Copy(legacy, None, queue_name, vhost)
    return None
