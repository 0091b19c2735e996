"""Reconcile: make the broker hold what the database says, and nothing of ours besides.

Order of a run: read the broker's vhosts, users and permissions once; then for
every vhost that should exist (an owner with subscriptions): its set-up, its
subscriptions' users and permissions, its queues page by page; then remove our
vhosts nobody uses and our broker users no subscription owns.

Nothing registered is ever deleted: every deletion (orphan queue, unused vhost,
orphan broker user) re-checks the database while holding, exclusively, the
advisory lock that registrations hold shared from before they touch the broker
until their row is committed. See docs/reconcile.md for the argument.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.broker import topology
from queuekeeper.broker.management import QueueInfo, VhostInfo
from queuekeeper.broker.provisioner import Ownership, QueueConflict, QueueOutcome, busy
from queuekeeper.common.locks import BROKER_USERS_KEY, guard, vhost_key
from queuekeeper.jobs.runs import JobContext, Run, chunked
from queuekeeper.observability.metrics import RECONCILE_ITEMS
from queuekeeper.reconcile import guard as deletion_guard
from queuekeeper.reconcile import repository
from queuekeeper.reconcile.access import (
    BrokerAccess,
    check_consumer,
    check_service_permissions,
    check_subscription,
)
from queuekeeper.reconcile.listing import vhost_queues
from queuekeeper.reconcile.repository import ConsumerAccess, SubscriptionAccess

log = structlog.get_logger(__name__)

# Vhosts whose subscriptions are read with one query.
VHOST_GROUP = 100
# Deletions are made in batches, each under the vhost's exclusive lock: small enough that
# a registration waiting for the lock waits well under a second.
DELETE_BATCH = 50


def count_change(counter: str) -> None:
    RECONCILE_ITEMS.labels(action=counter).inc()


async def reconcile(context: JobContext, run: Run) -> None:
    management, provisioner = context.management, context.provisioner
    await provisioner.identify()
    broker_vhosts = {info.name: info for info in await management.list_vhosts()}
    owned = {name for name, info in broker_vhosts.items() if provisioner.owns(info)}
    async with repository.reader(context.engine) as reader:
        expected = await repository.subscribed_vhosts(reader)
        owned |= await adopt_vhosts(context, run, broker_vhosts, expected)
        report_not_ours(context, run, broker_vhosts, expected)
        access = await BrokerAccess.load(management, provisioner, owned | expected)
        run.find("vhosts", len(owned | expected))

        todo = sorted(expected)
        done = 0
        agent_users: list[str] = []
        orphans: dict[str, list[str]] = {}
        for group in chunked(todo, VHOST_GROUP):
            owners = [owner for owner in map(topology.uuid_of, group) if owner is not None]
            subscriptions = await repository.subscriptions_of_owners(reader, owners)
            consumers = await repository.consumers_of_owners(reader, owners)
            agent_users += [
                topology.subscription_user_name(subscription.uuid)
                for found in subscriptions.values()
                for subscription in found
            ] + [
                topology.consumer_user_name(consumer.uuid)
                for found in consumers.values()
                for consumer in found
            ]
            for vhost in group:
                owner = topology.uuid_of(vhost)
                orphans[vhost] = await reconcile_vhost(
                    context,
                    run,
                    reader,
                    access,
                    vhost,
                    broker_vhosts.get(vhost),
                    vhost in owned,
                    subscriptions.get(owner, []) if owner else [],
                    consumers.get(owner, []) if owner else [],
                )
                done += 1
                run.report("vhosts", done, len(todo))
        # Those made during this run got their limits with them.
        async with run.item("broker limits"):
            await reconcile_limits(
                context,
                run,
                [vhost for vhost in todo if vhost in owned],
                [name for name in agent_users if name in access.users],
            )
        report_users_not_ours(context, run, access, set(agent_users))
        # Deletions last, and only once the guard has seen all of them together.
        unused = sorted(owned - expected)
        users = access.ours()
        orphan_users = await orphan_user_candidates(reader, users)
        in_unused = await deletion_guard.queues_in(management, unused)
        orphan_count = sum(map(len, orphans.values()))
        if not deletion_guard.allows(
            context,
            run,
            owned=len(owned)
            + len(users)
            + run.found["queues"]
            + orphan_count
            + sum(in_unused.values()),
            orphan_queues=orphan_count,
            vhosts=in_unused,
            users=len(orphan_users),
        ):
            return
        for vhost, names in orphans.items():
            async with run.item(f"{vhost} queues"):
                await delete_orphans(context, run, reader, vhost, names)
        for vhost in unused:
            run.find("vhosts_unused")
            async with run.item(vhost):
                await remove_unused_vhost(context, run, reader, vhost)
        await remove_orphan_users(context, run, reader, orphan_users)


async def orphan_user_candidates(reader: AsyncSession, names: Sequence[str]) -> list[str]:
    """Of our broker users, those no subscription or consumer row owns now (re-checked under
    the lock before each deletion)."""
    candidates: list[str] = []
    for batch in chunked(names, 500):
        owned = await repository.existing_subscription_users(reader, batch)
        candidates += [name for name in batch if name not in owned]
    return candidates


async def adopt_vhosts(
    context: JobContext, run: Run, broker_vhosts: dict[str, VhostInfo], expected: set[str]
) -> set[str]:
    """Vhosts made before installation identities, where this database has subscriptions or
    consumers: tagged with our identity (in a dry run only planned). Returns them."""
    provisioner = context.provisioner
    adopted = set()
    for vhost in sorted(expected):
        info = broker_vhosts.get(vhost)
        if info is None or provisioner.ownership(info) is not Ownership.UNCLAIMED:
            continue
        async with run.item(vhost):
            await run.apply(
                "vhosts_adopted",
                "adopt_vhost",
                vhost,
                partial(provisioner.adopt_vhost, info),
                detail="tagged with the instance name only (made before installation "
                "identities), and this database has subscriptions there",
            )
            adopted.add(vhost)
    return adopted


def report_not_ours(
    context: JobContext, run: Run, broker_vhosts: dict[str, VhostInfo], expected: set[str]
) -> None:
    """Vhosts under our instance name that are not ours and that we have no rows for: never
    touched, each reported (those we have rows for are reported where they are needed)."""
    provisioner = context.provisioner
    for vhost, info in sorted(broker_vhosts.items()):
        ownership = provisioner.ownership(info)
        if vhost in expected or ownership in (Ownership.OURS, Ownership.NOT_OURS):
            continue
        run.find(f"vhosts_{ownership.value}")
        run.fail(vhost, f"left alone: {provisioner.why_not_ours(info)}")


def report_users_not_ours(
    context: JobContext, run: Run, access: BrokerAccess, known: set[str]
) -> None:
    """Broker users under our instance name that are not ours and have no row here: never
    touched, each reported."""
    provisioner = context.provisioner
    for name, user in sorted(access.users.items()):
        ownership = provisioner.ownership(user)
        if name in known or ownership in (Ownership.OURS, Ownership.NOT_OURS):
            continue
        run.find(f"users_{ownership.value}")
        run.fail(f"broker user {name}", f"left alone: {provisioner.why_not_ours(user)}")


async def reconcile_limits(
    context: JobContext, run: Run, vhosts: Sequence[str], users: Sequence[str]
) -> None:
    """RabbitMQ's own limits on our vhosts and agent broker users are ours again when someone
    changed or cleared them (docs/howto/security.md)."""
    provisioner = context.provisioner
    for kind, name, differences in await provisioner.limit_drift(vhosts, users):
        run.find("limits_drifted")
        await run.apply(
            "limits_restored",
            "restore_limits",
            f"{kind} {name}",
            partial(provisioner.restore_limits, kind, name),
            detail="; ".join(differences),
        )


async def reconcile_vhost(
    context: JobContext,
    run: Run,
    reader: AsyncSession,
    access: BrokerAccess,
    vhost: str,
    info: VhostInfo | None,
    ours: bool,
    subscriptions: list[SubscriptionAccess],
    consumers: list[ConsumerAccess],
) -> list[str]:
    """Everything but deletions; returns the vhost's orphan queues, for the guard."""
    provisioner = context.provisioner
    if info is not None and not ours:
        run.find("vhosts_foreign")
        run.fail(
            vhost,
            f"this database has subscriptions there, but the vhost is left alone (its queues "
            f"and users too): {provisioner.why_not_ours(info)}",
        )
        return []
    if info is None:
        run.find("vhosts_missing")
        async with run.item(vhost):
            await run.apply(
                "vhosts_created",
                "create_vhost",
                vhost,
                lambda: provisioner.ensure_vhost(vhost),
                detail="the vhost of a user with subscriptions was missing",
            )
            if not run.dry_run:
                access.vhost_created(vhost, provisioner.service_users())
    async with run.item(f"{vhost} permissions"):
        await check_service_permissions(run, provisioner, access, vhost)
    for subscription in subscriptions:
        async with run.item(f"broker user {subscription.uuid.hex}"):
            await check_subscription(context, run, access, vhost, subscription)
    for consumer in consumers:
        async with run.item(f"broker user {consumer.uuid.hex}"):
            await check_consumer(context, run, access, vhost, consumer)
    async with run.item(f"{vhost} queues"):
        return await reconcile_queues(context, run, reader, vhost)
    return []


async def reconcile_queues(
    context: JobContext, run: Run, reader: AsyncSession, vhost: str
) -> list[str]:
    """Missing queues re-created, drifted ones repaired; returns the orphans (deleted later,
    once the deletion guard has counted every deletion of the run)."""
    settings, provisioner = context.settings, context.provisioner
    orphans: list[str] = []
    missing: list[str] = []
    drifted: list[tuple[str, list[str]]] = []
    dead_letter_queue: QueueInfo | None = None
    async for batch in vhost_queues(
        context.management, reader, vhost, page_size=settings.reconcile_page_size
    ):
        for queue in batch:
            if queue.row is None:
                if queue.name == settings.dlq_name:
                    dead_letter_queue = queue.broker
                elif topology.is_registered_kind(queue.name):  # subscription_* or consumer_*
                    orphans.append(queue.name)
                # Any other queue is not queuekeeper's to judge.
            elif queue.broker is None:
                missing.append(queue.name)
            else:
                run.find("queues")
                found = provisioner.differences(queue.broker)
                if found:
                    drifted.append((queue.name, found))
    # Act only after the listing: changing the vhost would shift the pages still to read.
    drifted.extend(await recreate_missing(context, run, reader, vhost, missing))
    for name, found in drifted:
        async with run.item(f"{vhost}/{name}"):
            await repair_drift(context, run, vhost, name, found)
    async with run.item(f"{vhost}/{settings.dlq_name}"):
        await check_dead_letter_queue(context, run, vhost, dead_letter_queue)
    return orphans


async def delete_orphans(
    context: JobContext, run: Run, reader: AsyncSession, vhost: str, names: Sequence[str]
) -> None:
    """Delete `subscription_*` and `consumer_*` queues nobody registered, re-checked under
    the vhost's lock.

    A create_queue or register_queue holds the same lock, shared, from before it declares
    its queue until its row is committed: once we hold it exclusively, every queue that
    exists has either its row committed (and we see it) or no create_queue behind it.
    """
    # The Management API has no bulk delete: a few at a time, not one by one.
    slots = asyncio.Semaphore(context.settings.reconcile_delete_concurrency)

    async def delete(name: str) -> None:
        async with slots, run.item(f"{vhost}/{name}"):
            if await context.provisioner.delete_queue(vhost, name):
                run.done(
                    "orphans_deleted", "delete_queue", f"{vhost}/{name}", "orphan: no registration"
                )

    for batch in chunked(names, DELETE_BATCH):
        async with run.item(f"{vhost} orphan queues"):
            if run.dry_run:
                registered = await repository.registered_names(reader, vhost, batch)
                for name in batch:
                    if name not in registered:
                        run.find("orphan_queues")
                        run.planned("delete_queue", f"{vhost}/{name}", "orphan: no registration")
                continue
            async with (
                context.sessions() as session,
                guard(session, vhost_key(vhost), exclusive=True),
            ):
                registered = await repository.registered_names(session, vhost, batch)
                orphans = []
                for name in batch:
                    if name in registered:
                        run.find("orphans_registered_meanwhile")
                    else:
                        run.find("orphan_queues")
                        orphans.append(name)
                await asyncio.gather(*(delete(name) for name in orphans))
                await session.commit()


async def recreate_missing(
    context: JobContext, run: Run, reader: AsyncSession, vhost: str, names: Sequence[str]
) -> list[tuple[str, list[str]]]:
    """Re-create registered queues the broker lacks; returns those found drifted instead."""
    drifted: list[tuple[str, list[str]]] = []
    management, provisioner = context.management, context.provisioner
    for batch in chunked(names, DELETE_BATCH):
        still_registered = await repository.registered_names(reader, vhost, batch)
        for name in batch:
            if name not in still_registered:
                continue
            async with run.item(f"{vhost}/{name}"):
                # The listing can miss a queue that exists (pages shift): confirm first.
                info = await management.get_queue(vhost, name)
                if info is not None:
                    run.find("queues")
                    found = provisioner.differences(info)
                    if found:
                        drifted.append((name, found))
                    continue
                run.find("queues_missing")
                await run.apply(
                    "queues_recreated",
                    "create_queue",
                    f"{vhost}/{name}",
                    partial(provisioner.ensure_queue, vhost, name),
                    detail="registered, missing on the broker",
                )
    return drifted


async def repair_drift(
    context: JobContext, run: Run, vhost: str, name: str, found: list[str]
) -> None:
    """Re-create a queue with the wrong arguments when the broker confirms it empty and unused."""
    run.find("queues_drifted")
    item, detail = f"{vhost}/{name}", "; ".join(found)
    if run.dry_run:
        info = await context.management.get_queue(vhost, name, columns="name,messages,consumers")
        reason = busy(info)
        if reason:
            run.planned("report_drift", item, f"{detail}; would not repair: {reason}")
        else:
            run.planned("repair_queue", item, f"{detail}; repaired if still empty and unused")
        return
    count_change("drift_found")
    try:
        outcome = await context.provisioner.ensure_queue(vhost, name)
    except QueueConflict as exc:
        run.fail(item, f"drifted ({detail}), not repaired: {exc.reason}")
        return
    if outcome is QueueOutcome.REPAIRED:
        run.done("drift_repaired", "repair_queue", item, detail)


async def check_dead_letter_queue(
    context: JobContext, run: Run, vhost: str, entry: QueueInfo | None
) -> None:
    settings, provisioner = context.settings, context.provisioner
    item = f"{vhost}/{settings.dlq_name}"
    if entry is None:
        run.find("dead_letter_queues_missing")
        await run.apply(
            "dead_letter_queues_ensured",
            "create_queue",
            item,
            lambda: provisioner.ensure_dead_letter_queue(vhost),
            detail="the vhost's dead-letter queue was missing",
        )
        return
    found = provisioner.dead_letter_queue_differences(entry)
    if not found:
        return
    run.find("dead_letter_queues_drifted")
    await run.apply(
        "dead_letter_queues_ensured",
        "repair_queue",
        item,
        partial(provisioner.repair_dead_letter_queue, vhost, found),
        detail="; ".join(found),
    )


async def remove_unused_vhost(
    context: JobContext, run: Run, reader: AsyncSession, vhost: str
) -> None:
    """Delete one of our vhosts whose owner has no subscription left (re-checked under lock)."""
    if run.dry_run:
        if not await repository.vhost_in_use(reader, vhost):
            run.planned("delete_vhost", vhost, "no subscriptions left")
        return
    # create_subscription holds this lock shared from before it ensures the vhost until its
    # row is committed.
    async with context.sessions() as session, guard(session, vhost_key(vhost), exclusive=True):
        if await repository.vhost_in_use(session, vhost):
            run.find("vhosts_in_use_meanwhile")
            return
        if await context.provisioner.delete_vhost(vhost):
            run.done("vhosts_deleted", "delete_vhost", vhost, "no subscriptions left")
        await session.commit()


async def remove_orphan_users(
    context: JobContext, run: Run, reader: AsyncSession, names: Sequence[str]
) -> None:
    """Delete broker users tagged ours that no subscription row owned when `names` was made
    (orphan_user_candidates; re-checked under lock)."""
    for candidates in chunked(names, 500):
        async with run.item("broker users"):
            if run.dry_run:
                for name in candidates:
                    run.find("orphan_users")
                    run.planned("delete_user", f"broker user {name}", "no subscription")
                continue
            # create_subscription holds this lock shared from before it creates the broker
            # user until its row is committed.
            async with (
                context.sessions() as session,
                guard(session, BROKER_USERS_KEY, exclusive=True),
            ):
                owned = await repository.existing_subscription_users(session, candidates)
                for name in candidates:
                    if name in owned:
                        continue
                    run.find("orphan_users")
                    async with run.item(f"broker user {name}"):
                        if await context.provisioner.delete_user(name):
                            run.done(
                                "users_deleted",
                                "delete_user",
                                f"broker user {name}",
                                "no subscription",
                            )
                await session.commit()
