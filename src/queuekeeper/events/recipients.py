"""Where an event goes: the one query for a request's recipients and the decision per event.

An event of (offering, object type) gets one outbox copy per registered queue for
that pair whose subscription's owner is active, has an unexpired token and has
access to the offering, narrowed to the event's `user_uuids` when it names any.
A subscription that would receive the type (it lists it, or lists nothing) but
registered no queue for it is counted as skipped. Everything is read in one
statement per request, whatever the batch or the fan-out; the rest is done in memory.

A new kind of recipient is one more source of `Copy` in `RecipientIndex`.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Select, Table, and_, bindparam, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.common.schemas import as_uuid
from queuekeeper.models import Base

OFFERINGS: Table = Base.metadata.tables["offerings"]
ACCESS: Table = Base.metadata.tables["offering_access"]
USERS: Table = Base.metadata.tables["users"]
SUBSCRIPTIONS: Table = Base.metadata.tables["event_subscriptions"]
QUEUES: Table = Base.metadata.tables["event_subscription_queues"]


@dataclass(frozen=True)
class Copy:
    """One outbox copy of an event: the queue it is published to."""

    queue_uuid: uuid.UUID
    queue_name: str
    vhost: str


@dataclass
class Recipients:
    copies: list[Copy] = field(default_factory=list)
    skipped: list[uuid.UUID] = field(default_factory=list)  # subscriptions without a queue


@dataclass(frozen=True)
class _Row:
    """A subscription whose owner may receive events of `offering_uuid` now, with its queue
    for one of the requested object types (None when it registered none)."""

    subscription_uuid: uuid.UUID
    owner_uuid: uuid.UUID
    observable_objects: list[Any]
    offering_uuid: uuid.UUID
    queue_uuid: uuid.UUID | None
    object_type: str | None
    queue_name: str | None
    vhost: str | None


def _recipients_statement() -> Select[Any]:
    reachable = (
        select(
            ACCESS.c.offering_uuid,
            SUBSCRIPTIONS.c.uuid.label("subscription_uuid"),
            SUBSCRIPTIONS.c.user_uuid,
            SUBSCRIPTIONS.c.observable_objects,
            QUEUES.c.uuid.label("queue_uuid"),
            QUEUES.c.object_type,
            QUEUES.c.queue_name,
            QUEUES.c.vhost,
        )
        .select_from(
            ACCESS.join(USERS, USERS.c.uuid == ACCESS.c.user_uuid)
            .join(SUBSCRIPTIONS, SUBSCRIPTIONS.c.user_uuid == ACCESS.c.user_uuid)
            .outerjoin(
                QUEUES,
                and_(
                    QUEUES.c.subscription_uuid == SUBSCRIPTIONS.c.uuid,
                    QUEUES.c.offering_uuid == ACCESS.c.offering_uuid,
                    QUEUES.c.object_type.in_(bindparam("object_types", expanding=True)),
                ),
            )
        )
        .where(
            ACCESS.c.offering_uuid.in_(bindparam("access_offerings", expanding=True)),
            USERS.c.is_active.is_(True),
            or_(
                USERS.c.token_expires_at.is_(None),
                USERS.c.token_expires_at > bindparam("now", type_=USERS.c.token_expires_at.type),
            ),
        )
        .subquery("reachable")
    )
    return (
        select(
            OFFERINGS.c.uuid,
            reachable.c.subscription_uuid,
            reachable.c.user_uuid,
            reachable.c.observable_objects,
            reachable.c.queue_uuid,
            reachable.c.object_type,
            reachable.c.queue_name,
            reachable.c.vhost,
        )
        .select_from(OFFERINGS.outerjoin(reachable, reachable.c.offering_uuid == OFFERINGS.c.uuid))
        .where(OFFERINGS.c.uuid.in_(bindparam("offerings", expanding=True)))
    )


# Built once: constructing this join per request cost more than running it.
_RECIPIENTS = _recipients_statement()


async def find_recipients(
    session: AsyncSession,
    offering_uuids: Collection[uuid.UUID],
    object_types: Collection[str],
    now: datetime,
) -> RecipientIndex:
    """Who may receive events of these offerings and types: one query for a whole request.

    The offerings left-joined with who may receive their events, so an unknown
    offering yields no row at all (`RecipientIndex.known` tells them apart).
    """
    offerings = list(offering_uuids)
    result = await session.execute(
        _RECIPIENTS,
        {
            "offerings": offerings,
            "access_offerings": offerings,
            "object_types": list(object_types),
            "now": now,
        },
    )
    known: set[uuid.UUID] = set()
    rows: list[_Row] = []
    for (
        offering,
        subscription,
        owner,
        observable,
        queue,
        object_type,
        name,
        vhost,
    ) in result:
        known.add(offering)
        if subscription is not None:
            rows.append(
                _Row(subscription, owner, observable, offering, queue, object_type, name, vhost)
            )
    return RecipientIndex(known, rows)


def _lists_type(observable_objects: list[Any], offering_uuid: uuid.UUID, object_type: str) -> bool:
    """Whether a subscription asked for this type (an empty list asks for everything)."""
    if not observable_objects:
        return True
    for item in observable_objects:
        if not isinstance(item, dict) or item.get("object_type") != object_type:
            continue
        named = item.get("offering_uuid")
        if named is None or as_uuid(named) == offering_uuid:
            return True
    return False


class RecipientIndex:
    """The recipients of every event of one request, decided from the query's rows."""

    def __init__(self, known: set[uuid.UUID], rows: Sequence[_Row]) -> None:
        self.known = known  # the offerings among those asked for that exist
        self._subscriptions: dict[uuid.UUID, dict[uuid.UUID, tuple[uuid.UUID, list[Any]]]] = (
            defaultdict(dict)
        )
        self._queues: dict[tuple[uuid.UUID, uuid.UUID, str], Copy] = {}
        for row in rows:
            self._subscriptions[row.offering_uuid][row.subscription_uuid] = (
                row.owner_uuid,
                list(row.observable_objects or []),
            )
            if row.queue_uuid is not None and row.object_type and row.queue_name and row.vhost:
                key = (row.subscription_uuid, row.offering_uuid, row.object_type)
                self._queues[key] = Copy(row.queue_uuid, row.queue_name, row.vhost)
        self._cache: dict[tuple[Any, ...], Recipients] = {}

    def recipients(
        self, offering_uuid: uuid.UUID, object_type: str, user_uuids: Sequence[uuid.UUID] | None
    ) -> Recipients:
        users = frozenset(user_uuids) if user_uuids is not None else None
        key = (offering_uuid, object_type, users)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        found = Recipients()
        for subscription_uuid, (owner, observable) in self._subscriptions[offering_uuid].items():
            if users is not None and owner not in users:
                continue
            queue = self._queues.get((subscription_uuid, offering_uuid, object_type))
            if queue is not None:
                found.copies.append(queue)
            elif _lists_type(observable, offering_uuid, object_type):
                found.skipped.append(subscription_uuid)
        self._cache[key] = found
        return found
