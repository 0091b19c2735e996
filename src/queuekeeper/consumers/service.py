"""Consumers (contract §9): one queue, one broker user, many object types, scoped to offerings.

Registration: validate (access, body) before any lock or broker call; then, holding
the owner lock with the owner's vhost lock and the broker-users lock shared
(docs/decisions/002-owner-lock.md), find the consumer this call repeats (by identity,
or by owner and set of offerings: both unique in the database), count the quota, read
the owner's current token, and make the broker side real (vhost and dead-letter queue,
broker user with that token as password and read on this one queue only, the queue
with the spec's arguments read back); then re-check access locked and commit the row.
A registration whose row cannot be committed has its broker user and queue removed
again unless a row has them (and the vhost unless a row uses it), so nothing half-made
is left. Names are derived from the consumer's uuid, which is stable per identity: a
restarting agent gets the same queue, and messages queued while it was away are still
there.

What both kinds of consumer share is here: reading, deleting, resyncing, the delivery log,
and the rules a webhook consumer's registration builds on (`Wanted`, `check_bindings`,
`new_consumer`, `staff_only`); what only a webhook consumer has is webhooks/service.py's.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import structlog
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm.exc import StaleDataError

from queuekeeper.auth.repository import UserGone, login_hash_now
from queuekeeper.broker import sieve, topology
from queuekeeper.broker.management import ManagementError
from queuekeeper.broker.provisioner import Provisioner, QueueConflict, best_effort
from queuekeeper.common.pagination import Page, Paged
from queuekeeper.common.quotas import check_quota
from queuekeeper.common.schemas import find_by_path_uuid, parse_path_uuid
from queuekeeper.config import Settings
from queuekeeper.consumers import repository
from queuekeeper.consumers.schemas import (
    ConsumerFacts,
    ConsumerFilters,
    ConsumerRegistration,
    DeliveryDetailOut,
    DeliveryFilters,
    DeliveryOut,
    QueueRegistration,
    RowBlockedReason,
    bindings_of,
    token_prefix,
)
from queuekeeper.events import outbox
from queuekeeper.events.outbox import Outbox, Snapshot
from queuekeeper.events.recipients import Copy
from queuekeeper.exceptions import BadRequest, Conflict, Forbidden, NotFound
from queuekeeper.models import (
    BrokerState,
    EventConsumer,
    EventConsumerBinding,
    EventConsumerScope,
    Offering,
    Role,
    User,
    utcnow,
)
from queuekeeper.observability.metrics import CONSUMER_REGISTRATIONS
from queuekeeper.owners.repository import has_access
from queuekeeper.owners.service import (
    BrokerLeftovers,
    owner_locked,
    owner_login_hash,
    remove_leftovers_held,
    unmake,
)

log = structlog.get_logger(__name__)

# `delivery` of a consumer that receives by HTTP (contract §13).
WEBHOOK = "webhook"
# Why a webhook consumer's waiting copies were given up when it went.
CONSUMER_DELETED = "the consumer was deleted"


async def give_up_copies_of_webhooks_deleted(
    session: AsyncSession,
    consumers: Collection[EventConsumer],
    now: datetime,
    reason: str = CONSUMER_DELETED,
) -> int:
    """Before these consumers' rows go (in the same transaction): the copies not yet
    delivered of those that receive by webhook, given up as `consumer_deleted`. No claim
    takes a webhook copy whose consumer is gone; a queue consumer's are given up by the
    relay, which finds its queue gone (docs/decisions/027-webhook-registration.md)."""
    webhooks = [consumer.uuid for consumer in consumers if consumer.delivery == WEBHOOK]
    return await outbox.give_up_waiting(
        session, now, reason, "consumer_deleted", consumer_uuids=webhooks
    )


@dataclass(frozen=True)
class Wanted:
    """What a registration asks for, validated."""

    owner: User
    offerings: list[uuid.UUID]
    object_types: list[str] | None  # None: keep the current filter
    identity_uuid: uuid.UUID | None
    owner_uuid: uuid.UUID  # read once: a rollback expires `owner`
    token_prefix: str  # of the token this registration came with
    # /api/event-consumers/register/ only (contract §12): the bindings other than offerings,
    # whether the set is empty (global), the payload filters (None: keep the current ones).
    bindings: tuple[tuple[str, uuid.UUID], ...] = ()
    is_global: bool = False
    payload_filters: dict[str, list[Any]] | None = None

    @property
    def key(self) -> str:
        return repository.scope_key(self.offerings, self.bindings, is_global=self.is_global)


async def register_queue(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    user: User,
    token: str,
    identity_uuid: str,
    body: QueueRegistration,
) -> tuple[EventConsumer, bool]:
    """waldur-site-agent 1.0.7's one set-up call: the identity's consumer; True when new.

    Any user's identity is looked up (not only the caller's), so that another user's is a
    Conflict naming its owner rather than NotFound (Waldur answers the same).
    """
    parsed = parse_path_uuid(identity_uuid)
    found = await repository.identity_with_owner(session, parsed) if parsed else None
    if found is None:
        raise NotFound(
            f"Agent identity {identity_uuid!r} not found (never registered, deleted, or its "
            "offering was deleted): register the identity again."
        )
    identity, owner = found
    if identity.created_by != user.uuid:
        whose = f"user {owner.username!r}" if owner is not None else "a user who was deleted"
        raise Conflict(
            f"Agent identity {identity.uuid.hex} belongs to {whose}; its queue is registered "
            "by its owner only. Register an identity of your own."
        )
    wanted = Wanted(
        owner=user,
        offerings=[identity.offering_uuid],
        object_types=body.object_types,
        identity_uuid=identity.uuid,
        owner_uuid=user.uuid,
        token_prefix=token_prefix(token),
    )
    return await _register(session, provisioner, settings, "register_queue", wanted)


async def register(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    user: User,
    token: str,
    body: ConsumerRegistration,
) -> tuple[EventConsumer, bool]:
    """`POST /api/event-consumers/register/`: the caller's consumer for this set of bindings
    (contract §12): offerings, projects, customers, users, or none (global)."""
    wanted = Wanted(
        owner=user,
        offerings=[scope.uuid for scope in body.scopes if scope.type == "offering"],
        object_types=body.object_types,
        identity_uuid=None,
        owner_uuid=user.uuid,
        token_prefix=token_prefix(token),
        bindings=tuple((s.type, s.uuid) for s in body.scopes if s.type != "offering"),
        is_global=not body.scopes,
        payload_filters=body.payload_filters,
    )
    return await _register(session, provisioner, settings, "api", wanted)


_REFUSED = {
    "offering": "you have no access to it (a grant, or a role on it, its customer or its project)",
    "project": "you hold no role on it or on its customer",
    "customer": "you hold no role on it",
    "user": "only staff and support users may bind another user",
}


async def check_bindings(session: AsyncSession, wanted: Wanted, *, lock: bool = False) -> None:
    """Refuse what the registration may not hold: an agent identity's offering needs a grant
    (contract §9); /api/event-consumers/register/'s bindings follow contract §12."""
    if wanted.identity_uuid is not None:
        await _check_offerings(session, wanted.owner_uuid, wanted.offerings, lock=lock)
        return
    if wanted.is_global:
        if not await repository.may_bind(session, wanted.owner_uuid, "global", None):
            raise Forbidden(
                "An empty list of scopes registers a global consumer (every event), which "
                "only staff and support users may do: list the entities to bind.",
                field="scopes",
            )
        return
    scopes = [("offering", o) for o in wanted.offerings] + list(wanted.bindings)
    for index, (kind, entity) in enumerate(scopes):
        if not lock and not await repository.entity_exists(session, kind, entity):
            raise BadRequest(
                f"Unknown {kind} {entity.hex}: the backend has not pushed it.",
                field=f"scopes.{index}.uuid",
            )
        # An offering grant is kept (FOR SHARE) until the row commits, as for an agent.
        if kind == "offering" and await has_access(session, wanted.owner_uuid, entity, lock=lock):
            continue
        if not await repository.may_bind(session, wanted.owner_uuid, kind, entity):
            raise Forbidden(
                f"You may not bind {kind} {entity.hex}: {_REFUSED[kind]}.",
                field=f"scopes.{index}",
            )


async def _check_offerings(
    session: AsyncSession, owner_uuid: uuid.UUID, offerings: Sequence[uuid.UUID], *, lock: bool
) -> None:
    for index, offering_uuid in enumerate(offerings):
        if not lock and await session.get(Offering, offering_uuid) is None:
            raise BadRequest(
                f"Unknown offering {offering_uuid.hex}: the backend has not pushed it.",
                field=f"scopes.{index}.uuid",
            )
        if not await has_access(session, owner_uuid, offering_uuid, lock=lock):
            raise Forbidden(f"You have no access to offering {offering_uuid.hex}.")


async def _register(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    route: str,
    wanted: Wanted,
) -> tuple[EventConsumer, bool]:
    try:
        consumer, created, _dropped = await _make_real(session, provisioner, settings, wanted)
    except QueueConflict:
        CONSUMER_REGISTRATIONS.labels(route=route, outcome="conflict").inc()
        raise
    except ManagementError:
        CONSUMER_REGISTRATIONS.labels(route=route, outcome="broker_unavailable").inc()
        raise
    CONSUMER_REGISTRATIONS.labels(route=route, outcome="created" if created else "reused").inc()
    # An identity moved to another offering (`_dropped`): what its queue holds of the old one
    # goes with the `sweep_access` job, which the scopes' trigger wakes
    # (docs/decisions/030-queued-copies-on-every-access-loss.md).
    log.info(
        "consumer_created" if created else "consumer_reused",
        consumer=consumer.uuid.hex,
        queue=consumer.queue_name,
        vhost=consumer.vhost,
        identity=wanted.identity_uuid.hex if wanted.identity_uuid else None,
        object_types=consumer.object_types or "all",
        route=route,
    )
    return consumer, created


def new_consumer(
    consumer_uuid: uuid.UUID, owner_uuid: uuid.UUID, wanted: Wanted, **columns: Any
) -> EventConsumer:
    """A new consumer row with its scopes and bindings: one transaction with the consumer,
    so a global one is never half-written."""
    return EventConsumer(
        uuid=consumer_uuid,
        user_uuid=owner_uuid,
        object_types=list(wanted.object_types or []),
        broker_state=BrokerState.OK,
        auth_token_prefix=wanted.token_prefix,
        scopes=[EventConsumerScope(offering_uuid=o) for o in wanted.offerings],
        bindings=[
            EventConsumerBinding(scope_type=kind, scope_uuid=entity)
            for kind, entity in wanted.bindings
        ],
        is_global=wanted.is_global,
        payload_filters=dict(wanted.payload_filters or {}),
        **columns,
    )


async def _existing(session: AsyncSession, wanted: Wanted) -> EventConsumer | None:
    """The consumer this registration is a repeat of: the identity's, or the owner's for the
    same set of offerings. Both are unique keys in the database."""
    if wanted.identity_uuid is not None:
        return await repository.of_identity(session, wanted.identity_uuid)
    return await repository.with_scope_key(session, wanted.owner_uuid, wanted.key)


async def _make_real(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    wanted: Wanted,
) -> tuple[EventConsumer, bool, set[uuid.UUID]]:
    """The consumer, whether it is new, and the offerings it stopped being scoped to."""
    owner_uuid = wanted.owner_uuid
    # Refused before any lock is taken or the broker touched; checked again, locked, below.
    await check_bindings(session, wanted)
    await session.commit()

    vhost = topology.vhost_name(owner_uuid)
    touched: uuid.UUID | None = None  # the consumer whose broker objects this call wrote
    dropped: set[uuid.UUID] = set()
    # The owner lock, from the look-up, the quota count and the read of the owner's token
    # to the commit: identical calls find the first one's row, parallel ones cannot pass
    # the quota together, and the broker user gets the token the database holds when the
    # row lands (docs/decisions/002-owner-lock.md). The vhost and broker-users locks,
    # shared: reconcile takes them exclusively and re-checks the rows, so it never takes
    # this consumer's queue, user or vhost for an orphan.
    try:
        async with owner_locked(session, owner_uuid, vhost_exclusive=False, broker_users=True):
            existing = await _existing(session, wanted)
            if existing is None:
                if wanted.identity_uuid is not None and not await repository.identity_exists(
                    session, wanted.identity_uuid
                ):
                    raise _Gone
                held = await repository.count_of_owner(session, owner_uuid)
                check_quota(settings, "max_consumers_per_user", held, "event consumers")
            password_hash = await owner_login_hash(session, owner_uuid)
            consumer_uuid = existing.uuid if existing is not None else uuid.uuid4()
            queue_name = topology.consumer_queue_name(consumer_uuid)
            touched = consumer_uuid
            await provisioner.ensure_vhost(vhost)
            await provisioner.ensure_consumer_user(vhost, consumer_uuid, password_hash)
            await provisioner.ensure_queue(vhost, queue_name, known=existing is not None)
            await check_bindings(session, wanted, lock=True)
            if existing is None:
                consumer = new_consumer(
                    consumer_uuid,
                    owner_uuid,
                    wanted,
                    agent_identity_uuid=wanted.identity_uuid,
                    scope_key=None if wanted.identity_uuid is not None else wanted.key,
                    queue_name=queue_name,
                    vhost=vhost,
                    broker_password_hash=password_hash,
                )
                session.add(consumer)
            else:
                consumer = existing
                dropped = _update(consumer, wanted, password_hash)
                for offering_uuid in dropped:
                    await outbox.give_up_waiting(
                        session,
                        utcnow(),
                        "the consumer is no longer scoped to the offering (its identity moved)",
                        "not_authorized",
                        consumer_uuids=[consumer_uuid],
                        offering_uuid=offering_uuid,
                    )
            await session.commit()
    except (IntegrityError, StaleDataError, _Gone) as exc:
        if touched is not None:
            await _unmake(session, provisioner, owner_uuid, touched)
        # The unique keys are the last word: a row that won them is this call's answer.
        winner = await _existing(session, wanted)
        if winner is None:
            raise NotFound(
                "The identity, an offering or the consumer was deleted while the queue "
                "was being registered; register again."
            ) from exc
        # End the read with a commit: a rollback would expire what is returned.
        await session.commit()
        return winner, False, set()
    except BaseException:
        if touched is not None:
            await _unmake(session, provisioner, owner_uuid, touched)
        raise
    return consumer, existing is None, dropped


class _Gone(Exception):
    """The identity went before its consumer was made."""


def _update(consumer: EventConsumer, wanted: Wanted, password_hash: str | None) -> set[uuid.UUID]:
    """Bring the row to what the registration asks; returns the offerings it loses."""
    if wanted.object_types is not None:
        consumer.object_types = list(wanted.object_types)
    if wanted.payload_filters is not None:
        consumer.payload_filters = dict(wanted.payload_filters)
    bound = {scope.offering_uuid for scope in consumer.scopes}
    dropped = bound - set(wanted.offerings)
    if bound != set(wanted.offerings):
        # The identity was moved to another offering (PUT): follow it, as Waldur does.
        consumer.scopes = [EventConsumerScope(offering_uuid=o) for o in wanted.offerings]
    consumer.broker_password_hash = password_hash
    consumer.broker_state = BrokerState.OK
    consumer.auth_token_prefix = wanted.token_prefix
    consumer.modified = utcnow()
    return dropped


async def _unmake(
    session: AsyncSession, provisioner: Provisioner, owner_uuid: uuid.UUID, consumer_uuid: uuid.UUID
) -> None:
    """After a registration that wrote the broker and did not commit: its broker user and
    queue go unless a row has them, and the owner's vhost unless a row uses it."""
    await unmake(
        session,
        provisioner,
        owner_uuid,
        consumers=[consumer_uuid],
        queues=[topology.consumer_queue_name(consumer_uuid)],
    )


# --- reading and deleting -------------------------------------------------------------------
async def facts_of(
    session: AsyncSession, settings: Settings, consumers: Sequence[EventConsumer]
) -> dict[uuid.UUID, ConsumerFacts]:
    """What each answer says beyond its row: the last copy confirmed, and why events cannot
    reach it as far as the database tells. A fixed number of queries for a whole page."""
    if not consumers:
        return {}
    # A webhook's deliveries are settled on its row (`ConsumerOut.of` reads it there).
    delivered = await repository.last_delivered(
        session, [c.uuid for c in consumers if c.delivery != WEBHOOK]
    )
    authorized = await repository.authorized_now(
        session,
        [
            (c.uuid, c.user_uuid, kind, entity)
            for c in consumers
            for kind, entity in ([("global", None)] if c.is_global else bindings_of(c))
        ],
    )
    away = await repository.away_since(session, {(c.vhost, c.queue_name) for c in consumers})
    now = utcnow()
    park_after = timedelta(seconds=settings.park_after_seconds)
    return {
        c.uuid: ConsumerFacts(
            last_delivered_at=delivered.get(c.uuid),
            delivery_blocked_reason=_blocked(c, c.uuid in authorized, away, now, park_after),
        )
        for c in consumers
    }


def _blocked(
    consumer: EventConsumer,
    authorized: bool,
    away: dict[tuple[str, str], datetime],
    now: datetime,
    park_after: timedelta,
) -> RowBlockedReason | None:
    """The first reason that holds, in the order of the status answer's (contract §11)."""
    owner = consumer.owner
    if not owner.is_active:
        return "owner_inactive"
    if owner.token_hash is None:
        return "no_token"
    if owner.token_expires_at is not None and owner.token_expires_at <= now:
        return "token_expired"
    if not authorized:  # no binding it holds may reach its owner now
        return "no_access"
    if consumer.delivery == WEBHOOK:
        # Contract §13: a 410 stops it until an update; a failed last attempt is retried.
        if consumer.webhook_gone_at is not None:
            return "webhook_gone"
        if consumer.webhook_failing_since is not None:
            return "webhook_failing"
        return None
    since = away.get((consumer.vhost, consumer.queue_name))
    if since is not None and now - since >= park_after:
        return "agent_away"
    return None


async def list_consumers(
    session: AsyncSession, caller: User | None, filters: ConsumerFilters, page: Page
) -> Paged[EventConsumer]:
    """The caller's consumers; every consumer for a service token (`caller` None)."""
    return await repository.page(session, caller.uuid if caller else None, filters, page)


async def count_consumers(
    session: AsyncSession, caller: User | None, filters: ConsumerFilters
) -> int:
    return await repository.count(session, caller.uuid if caller else None, filters)


async def get_consumer(
    session: AsyncSession, caller: User | None, consumer_uuid: str
) -> EventConsumer:
    """By its path uuid: the caller's (any, for a service token); NotFound otherwise."""
    return await find_by_path_uuid(
        consumer_uuid,
        "Event consumer",
        lambda parsed: repository.get(session, parsed, caller.uuid if caller else None),
    )


async def delete_consumer(
    session: AsyncSession, provisioner: Provisioner, caller: User | None, consumer_uuid: str
) -> None:
    """Delete the row and, under the owner lock before it commits, its queue and broker user
    (and the vhost if it emptied): a registration in flight cannot make them again. A
    webhook consumer has neither: its copies not yet delivered are given up."""
    found = await get_consumer(session, caller, consumer_uuid)
    owner_uuid, key = found.user_uuid, found.uuid
    await session.commit()
    async with owner_locked(session, owner_uuid, vhost_exclusive=True):
        consumer = await repository.get(session, key)
        if consumer is None:
            raise NotFound(f"Event consumer {consumer_uuid!r} not found.")
        await give_up_copies_of_webhooks_deleted(session, [consumer], utcnow())
        leftovers = BrokerLeftovers().add_consumers([consumer])  # none for a webhook
        await session.delete(consumer)
        await session.flush()
        await remove_leftovers_held(session, provisioner, leftovers)
        await session.commit()
    log.info("consumers_deleted", consumers=[key.hex])


@dataclass(frozen=True)
class Swept:
    """What one sweep did: the queues read through, and the owners of those that failed."""

    queues: int
    removed: int
    failed_owners: frozenset[uuid.UUID]


async def remove_unauthorized_copies(
    session: AsyncSession,
    provisioner: Provisioner,
    owner_uuids: Collection[uuid.UUID] | None,
    *,
    on_failure: Callable[[str, str], None] | None = None,
) -> Swept:
    """After these owners (None: every owner) may have lost access, in whatever way: take
    out of their queues the copies they may no longer receive, by the rule copies are
    published by (`authorized_sql`), keeping the others in order
    (docs/decisions/030-queued-copies-on-every-access-loss.md). Only a queue that was sent
    such a copy within its messages' time to live is read through. Called by the
    `sweep_access` job alone (consumers/sweep.py); a queue that cannot be read through is
    logged, told to `on_failure(queue, reason)` and its owner returned, the others go on."""
    now = utcnow()
    since = now - timedelta(milliseconds=provisioner.settings.queue_message_ttl_ms)
    holding = await repository.holding_unauthorized_copies(session, owner_uuids, since, now)
    await session.commit()
    failed: set[uuid.UUID] = set()
    removed = 0
    for held in holding:
        try:
            sieved = await _sieve(session, provisioner, held)
        except Exception as exc:  # the next run tries this owner again
            await session.rollback()
            log.warning(
                "unauthorized_copies_not_removed",
                queue=f"{held.kind}:{held.key.hex}",
                error=repr(exc),
            )
            if on_failure is not None:
                on_failure(f"{held.kind}:{held.key.hex}", repr(exc)[:500])
            failed.add(held.owner_uuid)
            continue
        removed += sieved.removed
    return Swept(len(holding), removed, frozenset(failed))


def _unauthorized_reader(
    session: AsyncSession, settings: Settings, held: repository.Held
) -> Callable[[str, str], Awaitable[sieve.Sieved]]:
    """Reads a queue through, removing the copies its owner may no longer receive."""

    async def unauthorized(copies: Sequence[sieve.QueuedCopy]) -> set[int]:
        return await repository.unauthorized_copies(
            session, held, [(copy.event_id, copy.offering_uuid) for copy in copies], utcnow()
        )

    async def read_through(vhost: str, queue: str) -> sieve.Sieved:
        return await sieve.remove_copies(settings, vhost, queue, unauthorized)

    return read_through


async def _sieve(
    session: AsyncSession, provisioner: Provisioner, held: repository.Held
) -> sieve.Sieved:
    """Read the queue `held` through, removing what its owner may no longer receive.

    Under the owner lock, its broker login (the consumer's, or the legacy queue's
    subscription's) is switched off and its connections closed (what the agent held
    unacked goes back to the queue) while the queue is read through, then given the
    owner's current password again. A queue gone meanwhile, or a webhook consumer's (it
    has no queue: what it had not received is judged as it is posted), holds nothing."""
    async with owner_locked(session, held.owner_uuid, vhost_exclusive=False):
        row = await (
            repository.get(session, held.key)
            if held.kind == "consumer"
            else repository.subscription_queue(session, held.key)
        )
        if row is None or (isinstance(row, EventConsumer) and row.delivery == WEBHOOK):
            await session.commit()
            return sieve.Sieved(0, 0)
        set_password: Callable[[uuid.UUID, str | None], Awaitable[None]]
        if isinstance(row, EventConsumer):
            login = row.uuid
            set_password = provisioner.set_consumer_password
        else:
            login = row.subscription_uuid
            set_password = provisioner.set_subscription_password
        vhost, queue = row.vhost, row.queue_name
        try:
            await set_password(login, None)
            await provisioner.close_connections([login.hex])
            sieved = await _unauthorized_reader(session, provisioner.settings, held)(vhost, queue)
        finally:
            try:
                password_hash = await login_hash_now(session, held.owner_uuid)
            except UserGone:
                password_hash = None
            await best_effort("set_password", set_password(login, password_hash), login=login.hex)
            if isinstance(row, EventConsumer):
                row.broker_password_hash = password_hash
            else:
                await repository.set_subscription_password_hash(
                    session, row.subscription_uuid, password_hash
                )
            await session.commit()
    log.info(
        "unauthorized_copies_removed",
        queue=f"{held.kind}:{held.key.hex}",
        removed=sieved.removed,
        kept=sieved.kept,
    )
    return sieved


# --- what staff and support users and the service token alone may do --------------------
def staff_only(caller: User | None, action: str) -> None:
    """Webhook consumers (webhooks/service.py) and resyncs are for staff and support users
    and the service token."""
    if caller is not None and not (caller.is_staff or caller.is_support):
        raise Forbidden(
            f"Only staff and support users (or the service token) may {action}: your user "
            f"{caller.username!r} is neither. Register a queue consumer "
            "(/api/event-consumers/register/) instead."
        )


# What a resync sends (contract §13): the current state of these object types.
RESYNC_TYPES = ["user_role"]


def _snapshot(run: str, consumer_hex: str, role: Role, username: str) -> Snapshot:
    """One role grant as a `user_role` event whose scope keys are the role's: its offering or
    project, and its user (the keys a live `user_role` event of that role has)."""
    return Snapshot(
        event_id=f"resync:{consumer_hex}:{run}:{role.uuid.hex}",
        # The envelope's fields as every message body has them (events/service.py).
        payload={
            "object_type": "user_role",
            **({"offering_uuid": role.scope_uuid.hex} if role.scope_type == "offering" else {}),
            "event_type": "role_snapshot",
            "user_uuid": role.user_uuid.hex,
            "user_username": username,
            "role_name": role.role_name,
            "scope_type": role.scope_type,
            "scope_uuid": role.scope_uuid.hex,
            "expires_at": role.expires_at.isoformat() if role.expires_at else None,
        },
        offering_uuid=role.scope_uuid if role.scope_type == "offering" else None,
        project_uuid=role.scope_uuid if role.scope_type == "project" else None,
        subject_user_uuid=role.user_uuid,
    )


async def resync(
    session: AsyncSession,
    engine: AsyncEngine,
    settings: Settings,
    caller: User | None,
    consumer_uuid: str,
) -> tuple[list[str], int]:
    """`POST /api/event-consumers/{uuid}/resync/`: every active role grant the consumer may
    receive (within its bindings, through its filters, its owner authorized now) becomes one
    `user_role` event with one copy for this consumer alone, delivered through its own path
    (its queue, or its webhook). Event ids are new per resync, so a receiver tells two
    resyncs apart. Returns the object types and how many copies were queued."""
    staff_only(caller, "resync a consumer")
    consumer = await get_consumer(session, caller, consumer_uuid)
    now = utcnow()
    snapshots: list[Snapshot] = []
    if not consumer.object_types or "user_role" in consumer.object_types:
        filters = dict(consumer.payload_filters or {})
        run, consumer_hex = uuid.uuid4().hex, consumer.uuid.hex
        for role, username in await repository.active_roles(session, now):
            found = _snapshot(run, consumer_hex, role, username)
            if all(found.payload.get(name) in values for name, values in filters.items()):
                snapshots.append(found)
    target = Copy(None, consumer.uuid, consumer.queue_name, consumer.vhost)
    webhook = consumer.delivery == WEBHOOK
    await session.commit()
    written = await Outbox(engine, settings).add_resync(target, webhook, snapshots, now)
    log.info(
        "consumer_resync",
        consumer=target.consumer_uuid.hex if target.consumer_uuid else None,
        roles=len(snapshots),
        copies=written,
    )
    return list(RESYNC_TYPES), written


# --- what a consumer can see of its copies (contract §14; docs/decisions/031-delivery-log.md)
async def _visible(session: AsyncSession, caller: User | None, consumer_uuid: str) -> uuid.UUID:
    """As `get_consumer`, for routes that read only the consumer's copies: its uuid."""
    return await find_by_path_uuid(
        consumer_uuid,
        "Event consumer",
        lambda parsed: repository.visible(session, parsed, caller.uuid if caller else None),
    )


async def deliveries(
    session: AsyncSession,
    caller: User | None,
    consumer_uuid: str,
    filters: DeliveryFilters,
    page: Page,
) -> tuple[repository.CopiesPage, list[DeliveryOut]]:
    """`GET /api/event-consumers/{uuid}/deliveries/`: the consumer's copies, newest first
    (and how many, counted to `repository.COUNT_LIMIT`); NotFound for another user's
    consumer (any, for a service token)."""
    found = await repository.copies_page(
        session, await _visible(session, caller, consumer_uuid), filters, page
    )
    await session.commit()
    return found, [DeliveryOut.of(row) for row in found.rows]


async def delivery(
    session: AsyncSession, caller: User | None, consumer_uuid: str, event_id: str
) -> DeliveryDetailOut:
    """`GET /api/event-consumers/{uuid}/deliveries/{event_id}/`: the consumer's newest copy
    of the event with its attempt log; NotFound when it has none."""
    consumer = await _visible(session, caller, consumer_uuid)
    row = await repository.copy_of_event(session, consumer, event_id)
    await session.commit()
    if row is None:
        raise NotFound(
            f"Event consumer {consumer.hex} has no copy of event {event_id!r}: the event "
            "was not for it (its bindings, filters or its owner's access), or it is past "
            "retention."
        )
    return DeliveryDetailOut.of_detail(row)
