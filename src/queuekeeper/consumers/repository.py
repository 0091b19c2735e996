"""Queries for consumers and their scopes. Nothing here commits."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    DateTime,
    RowMapping,
    Select,
    String,
    TextClause,
    Uuid,
    any_,
    bindparam,
    delete,
    func,
    literal,
    literal_column,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.broker import topology
from queuekeeper.common.pagination import Page, Paged, fetch_paged
from queuekeeper.consumers.schemas import ConsumerFilters, DeliveryFilters
from queuekeeper.events.authorization import authorized_sql, binding_allowed_sql
from queuekeeper.models import (
    CONSUMER_ON_BROKER,
    DELIVERY_OWNER,
    GIVEN_UP_STATES,
    AccessSweep,
    AgentIdentity,
    AwareDateTime,
    Customer,
    Delivery,
    Event,
    EventConsumer,
    EventConsumerBinding,
    EventConsumerScope,
    EventSubscription,
    EventSubscriptionQueue,
    Offering,
    Project,
    QueuePresence,
    Role,
    User,
    utcnow,
)


def consumers(owner_uuid: uuid.UUID | None) -> Select[EventConsumer]:
    """Every consumer, or one owner's."""
    query = select(EventConsumer)
    if owner_uuid is not None:
        query = query.where(EventConsumer.user_uuid == owner_uuid)
    return query


async def get(
    session: AsyncSession, consumer_uuid: uuid.UUID, owner_uuid: uuid.UUID | None = None
) -> EventConsumer | None:
    found: EventConsumer | None = await session.scalar(
        consumers(owner_uuid).where(EventConsumer.uuid == consumer_uuid)
    )
    return found


async def visible(
    session: AsyncSession, consumer_uuid: uuid.UUID, owner_uuid: uuid.UUID | None = None
) -> uuid.UUID | None:
    """The consumer's uuid when it exists (and is the owner's), for a route that reads only
    its copies: one round trip, where `get` loads its scopes, bindings and owner in three
    more (the larger part of a deliveries page's time on a busy machine)."""
    query = select(EventConsumer.uuid).where(EventConsumer.uuid == consumer_uuid)
    if owner_uuid is not None:
        query = query.where(EventConsumer.user_uuid == owner_uuid)
    found: uuid.UUID | None = await session.scalar(query)
    return found


def filtered(owner_uuid: uuid.UUID | None, filters: ConsumerFilters) -> Select[EventConsumer]:
    """`consumers(owner_uuid)` narrowed by the list filters of client 8.1.3."""
    query = consumers(owner_uuid)
    if filters.user_uuid is not None:
        query = query.where(EventConsumer.user_uuid == filters.user_uuid)
    if filters.user_username is not None:
        owners = select(User.uuid).where(User.username == filters.user_username)
        query = query.where(EventConsumer.user_uuid.in_(owners))
    if filters.is_global is not None:
        query = query.where(EventConsumer.is_global.is_(filters.is_global))
    if filters.delivery is not None:
        query = query.where(EventConsumer.delivery == filters.delivery)
    return query


async def page(
    session: AsyncSession, owner_uuid: uuid.UUID | None, filters: ConsumerFilters, page: Page
) -> Paged[EventConsumer]:
    order = (
        (EventConsumer.created.desc(), EventConsumer.uuid.desc())
        if filters.descending
        else (EventConsumer.created, EventConsumer.uuid)
    )
    return await fetch_paged(session, filtered(owner_uuid, filters), *order, page=page)


async def count(
    session: AsyncSession, owner_uuid: uuid.UUID | None, filters: ConsumerFilters
) -> int:
    query = filtered(owner_uuid, filters)
    total = await session.scalar(select(func.count()).select_from(query.subquery()))
    return int(total or 0)


async def identity_with_owner(
    session: AsyncSession, identity_uuid: uuid.UUID
) -> tuple[AgentIdentity, User | None] | None:
    row = (
        await session.execute(
            select(AgentIdentity, User)
            .outerjoin(User, User.uuid == AgentIdentity.created_by)
            .where(AgentIdentity.uuid == identity_uuid)
        )
    ).first()
    return (row[0], row[1]) if row is not None else None


async def of_identity(session: AsyncSession, identity_uuid: uuid.UUID) -> EventConsumer | None:
    found: EventConsumer | None = await session.scalar(
        select(EventConsumer).where(EventConsumer.agent_identity_uuid == identity_uuid)
    )
    return found


def scope_key(
    offerings: Collection[uuid.UUID],
    bindings: Collection[tuple[str, uuid.UUID]] = (),
    *,
    is_global: bool = False,
) -> str:
    """The key of a set of bindings: unique per owner among the consumers registered through
    /api/event-consumers/register/. A set of offerings alone keeps the key it always had
    (sha256 of their sorted hex), so consumers registered before other bindings existed are
    found again."""
    if is_global:
        joined = "global"
    elif not bindings:
        joined = ",".join(sorted(offering.hex for offering in offerings))
    else:
        every = [("offering", o) for o in offerings] + list(bindings)
        joined = ",".join(sorted(f"{kind}:{entity.hex}" for kind, entity in every))
    return hashlib.sha256(joined.encode("ascii")).hexdigest()


async def with_scope_key(
    session: AsyncSession, owner_uuid: uuid.UUID, key: str
) -> EventConsumer | None:
    """The owner's consumer registered for the set of offerings whose scope_key this is."""
    found: EventConsumer | None = await session.scalar(
        select(EventConsumer).where(
            EventConsumer.user_uuid == owner_uuid, EventConsumer.scope_key == key
        )
    )
    return found


async def identity_exists(session: AsyncSession, identity_uuid: uuid.UUID) -> bool:
    found = await session.scalar(
        select(AgentIdentity.uuid).where(AgentIdentity.uuid == identity_uuid)
    )
    return found is not None


async def of_owner(session: AsyncSession, owner_uuid: uuid.UUID) -> list[EventConsumer]:
    return list(await session.scalars(consumers(owner_uuid)))


async def of_identities(
    session: AsyncSession, identity_uuids: Sequence[uuid.UUID]
) -> list[EventConsumer]:
    if not identity_uuids:
        return []
    rows = await session.scalars(
        select(EventConsumer).where(EventConsumer.agent_identity_uuid.in_(list(identity_uuids)))
    )
    return list(rows)


async def scoped_only_to(
    session: AsyncSession, offering_uuid: uuid.UUID, owner_uuid: uuid.UUID | None = None
) -> list[EventConsumer]:
    """Consumers bound to this offering and nothing else (of one owner, or anyone's).

    Those lose their reason to exist with the offering or the owner's access to it
    (contract §9, Lifecycle); a consumer bound to other offerings, or to a customer,
    project or user as well (contract §12), only loses this binding.
    """
    query = (
        select(EventConsumer)
        .join(EventConsumerScope, EventConsumerScope.consumer_uuid == EventConsumer.uuid)
        .where(EventConsumerScope.offering_uuid == offering_uuid)
    )
    if owner_uuid is not None:
        query = query.where(EventConsumer.user_uuid == owner_uuid)
    return [
        consumer
        for consumer in await session.scalars(query)
        if {scope.offering_uuid for scope in consumer.scopes} == {offering_uuid}
        and not consumer.bindings
    ]


async def scopes_of_owner_for(
    session: AsyncSession, owner_uuid: uuid.UUID, offering_uuid: uuid.UUID
) -> list[EventConsumerScope]:
    rows = await session.scalars(
        select(EventConsumerScope)
        .join(EventConsumer, EventConsumer.uuid == EventConsumerScope.consumer_uuid)
        .where(
            EventConsumer.user_uuid == owner_uuid,
            EventConsumerScope.offering_uuid == offering_uuid,
        )
    )
    return list(rows)


async def count_of_owner(session: AsyncSession, owner_uuid: uuid.UUID) -> int:
    total = await session.scalar(select(func.count()).where(EventConsumer.user_uuid == owner_uuid))
    return int(total or 0)


async def needing_password(
    session: AsyncSession,
    owner_uuid: uuid.UUID,
    password_hash: str | None,
    *,
    also: Collection[str] = (),
) -> list[EventConsumer]:
    """The owner's consumers whose row says another password than the owner's current one,
    and those whose broker user is named in `also` (found wrong on the broker)."""
    differs = EventConsumer.broker_password_hash.is_distinct_from(password_hash)
    named = [found for found in (topology.uuid_of(name) for name in also) if found is not None]
    rows = await session.scalars(
        consumers(owner_uuid).where(
            or_(differs, EventConsumer.uuid.in_(named)) if named else differs,
            CONSUMER_ON_BROKER,  # a webhook consumer has no broker user
        )
    )
    return list(rows)


# Per owner (a consumer, or a subscription queue), the last entry of its range in
# `ix_deliveries_delivered`: one index entry read however many copies it has (migration
# 0018_delivered_by_owner). The owner expression and the state are written out for the
# planner to match the index.
_LAST_DELIVERED = text(
    f"""
SELECT c.uuid, (SELECT max(finished) FROM deliveries
                WHERE {DELIVERY_OWNER} = c.uuid AND state = 'published')
FROM unnest(:owners) AS c(uuid)
"""  # noqa: S608 - the models' constant
).bindparams(bindparam("owners", type_=ARRAY(Uuid())))


async def last_delivered(
    session: AsyncSession, owner_uuids: Collection[uuid.UUID]
) -> dict[uuid.UUID, datetime]:
    """Per consumer (or subscription queue): when the broker last confirmed a copy for it
    (one query for a page)."""
    if not owner_uuids:
        return {}
    rows = await session.execute(_LAST_DELIVERED, {"owners": list(owner_uuids)})
    return {owner: _utc(at) for owner, at in rows if owner is not None and at is not None}


async def away_since(
    session: AsyncSession, keys: Collection[tuple[str, str]]
) -> dict[tuple[str, str], datetime]:
    """Per (vhost, queue name) without a consumer now: since when (one query for a page)."""
    if not keys:
        return {}
    rows = await session.execute(
        select(QueuePresence.vhost, QueuePresence.queue_name, QueuePresence.away_since).where(
            tuple_(QueuePresence.vhost, QueuePresence.queue_name).in_(list(keys)),
            QueuePresence.consumers == 0,
            QueuePresence.away_since.is_not(None),
        )
    )
    return {(vhost, name): _utc(at) for vhost, name, at in rows if at is not None}


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


_ENTITIES: dict[str, type[Offering | Project | Customer | User]] = {
    "offering": Offering,
    "project": Project,
    "customer": Customer,
    "user": User,
}


async def entity_exists(session: AsyncSession, kind: str, entity: uuid.UUID) -> bool:
    return await session.get(_ENTITIES[kind], entity) is not None


_MAY_BIND = text("SELECT " + binding_allowed_sql(":user", ":kind", ":entity", ":now")).bindparams(
    bindparam("user", type_=Uuid()),
    bindparam("kind", type_=String()),
    bindparam("entity", type_=Uuid()),
    bindparam("now", type_=AwareDateTime()),
)


async def may_bind(
    session: AsyncSession, user_uuid: uuid.UUID, kind: str, entity: uuid.UUID | None
) -> bool:
    """Whether the user may hold this binding now (`global` with no entity): the rule the
    delivery checks again (events/authorization.binding_allowed_sql)."""
    found = await session.scalar(
        _MAY_BIND, {"user": user_uuid, "kind": kind, "entity": entity, "now": utcnow()}
    )
    return bool(found)


_BOUND = "unnest(:consumers, :owners, :kinds, :entities) AS b(consumer, owner, kind, entity)"
_ALLOWED = binding_allowed_sql("b.owner", "b.kind", "b.entity", ":now")
_MAY_RECEIVE = text(
    f"SELECT DISTINCT b.consumer FROM {_BOUND} WHERE {_ALLOWED}"  # noqa: S608 - constants
).bindparams(
    bindparam("consumers", type_=ARRAY(Uuid())),
    bindparam("owners", type_=ARRAY(Uuid())),
    bindparam("kinds", type_=ARRAY(String())),
    bindparam("entities", type_=ARRAY(Uuid())),
    bindparam("now", type_=AwareDateTime()),
)


async def authorized_now(
    session: AsyncSession, bindings: Collection[tuple[uuid.UUID, uuid.UUID, str, uuid.UUID | None]]
) -> set[uuid.UUID]:
    """Of (consumer, owner, kind, entity) bindings, the consumers whose owner may hold at
    least one of them now (one query for a page)."""
    if not bindings:
        return set()
    columns = list(zip(*bindings, strict=True))
    rows = await session.scalars(
        _MAY_RECEIVE,
        {
            "consumers": list(columns[0]),
            "owners": list(columns[1]),
            "kinds": list(columns[2]),
            "entities": list(columns[3]),
            "now": utcnow(),
        },
    )
    return set(rows)


# The rule copies are published by, for a copy of event `e` to the subscription queue
# `queue` or the consumer `consumer` for the offering `offering` (a fan-out copy's own, else
# its event's). The outer aliases are not those authorized_sql uses inside (`c`, `u`, ...).
def _copy_authorized(queue: str, consumer: str, offering: str) -> str:
    return authorized_sql(
        queue, consumer, offering, ":now", "e.project_uuid", "e.subject_user_uuid"
    )


# The queues holding a copy the broker confirmed since `:since` that their owner may not
# receive now. The rule is judged once per distinct (queue, offering, project, subject) of
# those copies, not once per copy: a queue's copies share a few keys.
def _holding_unauthorized(*copies_of: str) -> TextClause:
    recent = " UNION ".join(
        f"""SELECT DISTINCT d.consumer_uuid, d.queue_uuid,
                COALESCE(d.offering_uuid, e.offering_uuid) AS offering,
                e.project_uuid AS project, e.subject_user_uuid AS subject
            FROM deliveries d JOIN events e ON e.event_id = d.event_id
            WHERE d.state = 'published' AND d.finished >= :since AND {which}"""  # noqa: S608
        for which in copies_of
    )
    return text(
        f"""
        WITH recent AS MATERIALIZED ({recent})
        SELECT DISTINCT 'consumer', oc.uuid, oc.user_uuid
        FROM recent r JOIN event_consumers oc ON oc.uuid = r.consumer_uuid
        WHERE oc.delivery = 'rmq' AND NOT {
            authorized_sql("NULL::uuid", "oc.uuid", "r.offering", ":now", "r.project", "r.subject")
        }
        UNION
        SELECT DISTINCT 'queue', oq.uuid, os.user_uuid
        FROM recent r JOIN event_subscription_queues oq ON oq.uuid = r.queue_uuid
        JOIN event_subscriptions os ON os.uuid = oq.subscription_uuid
        WHERE NOT {
            authorized_sql("oq.uuid", "NULL::uuid", "r.offering", ":now", "r.project", "r.subject")
        }
        """  # noqa: S608 - the module's constants
    ).bindparams(
        bindparam("since", type_=AwareDateTime()),
        bindparam("now", type_=AwareDateTime()),
    )


_HOLDING_UNAUTHORIZED_ANY = _holding_unauthorized("true")
_HOLDING_UNAUTHORIZED = _holding_unauthorized(
    # Each an index scan of the owners' queues' copies (`= ANY(ARRAY(...))`: one array,
    # computed once).
    """d.consumer_uuid = ANY(ARRAY(
        SELECT uuid FROM event_consumers WHERE user_uuid = ANY(:owners)))""",
    """d.queue_uuid = ANY(ARRAY(
        SELECT q.uuid FROM event_subscription_queues q
        JOIN event_subscriptions s ON s.uuid = q.subscription_uuid
        WHERE s.user_uuid = ANY(:owners)))""",
).bindparams(bindparam("owners", type_=ARRAY(Uuid())))


@dataclass(frozen=True)
class Held:
    """A queue that may hold copies its owner may no longer receive: a consumer's
    (`kind` "consumer", `key` its uuid) or a legacy subscription queue's ("queue")."""

    kind: str
    key: uuid.UUID
    owner_uuid: uuid.UUID


async def holding_unauthorized_copies(
    session: AsyncSession, owner_uuids: Collection[uuid.UUID] | None, since: datetime, now: datetime
) -> list[Held]:
    """The queues of these owners (None: of every owner) that the broker confirmed a copy to
    since `since` which their owner may not receive at `now`: the queues that may hold
    copies to take out (docs/decisions/030-queued-copies-on-every-access-loss.md). One
    query."""
    if owner_uuids is not None and not owner_uuids:
        return []
    times = {"since": since, "now": now}
    rows = await (
        session.execute(_HOLDING_UNAUTHORIZED_ANY, times)
        if owner_uuids is None
        else session.execute(_HOLDING_UNAUTHORIZED, {**times, "owners": list(owner_uuids)})
    )
    return [Held(kind, key, owner) for kind, key, owner in rows]


_UNAUTHORIZED_COPIES = text(
    f"""
    SELECT m.position FROM unnest(:events, :offerings) WITH ORDINALITY
        AS m(event_id, offering, position)
    JOIN events e ON e.event_id = m.event_id
    WHERE NOT {_copy_authorized(":queue", ":consumer", "COALESCE(m.offering, e.offering_uuid)")}
    """  # noqa: S608 - the module's constants
).bindparams(
    bindparam("events", type_=ARRAY(String())),
    bindparam("offerings", type_=ARRAY(Uuid())),
    bindparam("queue", type_=Uuid()),
    bindparam("consumer", type_=Uuid()),
    bindparam("now", type_=AwareDateTime()),
)


async def unauthorized_copies(
    session: AsyncSession,
    held: Held,
    copies: Sequence[tuple[str | None, str | None]],
    now: datetime,
) -> set[int]:
    """Of copies in the queue `held`, as (event id, offering hex), the positions of those
    its owner may not receive at `now` (one query for a batch). A copy of an event no longer
    stored (past retention), or without an event id, is kept: nothing says it is not."""
    offerings = [_uuid_or_none(offering) for _, offering in copies]
    rows = await session.scalars(
        _UNAUTHORIZED_COPIES,
        {
            "events": [event or "" for event, _ in copies],
            "offerings": offerings,
            "queue": held.key if held.kind == "queue" else None,
            "consumer": held.key if held.kind == "consumer" else None,
            "now": now,
        },
    )
    return {int(position) - 1 for position in rows}


async def subscription_queue(
    session: AsyncSession, queue_uuid: uuid.UUID
) -> EventSubscriptionQueue | None:
    """A legacy subscription queue (agent 1.0.5), read afresh."""
    found: EventSubscriptionQueue | None = await session.scalar(
        select(EventSubscriptionQueue)
        .where(EventSubscriptionQueue.uuid == queue_uuid)
        .execution_options(populate_existing=True)
    )
    return found


async def set_subscription_password_hash(
    session: AsyncSession, subscription_uuid: uuid.UUID, password_hash: str | None
) -> None:
    """Record the password last given to a subscription's broker user."""
    await session.execute(
        update(EventSubscription)
        .where(EventSubscription.uuid == subscription_uuid)
        .values(broker_password_hash=password_hash)
    )


# --- the owners whose queued copies are judged again (contract §14) ----------------------
# Rows of `access_sweeps` are written by the triggers of migration 0016_access_changes; one
# more row, of its own reason and the nil owner, keeps in `at` the time up to which role
# and token expiries have been swept (docs/decisions/030-queued-copies-on-every-access-loss.md).
EXPIRY_WATERMARK = "expiry_watermark"
_WATERMARK_OWNER = uuid.UUID(int=0)


@dataclass(frozen=True)
class Sweeps:
    """The access changes waiting to be swept: their rows, their owners, and whether one
    was about every owner (an offering, customer or project changed)."""

    ids: list[int]
    owners: set[uuid.UUID]
    every: bool


async def pending_sweeps(session: AsyncSession) -> Sweeps:
    rows = (
        await session.execute(
            select(AccessSweep.id, AccessSweep.owner_uuid).where(
                AccessSweep.reason != EXPIRY_WATERMARK
            )
        )
    ).all()
    return Sweeps(
        [row_id for row_id, _ in rows],
        {owner for _, owner in rows if owner is not None},
        any(owner is None for _, owner in rows),
    )


async def expiry_watermark(session: AsyncSession) -> datetime | None:
    found: datetime | None = await session.scalar(
        select(func.max(AccessSweep.at)).where(AccessSweep.reason == EXPIRY_WATERMARK)
    )
    return _utc(found) if found is not None else None


async def expired_between(
    session: AsyncSession, after: datetime, until: datetime
) -> set[uuid.UUID]:
    """The users with a role or a token whose expiry fell in (after, until] (two index range
    reads: ix_roles_expires_at, ix_users_token_expires_at)."""
    roles = select(Role.user_uuid).where(Role.expires_at > after, Role.expires_at <= until)
    tokens = select(User.uuid).where(User.token_expires_at > after, User.token_expires_at <= until)
    return set(await session.scalars(roles.union(tokens)))


def _nothing_to_sweep() -> Select[tuple[bool]]:
    now = bindparam("now", type_=DateTime(timezone=True))
    after = func.coalesce(
        select(func.max(AccessSweep.at))
        .where(AccessSweep.reason == EXPIRY_WATERMARK)
        .scalar_subquery(),
        bindparam("since", type_=DateTime(timezone=True)),
    )
    return select(
        ~select(AccessSweep.id).where(AccessSweep.reason != EXPIRY_WATERMARK).exists()
        & ~select(Role.uuid).where(Role.expires_at > after, Role.expires_at <= now).exists()
        & ~select(User.uuid)
        .where(User.token_expires_at > after, User.token_expires_at <= now)
        .exists()
    )


# Built once: it runs every few seconds on an idle service, and building it cost as much as
# running it.
_NOTHING_TO_SWEEP = _nothing_to_sweep()


async def nothing_to_sweep(session: AsyncSession, now: datetime, since: datetime) -> bool:
    """No access change waits and no role or token expired between the watermark (`since`
    when there is none) and `now`: what a sweep would find, read in one statement."""
    return bool(await session.scalar(_NOTHING_TO_SWEEP, {"now": now, "since": since}))


async def sweeps_done(
    session: AsyncSession,
    ids: Collection[int],
    watermark: datetime,
    failed_owners: Collection[uuid.UUID],
) -> None:
    """Forget the swept rows `ids` (by id: a row committed meanwhile with a lower id than
    these is not among them and stays), move the expiry watermark to `watermark`, and
    leave a row for each owner whose sweep failed, for the next run."""
    if ids:
        await session.execute(delete(AccessSweep).where(AccessSweep.id.in_(list(ids))))
    moved = await session.execute(
        update(AccessSweep).where(AccessSweep.reason == EXPIRY_WATERMARK).values(at=watermark)
    )
    if not getattr(moved, "rowcount", 0):
        session.add(AccessSweep(owner_uuid=_WATERMARK_OWNER, reason=EXPIRY_WATERMARK, at=watermark))
    session.add_all(
        AccessSweep(owner_uuid=owner, reason="sweep_failed") for owner in sorted(failed_owners)
    )


def _uuid_or_none(value: str | None) -> uuid.UUID | None:
    try:
        return uuid.UUID(value) if value else None
    except ValueError:
        return None


async def delete_bindings_on(
    session: AsyncSession, scopes: Collection[tuple[str, uuid.UUID]]
) -> None:
    """Delete the bindings of these (type, uuid): their entity is going. A consumer left with
    none receives nothing (it is not global: that is a flag of its own)."""
    if scopes:
        await session.execute(
            delete(EventConsumerBinding).where(
                tuple_(EventConsumerBinding.scope_type, EventConsumerBinding.scope_uuid).in_(
                    list(scopes)
                )
            )
        )


async def fresh(session: AsyncSession, consumer_uuid: uuid.UUID) -> EventConsumer | None:
    """The consumer read again, its owner and bindings with it (a row this session wrote
    has none of its relationships loaded)."""
    found: EventConsumer | None = await session.scalar(
        select(EventConsumer)
        .where(EventConsumer.uuid == consumer_uuid)
        .execution_options(populate_existing=True)
    )
    return found


@dataclass(frozen=True)
class Pending:
    """A webhook consumer's copies waiting for their receiver (contract §13's status)."""

    pending: int = 0
    oldest_pending_at: datetime | None = None
    next_attempt_at: datetime | None = None


# `state = 'pending' AND webhook` written out: the predicate of ix_deliveries_webhook_pending,
# which the planner matches only literally (migration 0015_webhooks). The next attempt is the
# head's, the oldest pending copy: the one holding the others back (contract §14), whose due
# times say nothing while it waits.
_PENDING = text(
    """
SELECT count(*), min(created), (
    SELECT next_attempt_at FROM deliveries
    WHERE consumer_uuid = :consumer AND state = 'pending' AND webhook
    ORDER BY id LIMIT 1)
FROM deliveries
WHERE consumer_uuid = :consumer AND state = 'pending' AND webhook
"""
).bindparams(bindparam("consumer", type_=Uuid()))


async def webhook_pending(session: AsyncSession, consumer_uuid: uuid.UUID) -> Pending:
    row = (await session.execute(_PENDING, {"consumer": consumer_uuid})).one()
    return Pending(
        int(row[0] or 0),
        _utc(row[1]) if row[1] is not None else None,
        _utc(row[2]) if row[2] is not None else None,
    )


async def active_roles(session: AsyncSession, now: datetime) -> list[tuple[Role, str]]:
    """Every role grant that has not expired, with its user's username, oldest first."""
    rows = await session.execute(
        select(Role, User.username)
        .join(User, User.uuid == Role.user_uuid)
        .where(or_(Role.expires_at.is_(None), Role.expires_at > now))
        .order_by(Role.created, Role.uuid)
    )
    return [(role, username) for role, username in rows]


# --- what a consumer can see of its copies (contract §14; docs/decisions/031-delivery-log.md)
# The API's states, as conditions on the copy states they are made of, written out so the
# planner matches the partial indexes' predicates: a copy the broker dead-lettered
# (`rejected`, a full queue) was given up as far as its consumer can tell.
_LISTED_STATES: dict[str, str] = {
    "pending": "deliveries.state = 'pending'",
    "delivered": "deliveries.state = 'published'",
    "parked": "deliveries.state = 'parked'",
    "given_up": "deliveries." + GIVEN_UP_STATES,
}
# How many copies a list counts at most: a consumer with a million copies is counted to
# here, not through (docs/decisions/031-delivery-log.md).
COUNT_LIMIT = 10000
_LISTED = (
    Delivery.id,
    Delivery.event_id,
    Event.object_type,
    Event.accepted,
    Delivery.state,
    Delivery.replay,
    Delivery.attempts,
    Delivery.last_attempt_at,
    Delivery.next_attempt_at,
    Delivery.finished,
    Delivery.last_status,
    Delivery.last_error,
    Delivery.given_up_reason,
    Delivery.webhook,
)


def _copy_filters(
    consumer_uuid: uuid.UUID, filters: DeliveryFilters
) -> tuple[list[ColumnElement[bool] | TextClause], bool]:
    """The conditions of the filters, and whether any reads the event (a count without
    one need not join it: every copy has its event)."""
    # `= ANY` of a one-element array rather than `=`: the planner then keeps the consumer in
    # the order `copies_page` asks for, which only `ix_deliveries_consumer_copies` (or the
    # given-up one) yields. With `=`, it may walk the primary key backwards and filter,
    # which reads every newer copy of every other consumer first: 460 ms for a page when a
    # million newer copies were another consumer's (docs/decisions/031-delivery-log.md).
    where: list[ColumnElement[bool] | TextClause] = [
        Delivery.consumer_uuid == any_(literal([consumer_uuid], ARRAY(Uuid())))
    ]
    if filters.state is not None:
        where.append(text(_LISTED_STATES[filters.state]))
    if filters.event_id is not None:
        where.append(Delivery.event_id == filters.event_id)
    on_event: list[ColumnElement[bool] | TextClause] = []
    if filters.object_type is not None:
        on_event.append(Event.object_type == filters.object_type)
    if filters.accepted_after is not None:
        on_event.append(Event.accepted > filters.accepted_after)
    if filters.accepted_before is not None:
        on_event.append(Event.accepted < filters.accepted_before)
    return where + on_event, bool(on_event)


@dataclass(frozen=True)
class CopiesPage:
    """One page of a consumer's copies: how many match (at most COUNT_LIMIT: `capped` when
    more do), its rows, and whether a row follows them."""

    total: int
    capped: bool
    rows: list[RowMapping]
    more: bool


async def copies_page(
    session: AsyncSession, consumer_uuid: uuid.UUID, filters: DeliveryFilters, page: Page
) -> CopiesPage:
    """One page of the consumer's copies, newest first (by id: the order copies were made,
    which is acceptance order for every copy but a replay's), and how many match, counted
    to COUNT_LIMIT. Read through `ix_deliveries_consumer_copies` (the given up ones through
    `ix_deliveries_consumer_given_up`): the first page of a million copies reads a page of
    index entries, its count at most COUNT_LIMIT + 1 of them."""
    where, on_event = _copy_filters(consumer_uuid, filters)
    matching: Select[tuple[Any]] = select(literal_column("1")).select_from(Delivery)
    if on_event:
        matching = matching.join(Event, Event.event_id == Delivery.event_id)
    counted = select(func.count()).select_from(
        matching.where(*where).limit(COUNT_LIMIT + 1).subquery()
    )
    # The count rides on the page's statement (evaluated once, as an InitPlan): a round trip
    # fewer; it is asked on its own only for a page past the end, which has no row to carry it.
    rows = list(
        (
            await session.execute(
                select(*_LISTED, counted.scalar_subquery().label("matching"))
                .join(Event, Event.event_id == Delivery.event_id)
                .where(*where)
                .order_by(Delivery.consumer_uuid.desc(), Delivery.id.desc())
                .offset(page.offset)
                .limit(page.page_size + 1)
            )
        ).mappings()
    )
    total = int(rows[0]["matching"] if rows else await session.scalar(counted) or 0)
    return CopiesPage(
        min(total, COUNT_LIMIT),
        total > COUNT_LIMIT,
        rows[: page.page_size],
        len(rows) > page.page_size,
    )


async def copy_of_event(
    session: AsyncSession, consumer_uuid: uuid.UUID, event_id: str
) -> RowMapping | None:
    """The consumer's newest copy of the event (a replay's, if it was replayed), with its
    attempt log."""
    row = (
        await session.execute(
            select(*_LISTED, Delivery.attempt_log)
            .join(Event, Event.event_id == Delivery.event_id)
            .where(Delivery.consumer_uuid == consumer_uuid, Delivery.event_id == event_id)
            .order_by(Delivery.id.desc())
            .limit(1)
        )
    ).first()
    return row._mapping if row is not None else None
