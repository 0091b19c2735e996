"""Stale subscriptions and consumers: those of users who were deactivated or whose token
expired.

They are removed with everything they own on the broker: queues, broker users,
and the vhost when they were its owner's last. Users deleted by the backend lose
their subscriptions at once (cascade); what the broker kept of them (had it
been down) is removed here too: vhosts of ours nobody uses, users of ours no
subscription owns.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

from queuekeeper.broker import topology
from queuekeeper.common.locks import guard, user_key
from queuekeeper.consumers import repository as consumers_repository
from queuekeeper.consumers import service as consumers_service
from queuekeeper.jobs.runs import JobContext, Run
from queuekeeper.models import utcnow
from queuekeeper.reconcile import guard as deletion_guard
from queuekeeper.reconcile import repository
from queuekeeper.reconcile.access import BrokerAccess
from queuekeeper.reconcile.service import (
    orphan_user_candidates,
    remove_orphan_users,
    remove_unused_vhost,
)


async def cleanup_stale(context: JobContext, run: Run) -> None:
    now = utcnow()
    async with context.sessions() as session:
        owners = await repository.stale_owners(session, now)
    run.find("stale_users", len(owners))
    for done, (owner, reason) in enumerate(owners, 1):
        async with run.item(f"user {owner.hex}"):
            await remove_subscriptions_of(context, run, owner, reason)
        run.report("stale users", done, len(owners))

    # Leftovers of deleted users (and of any removal whose broker clean-up failed).
    management, provisioner = context.management, context.provisioner
    owned = set(await provisioner.owned_vhosts())
    async with repository.reader(context.engine) as reader:
        expected = await repository.subscribed_vhosts(reader)
        unused = sorted(owned - expected)
        access = await BrokerAccess.load(management, provisioner, set())
        users = access.ours()
        orphan_users = await orphan_user_candidates(reader, users)
        in_unused = await deletion_guard.queues_in(management, unused)
        # Not counted: the queues of vhosts in use, which this job never deletes.
        if not deletion_guard.allows(
            context,
            run,
            owned=len(owned) + len(users) + sum(in_unused.values()),
            vhosts=in_unused,
            users=len(orphan_users),
        ):
            return
        for vhost in unused:
            run.find("vhosts_unused")
            async with run.item(vhost):
                await remove_unused_vhost(context, run, reader, vhost)
        await remove_orphan_users(context, run, reader, orphan_users)


async def remove_subscriptions_of(
    context: JobContext, run: Run, owner: uuid.UUID, reason: str
) -> None:
    # The owner lock, held (on a connection of its own) until the broker is cleaned too: no
    # registration of the owner can make again what is being removed
    # (docs/decisions/002-owner-lock.md).
    async with context.sessions() as holder, guard(holder, user_key(owner), exclusive=True):
        await _remove_subscriptions_of(context, run, owner, reason)


async def _remove_subscriptions_of(
    context: JobContext, run: Run, owner: uuid.UUID, reason: str
) -> None:
    vhost = topology.vhost_name(owner)
    async with context.sessions() as session:
        # Checked again with the user's row locked: a token pushed since the query wins.
        if not await repository.lock_if_still_stale(session, owner, utcnow()):
            run.find("no_longer_stale")
            return
        subscriptions, queues = await repository.subscriptions_with_queues(session, owner)
        consumers = await consumers_repository.of_owner(session, owner)
        run.find("stale_subscriptions", len(subscriptions))
        run.find("stale_queues", len(queues))
        run.find("stale_consumers", len(consumers))
        if run.dry_run:
            for subscription in subscriptions:
                run.planned("delete_subscription", f"subscription {subscription.uuid.hex}", reason)
                run.planned("delete_user", f"broker user {subscription.uuid.hex}", reason)
            on_broker = [c for c in consumers if c.delivery == "rmq"]
            for consumer in consumers:
                run.planned("delete_consumer", f"consumer {consumer.uuid.hex}", reason)
                if consumer in on_broker:  # a webhook consumer has no broker user
                    run.planned("delete_user", f"broker user {consumer.uuid.hex}", reason)
            run.planned(
                "delete_vhost", vhost, f"{reason}; with its {len(queues) + len(on_broker)} queues"
            )
            return
        await consumers_service.give_up_copies_of_webhooks_deleted(
            session, consumers, utcnow(), f"the consumer was removed: {reason}"
        )
        for row in [*subscriptions, *consumers]:
            await session.delete(row)  # queue rows and scopes go by cascade
        await session.commit()
    for subscription in subscriptions:
        run.done(
            "subscriptions_removed",
            "delete_subscription",
            f"subscription {subscription.uuid.hex}",
            reason,
        )
    for consumer in consumers:
        run.done("consumers_removed", "delete_consumer", f"consumer {consumer.uuid.hex}", reason)

    # The rows are gone: now the broker, item by item (a failure is left to the next run).
    users: list[tuple[uuid.UUID, Callable[[uuid.UUID], Awaitable[bool]]]] = [
        (s.uuid, context.provisioner.delete_subscription_user) for s in subscriptions
    ]
    # A webhook consumer has no broker user and no queue (contract §13).
    consumers = [c for c in consumers if c.delivery == "rmq"]
    users += [(c.uuid, context.provisioner.delete_consumer_user) for c in consumers]
    for row_uuid, delete_user in users:
        async with run.item(f"broker user {row_uuid.hex}"):
            if await delete_user(row_uuid):
                run.done("users_deleted", "delete_user", f"broker user {row_uuid.hex}", reason)
    async with run.item(vhost), repository.reader(context.engine) as reader:
        await remove_unused_vhost(context, run, reader, vhost)
        if await context.management.get_vhost(vhost) is None:
            return  # its queues went with it
        # The owner registered again meanwhile: the vhost stays, the old queues go.
        names = [queue.queue_name for queue in queues] + [c.queue_name for c in consumers]
        for name in names:
            async with run.item(f"{vhost}/{name}"):
                if await context.provisioner.delete_queue(vhost, name):
                    run.done("queues_deleted", "delete_queue", f"{vhost}/{name}", reason)
