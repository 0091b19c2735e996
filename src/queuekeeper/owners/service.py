"""An owner's lock, its broker login, and the broker objects its deletions leave behind.

Every registration and deletion of a user's subscriptions and consumers holds the owner
lock throughout (docs/decisions/002-owner-lock.md); a deletion removes the broker objects
(best-effort: a broker outage never blocks it) before it commits, so no registration can
make them again in between. Subscriptions, consumers, identities and the directory all
build on this; it imports none of them.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.auth.repository import UserGone, login_hash_now
from queuekeeper.broker import topology
from queuekeeper.broker.provisioner import Provisioner, best_effort
from queuekeeper.common import locks
from queuekeeper.exceptions import Unauthorized
from queuekeeper.models import EventConsumer, EventSubscription, EventSubscriptionQueue
from queuekeeper.owners import repository


@dataclass
class BrokerLeftovers:
    """Broker objects whose rows a deletion is about to remove (directly or by cascade)."""

    queues: list[tuple[str, str]] = field(default_factory=list)  # (vhost, queue name)
    subscription_uuids: list[uuid.UUID] = field(default_factory=list)
    owner_uuids: set[uuid.UUID] = field(default_factory=set)
    # Consumers (contract §9) leave a broker user each; their queues are in `queues`.
    consumer_uuids: list[uuid.UUID] = field(default_factory=list)

    def add_consumers(self, consumers: Sequence[EventConsumer]) -> BrokerLeftovers:
        # A webhook consumer has no queue and no broker user (contract §13).
        consumers = [consumer for consumer in consumers if consumer.delivery == "rmq"]
        self.queues.extend((consumer.vhost, consumer.queue_name) for consumer in consumers)
        self.consumer_uuids.extend(consumer.uuid for consumer in consumers)
        self.owner_uuids.update(consumer.user_uuid for consumer in consumers)
        return self

    @classmethod
    def of(
        cls, subscriptions: list[EventSubscription], queues: list[EventSubscriptionQueue]
    ) -> BrokerLeftovers:
        return cls(
            queues=[(queue.vhost, queue.queue_name) for queue in queues],
            subscription_uuids=[subscription.uuid for subscription in subscriptions],
            owner_uuids={subscription.user_uuid for subscription in subscriptions},
        )


async def collect_leftovers(
    session: AsyncSession, subscriptions: list[EventSubscription]
) -> BrokerLeftovers:
    queues = await repository.queues_of_subscriptions(session, [s.uuid for s in subscriptions])
    return BrokerLeftovers.of(subscriptions, queues)


@asynccontextmanager
async def owner_locked(
    session: AsyncSession,
    owner_uuid: uuid.UUID,
    *,
    vhost_exclusive: bool,
    broker_users: bool = False,
) -> AsyncIterator[None]:
    """Hold the owner lock, then the owner's vhost lock (and, for a registration making a
    broker user, the broker-users lock shared) until the session's transaction ends, taken
    in one statement (docs/decisions/002-owner-lock.md). Registrations take the vhost lock
    shared (as create_queue does), deletions exclusively; always in this order, so none
    deadlock."""
    wanted = [
        (locks.user_key(owner_uuid), True),
        (locks.vhost_key(topology.vhost_name(owner_uuid)), vhost_exclusive),
    ]
    if broker_users:
        wanted.append((locks.BROKER_USERS_KEY, False))
    async with locks.guard_all(session, wanted):
        yield


async def owner_login_hash(session: AsyncSession, owner_uuid: uuid.UUID) -> str | None:
    """The hash the owner's broker users get now, read under the owner lock."""
    try:
        return await login_hash_now(session, owner_uuid)
    except UserGone:
        raise Unauthorized("Your user was deleted while this call was in flight.") from None


async def remove_leftovers_held(
    session: AsyncSession, provisioner: Provisioner, leftovers: BrokerLeftovers
) -> None:
    """Remove from the broker what a deletion is about to commit, inside its transaction.

    The caller holds `owner_locked(..., vhost_exclusive=True)` for every owner of
    `leftovers` and has flushed its deletions; it commits afterwards. No registration of
    those owners runs meanwhile, so what is removed here cannot be made again before the
    rows are gone: a deletion that commits leaves nothing of them on the broker. Broker
    failures are logged (the rows still go; reconcile removes the rest).
    """
    await _remove_users(provisioner, leftovers)
    emptied = set()
    for owner_uuid in leftovers.owner_uuids:
        if not await repository.owner_uses_vhost(session, owner_uuid):
            vhost = topology.vhost_name(owner_uuid)
            emptied.add(vhost)
            await best_effort("delete_vhost", provisioner.delete_vhost(vhost), vhost=vhost)
    for vhost, names in _queues_by_vhost(leftovers, emptied).items():
        registered = await repository.registered_queue_names(session, vhost, names)
        for name in names:
            if name not in registered:
                await best_effort(
                    "delete_queue", provisioner.delete_queue(vhost, name), vhost=vhost, queue=name
                )


async def unmake(
    session: AsyncSession,
    provisioner: Provisioner,
    owner_uuid: uuid.UUID,
    *,
    subscriptions: Sequence[uuid.UUID] = (),
    consumers: Sequence[uuid.UUID] = (),
    queues: Sequence[str] = (),
) -> None:
    """Take back what a registration made for rows that were never committed: the broker
    users, the queues (unless a row has them), and the owner's vhost if no row uses it,
    under the owner lock and the vhost lock exclusively."""
    await session.rollback()
    leftovers = BrokerLeftovers(
        queues=[(topology.vhost_name(owner_uuid), name) for name in queues],
        subscription_uuids=list(subscriptions),
        owner_uuids={owner_uuid},
        consumer_uuids=list(consumers),
    )
    async with owner_locked(session, owner_uuid, vhost_exclusive=True):
        # Another call of the owner may have committed a row for the same broker objects
        # (a consumer's queue and user are named after its uuid, reused by a repeat).
        kept = await repository.existing_consumers(session, leftovers.consumer_uuids)
        leftovers.consumer_uuids = [c for c in leftovers.consumer_uuids if c not in kept]
        await remove_leftovers_held(session, provisioner, leftovers)
        await session.commit()


async def _remove_users(provisioner: Provisioner, leftovers: BrokerLeftovers) -> None:
    # Deleting a broker user also closes its connections.
    for subscription_uuid in leftovers.subscription_uuids:
        await best_effort(
            "delete_user",
            provisioner.delete_subscription_user(subscription_uuid),
            subscription=subscription_uuid.hex,
        )
    for consumer_uuid in leftovers.consumer_uuids:
        await best_effort(
            "delete_user",
            provisioner.delete_consumer_user(consumer_uuid),
            consumer=consumer_uuid.hex,
        )


def _queues_by_vhost(leftovers: BrokerLeftovers, emptied: set[str]) -> dict[str, list[str]]:
    by_vhost: dict[str, list[str]] = {}
    for vhost, name in leftovers.queues:
        if vhost not in emptied:  # a deleted vhost took its queues with it
            by_vhost.setdefault(vhost, []).append(name)
    return by_vhost


async def remove_leftovers(
    session: AsyncSession, provisioner: Provisioner, leftovers: BrokerLeftovers
) -> None:
    """Remove from the broker what a committed deletion of many owners' rows (an offering's)
    left behind; failures are logged."""
    await _remove_users(provisioner, leftovers)
    emptied = set()
    for owner_uuid in leftovers.owner_uuids:
        vhost = topology.vhost_name(owner_uuid)
        # create_subscription and register_queue hold this lock shared until their row is
        # committed: counted under it exclusively, no subscription and no consumer means
        # nobody is about to use the vhost.
        async with locks.guard(session, locks.vhost_key(vhost), exclusive=True):
            if not await repository.owner_uses_vhost(session, owner_uuid):
                emptied.add(vhost)
                await best_effort("delete_vhost", provisioner.delete_vhost(vhost), vhost=vhost)
            # Commit (nothing to write) to release the lock: a rollback would expire
            # every object the caller still holds.
            await session.commit()
    for vhost, names in _queues_by_vhost(leftovers, emptied).items():
        await delete_unregistered_queues(session, provisioner, vhost, names)


async def delete_unregistered_queues(
    session: AsyncSession, provisioner: Provisioner, vhost: str, names: list[str]
) -> None:
    """Delete broker queues whose rows were deleted, unless registered again meanwhile.

    create_queue and register_queue hold the vhost lock shared from their broker declare
    to their commit, so under the lock held exclusively a name without a row stays
    without one.
    """
    async with locks.guard(session, locks.vhost_key(vhost), exclusive=True):
        registered = await repository.registered_queue_names(session, vhost, names)
        for name in names:
            if name not in registered:
                await best_effort(
                    "delete_queue", provisioner.delete_queue(vhost, name), vhost=vhost, queue=name
                )
        await session.commit()  # releases the lock without expiring the caller's objects
