"""Queries for dead-letter redrive: given-up records, and which queues are still registered.

The caller commits."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.common.pagination import fetch_page
from queuekeeper.events.authorization import access_sql, authorized_sql, event_keys_sql
from queuekeeper.models import (
    EventConsumer,
    EventSubscriptionQueue,
    GivenUpDeadLetter,
    QueuePresence,
)


async def is_registered(session: AsyncSession, vhost: str, queue_name: str) -> bool:
    """A subscription queue's or a consumer's (contract §9): both are redriven alike."""
    found = await session.scalar(
        select(EventSubscriptionQueue.uuid)
        .where(
            EventSubscriptionQueue.vhost == vhost, EventSubscriptionQueue.queue_name == queue_name
        )
        .union_all(
            select(EventConsumer.uuid).where(
                EventConsumer.vhost == vhost, EventConsumer.queue_name == queue_name
            )
        )
        .limit(1)
    )
    return found is not None


# The offerings the queue `(:vhost, :queue)` may receive copies of now: a subscription
# queue's own offering; a consumer's offering scopes and the offerings whose scope keys
# (`event_keys_sql`, the chain the rule itself reads: their customer, their project, that
# project's customer) hold one of its bindings (contract §12); each passing the rule copies
# are published by. A global consumer's owner who may receive everything is one row with no
# offering (NULL).
_RECEIVABLE = text(
    """
    SELECT t.offering FROM (
        SELECT q.uuid AS queue, NULL::uuid AS consumer, q.offering_uuid AS offering
        FROM event_subscription_queues q WHERE q.vhost = :vhost AND q.queue_name = :queue
        UNION ALL
        SELECT NULL::uuid, c.uuid, sc.offering_uuid
        FROM event_consumers c JOIN event_consumer_scopes sc ON sc.consumer_uuid = c.uuid
        WHERE c.vhost = :vhost AND c.queue_name = :queue
        UNION ALL
        SELECT NULL::uuid, c.uuid, o.uuid
        FROM event_consumers c
        JOIN event_consumer_bindings b ON b.consumer_uuid = c.uuid
        JOIN offerings o ON (b.scope_type, b.scope_uuid) IN ("""  # noqa: S608 - the module's constants
    + event_keys_sql("o.uuid", "NULL::uuid", "NULL::uuid")
    + """)
        WHERE c.vhost = :vhost AND c.queue_name = :queue
        UNION ALL
        SELECT NULL::uuid, c.uuid, NULL::uuid
        FROM event_consumers c WHERE c.vhost = :vhost AND c.queue_name = :queue AND c.is_global
    ) t
    WHERE """
    + authorized_sql("t.queue", "t.consumer", "t.offering", "CAST(:now AS timestamptz)")
)


_ACCESS = text("SELECT " + access_sql("CAST(:now AS timestamptz)"))


async def access(session: AsyncSession, now: datetime) -> tuple[int, datetime | None]:
    """The access epoch and the latest role or token expiry passed by `now`: read before a
    queue's judgment (its epoch), and again before a batch is published, which republishes
    without judging again only if nothing the rule reads changed in between
    (docs/decisions/029-judged-as-it-leaves.md)."""
    row = (await session.execute(_ACCESS, {"now": now})).one()
    return int(row[0]), row[1]


async def receivable_offerings(
    session: AsyncSession, vhost: str, queue_name: str, now: datetime
) -> tuple[set[str], bool]:
    """The offerings (hex) whose copies this queue's owner may receive now, and whether it
    may receive every offering's (a global consumer of a staff or support owner)
    (docs/decisions/021-authorized-when-published.md, 025): one statement per queue a
    redrive run meets, whatever the number of its dead letters."""
    rows = await session.execute(_RECEIVABLE, {"vhost": vhost, "queue": queue_name, "now": now})
    offerings = [row[0] for row in rows]
    every = any(offering is None for offering in offerings)
    return {uuid.UUID(str(o)).hex for o in offerings if o is not None}, every


# Whether a consumer queue's owner may receive this event now, by the rule copies are
# published by with the stored event's own keys (its project, the user it is about): what
# the offering alone cannot tell (an order matched through its project, an identity event
# with no offering). NULL: the event is no longer stored.
_EVENT_RECEIVABLE = text(
    """
    SELECT """  # noqa: S608 - the module's constants
    + authorized_sql(
        "NULL::uuid",
        "c.uuid",
        "COALESCE(CAST(:offering AS uuid), e.offering_uuid)",
        "CAST(:now AS timestamptz)",
        "e.project_uuid",
        "e.subject_user_uuid",
    )
    + """
    FROM event_consumers c JOIN events e ON e.event_id = :event
    WHERE c.vhost = :vhost AND c.queue_name = :queue
    """
)


async def event_receivable(
    session: AsyncSession,
    vhost: str,
    queue_name: str,
    event_id: str,
    offering: uuid.UUID | None,
    now: datetime,
) -> bool | None:
    """Whether the owner of the consumer queue may receive the copy of `event_id` (for
    `offering`, a fan-out's own) now; None when the event or the consumer is not stored."""
    value = await session.scalar(
        _EVENT_RECEIVABLE,
        {
            "vhost": vhost,
            "queue": queue_name,
            "event": event_id,
            "offering": offering,
            "now": now,
        },
    )
    return None if value is None else bool(value)


async def is_away(session: AsyncSession, vhost: str, queue_name: str) -> bool:
    """Whether the queue has had no consumer since some time (queue_presence)."""
    away_since = await session.scalar(
        select(QueuePresence.away_since).where(
            QueuePresence.vhost == vhost, QueuePresence.queue_name == queue_name
        )
    )
    return away_since is not None


def record_given_up(session: AsyncSession, records: Sequence[GivenUpDeadLetter]) -> None:
    session.add_all(records)


async def list_given_up(
    session: AsyncSession, *, vhost: str | None, offset: int, limit: int
) -> tuple[int, list[GivenUpDeadLetter]]:
    """Newest first."""
    query = select(GivenUpDeadLetter)
    if vhost:
        query = query.where(GivenUpDeadLetter.vhost == vhost)
    return await fetch_page(
        session,
        query,
        GivenUpDeadLetter.recorded.desc(),
        GivenUpDeadLetter.id.desc(),
        offset=offset,
        limit=limit,
    )
