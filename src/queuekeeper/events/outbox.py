"""The relay's statements on the outbox (the `deliveries` table): claim, settle, renew.

Each statement stands alone and is guarded by the row's state, so the relay runs
them on autocommit connections (`Executor`; a settlement, `db.autocommit`); none needs the
ORM.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    String,
    Text,
    Update,
    bindparam,
    case,
    cast,
    func,
    literal_column,
    select,
    update,
)

from queuekeeper.db import DriverQuery, Transaction, is_postgres, one_of
from queuekeeper.events.repository import DELIVERIES, EVENTS, Executor
from queuekeeper.models import DeliveryState, EventConsumer, EventSubscriptionQueue

PENDING = DeliveryState.PENDING
# Written out, not bound: the partial index of pending rows is used only when the
# planner sees the literal it was defined with (asyncpg plans prepared statements).
IS_PENDING: ColumnElement[str] = literal_column(f"'{PENDING.value}'", String)


# PostgreSQL NOTIFY channel on which a trigger of `deliveries` (migration 0006) announces
# copies committed unclaimed: a relay anywhere may take them now. Relays poll as well, so
# a lost notification delays a copy by at most the poll interval and loses nothing.
DUE_CHANNEL = "queuekeeper_outbox_due"


@dataclass(frozen=True)
class Claimed:
    id: int
    event_id: str
    queue_uuid: uuid.UUID | None
    consumer_uuid: uuid.UUID | None  # a consumer's copy (contract §9) has this instead
    queue_name: str
    vhost: str
    attempts: int
    created: datetime
    last_error: str | None
    copy_offering_uuid: uuid.UUID | None  # a fan-out's copy: its queue's offering
    offering_uuid: uuid.UUID  # the event's (first) offering
    object_type: str
    accepted: datetime
    body: str  # the stored payload JSON, sent as it is
    replay: bool = False  # a replay's copy (contract §11): marked with a header


_DELIVERY_COLUMNS = (
    DELIVERIES.c.id,
    DELIVERIES.c.event_id,
    DELIVERIES.c.queue_uuid,
    DELIVERIES.c.consumer_uuid,
    DELIVERIES.c.queue_name,
    DELIVERIES.c.vhost,
    DELIVERIES.c.attempts,
    DELIVERIES.c.created,
    DELIVERIES.c.last_error,
    DELIVERIES.c.offering_uuid,
)
_EVENT_COLUMNS = (
    EVENTS.c.offering_uuid,
    EVENTS.c.object_type,
    EVENTS.c.accepted,
    cast(EVENTS.c.payload, Text),
)


_WHEN = DELIVERIES.c.next_attempt_at.type  # binds datetimes as the column stores them
_DUE = (
    select(DELIVERIES.c.id)
    .where(
        DELIVERIES.c.state == IS_PENDING,
        DELIVERIES.c.next_attempt_at <= bindparam("b_now", type_=_WHEN),
    )
    .order_by(DELIVERIES.c.next_attempt_at, DELIVERIES.c.id)
    .limit(bindparam("b_limit"))
)
_CLAIM_VALUES = {
    "claimed_by": bindparam("b_relay"),
    "claimed_until": bindparam("b_lease", type_=_WHEN),
    "next_attempt_at": bindparam("b_lease", type_=_WHEN),
    "attempts": DELIVERIES.c.attempts + 1,
}
_DUE_CTE = _DUE.with_for_update(skip_locked=True).cte("due")
# PostgreSQL: one statement claims and returns what publishing needs.
_CLAIM_POSTGRES = (
    update(DELIVERIES)
    .where(DELIVERIES.c.id == _DUE_CTE.c.id, DELIVERIES.c.event_id == EVENTS.c.event_id)
    .values(_CLAIM_VALUES)
    .returning(*_DELIVERY_COLUMNS, *_EVENT_COLUMNS, DELIVERIES.c.replay)
)
# SQLite cannot return columns of an UPDATE's FROM tables: the events are read apart.
_CLAIM_SQLITE = (
    update(DELIVERIES)
    .where(DELIVERIES.c.id.in_(_DUE.scalar_subquery()))
    .values(_CLAIM_VALUES)
    .returning(*_DELIVERY_COLUMNS, DELIVERIES.c.replay)
)
_ANY_DUE = _DUE.with_only_columns(DELIVERIES.c.id)
_EVENTS_OF = select(EVENTS.c.event_id, *_EVENT_COLUMNS).where(
    EVENTS.c.event_id.in_(bindparam("b_events", expanding=True))
)


async def claim(
    session: Executor, relay_id: str, now: datetime, lease_until: datetime, limit: int
) -> list[Claimed]:
    """Take up to `limit` due deliveries for `relay_id` until `lease_until`.

    A claim moves `next_attempt_at` to the end of the lease, so claimed rows are
    simply not due for anyone else; a relay that dies leaves them due again when
    its lease runs out. On PostgreSQL `FOR UPDATE SKIP LOCKED` lets relays claim
    side by side without waiting on or double-claiming each other's rows; SQLite
    has one writer at a time, so a plain UPDATE is already exclusive.
    """
    params = {"b_now": now, "b_limit": limit, "b_relay": relay_id, "b_lease": lease_until}
    if is_postgres(session):
        rows = (await session.execute(_CLAIM_POSTGRES, params)).all()
        claimed = [Claimed(*row) for row in rows]
    else:
        # Look before claiming, so an idle relay never takes SQLite's write lock.
        if await session.scalar(_ANY_DUE, {"b_now": now, "b_limit": 1}) is None:
            return []
        deliveries = (await session.execute(_CLAIM_SQLITE, params)).all()
        events: dict[str, tuple[Any, ...]] = {}
        if deliveries:
            result = await session.execute(
                _EVENTS_OF, {"b_events": list({row[1] for row in deliveries})}
            )
            events = {row[0]: tuple(row[1:]) for row in result}
        claimed = [
            Claimed(*row[:-1], *events[row[1]], replay=row[-1])  # type: ignore[misc]
            for row in deliveries
        ]
    claimed.sort(key=lambda item: item.id)  # RETURNING has no order; publish oldest first
    return claimed


def _finish_statement(*, with_error: bool) -> Update:
    values: dict[str, Any] = {
        "state": bindparam("b_state"),
        "finished": bindparam("b_finished", type_=_WHEN),
        "claimed_by": None,
        "claimed_until": None,
    }
    if with_error:
        values["last_error"] = bindparam("b_error")
    return (
        update(DELIVERIES)
        .where(one_of(DELIVERIES.c.id, "b_ids"), DELIVERIES.c.state == PENDING)
        .values(values)
    )


_FINISH = DriverQuery(_finish_statement(with_error=False))
_FINISH_WITH_ERROR = DriverQuery(_finish_statement(with_error=True))


async def finish(
    statements: Transaction,
    ids: Collection[int],
    state: DeliveryState,
    now: datetime,
    error: str | None = None,
) -> None:
    """Settle deliveries (published, rejected, given_up). A settled row stays settled.
    One per settled batch of the relay: on PostgreSQL it runs on the driver (`db.autocommit`)."""
    if not ids:
        return
    params = {"b_ids": list(ids), "b_state": state, "b_finished": now}
    if error is None:
        await statements.execute(_FINISH, params)
    else:
        await statements.execute(_FINISH_WITH_ERROR, {**params, "b_error": error})


async def give_up(session: Executor, reasons: Sequence[tuple[int, str]], now: datetime) -> None:
    if not reasons:
        return
    statement = (
        update(DELIVERIES)
        .where(DELIVERIES.c.id == bindparam("b_id"), DELIVERIES.c.state == PENDING)
        .values(
            state=DeliveryState.GIVEN_UP,
            finished=now,
            claimed_by=None,
            claimed_until=None,
            last_error=bindparam("b_error"),
        )
    )
    await session.execute(statement, [{"b_id": i, "b_error": reason} for i, reason in reasons])


async def reschedule(
    session: Executor, relay_id: str, retries: Sequence[tuple[int, datetime, str]]
) -> None:
    """Release our claim on (id, next attempt, error), unless another relay took it since."""
    if not retries:
        return
    statement = (
        update(DELIVERIES)
        .where(
            DELIVERIES.c.id == bindparam("b_id"),
            DELIVERIES.c.state == PENDING,
            DELIVERIES.c.claimed_by == relay_id,
        )
        .values(
            next_attempt_at=bindparam("b_next"),
            last_error=bindparam("b_error"),
            claimed_by=None,
            claimed_until=None,
        )
    )
    await session.execute(
        statement,
        [{"b_id": i, "b_next": when, "b_error": error} for i, when, error in retries],
    )


# Copies `b_ids` still pending and still claimed by relay `b_relay` (nobody took them over).
_HELD = update(DELIVERIES).where(
    DELIVERIES.c.id.in_(bindparam("b_ids", expanding=True)),
    DELIVERIES.c.state == IS_PENDING,
    DELIVERIES.c.claimed_by == bindparam("b_relay"),
)
_RENEW = _HELD.values(
    claimed_until=bindparam("b_lease", type_=_WHEN),
    next_attempt_at=bindparam("b_lease", type_=_WHEN),
).returning(DELIVERIES.c.id)


async def renew(
    session: Executor, relay_id: str, ids: Collection[int], lease_until: datetime
) -> set[int]:
    """Extend `relay_id`'s lease on these copies; returns those still pending and its own."""
    if not ids:
        return set()
    result = await session.execute(
        _RENEW, {"b_ids": list(ids), "b_relay": relay_id, "b_lease": lease_until}
    )
    return set(result.scalars())


_RELEASE = _HELD.values(
    claimed_by=None,
    claimed_until=None,
    next_attempt_at=bindparam("b_now", type_=_WHEN),
    # Not an attempt: nothing was published.
    attempts=DELIVERIES.c.attempts - 1,
)


async def release(session: Executor, relay_id: str, ids: Collection[int], now: datetime) -> None:
    """Give back `relay_id`'s claim on copies it never published: due again at once."""
    if ids:
        await session.execute(_RELEASE, {"b_ids": list(ids), "b_relay": relay_id, "b_now": now})


async def existing_targets(
    session: Executor, target_uuids: Collection[uuid.UUID]
) -> set[uuid.UUID]:
    """Of these subscription queue and consumer uuids, the ones whose row still exists."""
    if not target_uuids:
        return set()
    rows = await session.scalars(
        select(EventSubscriptionQueue.uuid)
        .where(EventSubscriptionQueue.uuid.in_(target_uuids))
        .union_all(select(EventConsumer.uuid).where(EventConsumer.uuid.in_(target_uuids)))
    )
    return set(rows)


async def consumer_count(session: Executor) -> int:
    """Consumers registered (the `queuekeeper_consumers` gauge)."""
    return int(await session.scalar(select(func.count()).select_from(EventConsumer)) or 0)


@dataclass(frozen=True)
class OutboxDepth:
    pending: int
    claimed: int  # pending and held by a live lease
    oldest_pending_age_seconds: float  # 0 when nothing is pending


async def outbox_depth(session: Executor, now: datetime) -> OutboxDepth:
    row = (
        await session.execute(
            select(
                func.count(),
                func.coalesce(func.sum(case((DELIVERIES.c.claimed_until > now, 1), else_=0)), 0),
                func.min(DELIVERIES.c.created),
            ).where(DELIVERIES.c.state == IS_PENDING)
        )
    ).one()
    oldest = row[2]
    if isinstance(oldest, str):  # SQLite hands an aggregate back untyped
        oldest = datetime.fromisoformat(oldest)
    if oldest is not None and oldest.tzinfo is None:
        oldest = oldest.replace(tzinfo=now.tzinfo)
    return OutboxDepth(
        pending=int(row[0]),
        claimed=int(row[1]),
        oldest_pending_age_seconds=(now - oldest).total_seconds() if oldest else 0.0,
    )
