"""Consumers (contract §9): one queue, one broker user, many object types, scoped to offerings.

Registration works like create_queue: validate (access, body) before the broker
is touched; then, holding the owner's vhost lock and the broker-users lock
shared, make the broker side real (vhost and dead-letter queue, broker user with
the owner's token as password and read on this one queue only, the queue with
the spec's arguments read back); then re-check access locked and commit the row.
A new consumer whose row cannot be committed has its broker user and queue
removed again, so nothing half-made is left. Names are derived from the
consumer's uuid, which is stable per identity: a restarting agent gets the same
queue, and messages queued while it was away are still there.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.exc import StaleDataError

from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementError
from queuekeeper.broker.provisioner import Provisioner, QueueConflict, best_effort
from queuekeeper.common import locks
from queuekeeper.common.pagination import Page, Paged
from queuekeeper.common.quotas import check_quota
from queuekeeper.common.schemas import find_by_path_uuid, parse_path_uuid
from queuekeeper.config import Settings
from queuekeeper.consumers import repository
from queuekeeper.consumers.schemas import (
    ConsumerFilters,
    ConsumerRegistration,
    QueueRegistration,
    token_prefix,
)
from queuekeeper.exceptions import BadRequest, Conflict, Forbidden, NotFound
from queuekeeper.models import (
    BrokerState,
    EventConsumer,
    EventConsumerScope,
    Offering,
    User,
    utcnow,
)
from queuekeeper.observability.metrics import CONSUMER_REGISTRATIONS
from queuekeeper.subscriptions import repository as subscriptions_repository
from queuekeeper.subscriptions.service import BrokerLeftovers, remove_leftovers

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _Wanted:
    """What a registration asks for, validated."""

    owner: User
    offerings: list[uuid.UUID]
    object_types: list[str] | None  # None: keep the current filter
    identity_uuid: uuid.UUID | None
    token_prefix: str  # of the token this registration came with


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
    wanted = _Wanted(
        owner=user,
        offerings=[identity.offering_uuid],
        object_types=body.object_types,
        identity_uuid=identity.uuid,
        token_prefix=token_prefix(token),
    )
    existing = await repository.of_identity(session, identity.uuid)
    return await _register(session, provisioner, settings, "register_queue", wanted, existing)


async def register(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    user: User,
    token: str,
    body: ConsumerRegistration,
) -> tuple[EventConsumer, bool]:
    """`POST /api/event-consumers/register/`: the caller's consumer for these offerings."""
    offerings = [scope.uuid for scope in body.scopes]
    wanted = _Wanted(
        owner=user,
        offerings=offerings,
        object_types=body.object_types,
        identity_uuid=None,
        token_prefix=token_prefix(token),
    )
    existing = await repository.with_scopes(session, user.uuid, offerings)
    return await _register(session, provisioner, settings, "api", wanted, existing)


async def _check_offerings(
    session: AsyncSession, owner: User, offerings: Sequence[uuid.UUID], *, lock: bool = False
) -> None:
    for index, offering_uuid in enumerate(offerings):
        if not lock and await session.get(Offering, offering_uuid) is None:
            raise BadRequest(
                f"Unknown offering {offering_uuid.hex}: the backend has not pushed it.",
                field=f"scopes.{index}.uuid",
            )
        if not await subscriptions_repository.has_access(
            session, owner.uuid, offering_uuid, lock=lock
        ):
            raise Forbidden(f"You have no access to offering {offering_uuid.hex}.")


async def _register(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    route: str,
    wanted: _Wanted,
    existing: EventConsumer | None,
) -> tuple[EventConsumer, bool]:
    if existing is None:
        held = await repository.count_of_owner(session, wanted.owner.uuid)
        check_quota(settings, "max_consumers_per_user", held, "event consumers")
    try:
        consumer, created = await _make_real(session, provisioner, wanted, existing)
    except QueueConflict:
        CONSUMER_REGISTRATIONS.labels(route=route, outcome="conflict").inc()
        raise
    except ManagementError:
        CONSUMER_REGISTRATIONS.labels(route=route, outcome="broker_unavailable").inc()
        raise
    CONSUMER_REGISTRATIONS.labels(route=route, outcome="created" if created else "reused").inc()
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


async def _make_real(
    session: AsyncSession,
    provisioner: Provisioner,
    wanted: _Wanted,
    existing: EventConsumer | None,
) -> tuple[EventConsumer, bool]:
    owner = wanted.owner
    owner_uuid, password_hash = owner.uuid, owner.broker_password_hash
    await _check_offerings(session, owner, wanted.offerings)
    # Nothing stays open while we wait on the broker.
    await session.commit()

    consumer_uuid = existing.uuid if existing is not None else uuid.uuid4()
    vhost = topology.vhost_name(owner_uuid)
    queue_name = topology.consumer_queue_name(consumer_uuid)
    # Held shared from before the broker objects are made until the row is committed:
    # reconcile and the deletions take them exclusively and re-check the rows, so they
    # never take this consumer's queue, user or vhost for an orphan.
    async with (
        locks.guard(session, locks.vhost_key(vhost), exclusive=False),
        locks.guard(session, locks.BROKER_USERS_KEY, exclusive=False),
    ):
        try:
            await provisioner.ensure_vhost(vhost)
            await provisioner.ensure_consumer_user(vhost, consumer_uuid, password_hash)
            await provisioner.ensure_queue(vhost, queue_name, known=existing is not None)
            await _check_offerings(session, owner, wanted.offerings, lock=True)
            if existing is None:
                consumer = EventConsumer(
                    uuid=consumer_uuid,
                    user_uuid=owner_uuid,
                    agent_identity_uuid=wanted.identity_uuid,
                    object_types=list(wanted.object_types or []),
                    queue_name=queue_name,
                    vhost=vhost,
                    broker_password_hash=password_hash,
                    broker_state=BrokerState.OK,
                    auth_token_prefix=wanted.token_prefix,
                    scopes=[EventConsumerScope(offering_uuid=o) for o in wanted.offerings],
                )
                session.add(consumer)
            else:
                consumer = existing
                _update(consumer, wanted, password_hash)
            await session.commit()
        except (IntegrityError, StaleDataError) as exc:
            await session.rollback()
            if existing is None:
                await _unmake(provisioner, vhost, consumer_uuid)
            winner = (
                await repository.of_identity(session, wanted.identity_uuid)
                if wanted.identity_uuid is not None
                else None
            )
            if winner is None:
                raise NotFound(
                    "The identity, an offering or the consumer was deleted while the queue "
                    "was being registered; register again."
                ) from exc
            # A concurrent first registration of the same identity committed first. End the
            # read with a commit: the guard's rollback would expire what is returned.
            await session.commit()
            return winner, False
        except BaseException:
            await session.rollback()
            if existing is None:
                await _unmake(provisioner, vhost, consumer_uuid)
            raise
    return consumer, existing is None


def _update(consumer: EventConsumer, wanted: _Wanted, password_hash: str | None) -> None:
    if wanted.object_types is not None:
        consumer.object_types = list(wanted.object_types)
    bound = {scope.offering_uuid for scope in consumer.scopes}
    if bound != set(wanted.offerings):
        # The identity was moved to another offering (PUT): follow it, as Waldur does.
        consumer.scopes = [EventConsumerScope(offering_uuid=o) for o in wanted.offerings]
    consumer.broker_password_hash = password_hash
    consumer.broker_state = BrokerState.OK
    consumer.auth_token_prefix = wanted.token_prefix
    consumer.modified = utcnow()


async def _unmake(provisioner: Provisioner, vhost: str, consumer_uuid: uuid.UUID) -> None:
    """Remove what a registration made for a consumer whose row was never committed."""
    await best_effort(
        "delete_user", provisioner.delete_consumer_user(consumer_uuid), consumer=consumer_uuid.hex
    )
    name = topology.consumer_queue_name(consumer_uuid)
    await best_effort("delete_queue", provisioner.delete_queue(vhost, name), queue=name)


# --- reading and deleting -------------------------------------------------------------------
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
    consumer = await get_consumer(session, caller, consumer_uuid)
    await delete_consumers(session, provisioner, [consumer])


async def delete_consumers(
    session: AsyncSession, provisioner: Provisioner, consumers: Sequence[EventConsumer]
) -> None:
    """Delete the rows, then their queues and broker users (and the vhost if it emptied)."""
    if not consumers:
        return
    leftovers = BrokerLeftovers().add_consumers(consumers)
    for consumer in consumers:
        await session.delete(consumer)
    await session.commit()
    log.info("consumers_deleted", consumers=[consumer.uuid.hex for consumer in consumers])
    await remove_leftovers(session, provisioner, leftovers)
