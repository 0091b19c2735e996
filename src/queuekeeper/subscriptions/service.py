"""Event subscriptions and their queues: the database rows and the broker objects behind them.

Order of work everywhere: validate, then change the broker, then commit the row, so a
broker outage never leaves a row that points at nothing. A user's registrations and
deletions hold its owner lock throughout, and a deletion removes the broker objects before
it commits (owners/service.py, docs/decisions/002-owner-lock.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import structlog
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementError
from queuekeeper.broker.provisioner import Provisioner, QueueConflict, QueueOutcome, best_effort
from queuekeeper.common import locks
from queuekeeper.common.pagination import Page, Paged
from queuekeeper.common.quotas import check_quota, check_text
from queuekeeper.common.schemas import find_by_path_uuid
from queuekeeper.config import Settings
from queuekeeper.exceptions import BadRequest, Forbidden, NotFound, QuotaExceeded
from queuekeeper.models import (
    BrokerState,
    EventSubscription,
    EventSubscriptionQueue,
    User,
    utcnow,
)
from queuekeeper.observability.metrics import CREATE_QUEUE
from queuekeeper.owners.service import (
    collect_leftovers,
    delete_unregistered_queues,
    owner_locked,
    owner_login_hash,
    remove_leftovers,
    remove_leftovers_held,
    unmake,
)
from queuekeeper.subscriptions import repository
from queuekeeper.subscriptions.schemas import QueueCreate, QueueFilter, SubscriptionCreate

log = structlog.get_logger(__name__)


async def create_subscription(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    owner: User,
    body: SubscriptionCreate,
    *,
    source_ip: str | None,
    agent_identity_uuid: uuid.UUID | None = None,
    observable_object_type: str | None = None,
    replaces: Sequence[EventSubscription] = (),
) -> EventSubscription:
    """Broker objects first, then the row.

    `replaces` are subscriptions deleted in the same transaction as the new row
    is inserted (register_event_subscription retiring a broken one); their broker
    objects are removed once that has committed.
    """
    check_text(settings, description=body.description)
    owner_uuid = owner.uuid
    subscription_uuid = uuid.uuid4()
    vhost = topology.vhost_name(owner_uuid)
    made = False
    # The owner lock, held from the count and the read of the owner's token to the commit:
    # the broker user gets the token the database holds when the row lands, and parallel
    # calls cannot pass the quota together (docs/decisions/002-owner-lock.md). The vhost
    # and broker-users locks, shared, keep reconcile from taking what this call is making
    # for an orphan (it takes them exclusively and re-checks the rows).
    try:
        async with owner_locked(session, owner_uuid, vhost_exclusive=False, broker_users=True):
            held = await repository.count_subscriptions(session, owner_uuid) - len(replaces)
            check_quota(settings, "max_subscriptions_per_user", held, "event subscriptions")
            password_hash = await owner_login_hash(session, owner_uuid)
            made = True
            await provisioner.ensure_vhost(vhost)
            await provisioner.ensure_subscription_user(vhost, subscription_uuid, password_hash)
            leftovers = await collect_leftovers(session, list(replaces)) if replaces else None
            subscription = EventSubscription(
                uuid=subscription_uuid,
                user_uuid=owner_uuid,
                description=body.description,
                observable_objects=[
                    item.model_dump(mode="json", exclude_none=True)
                    for item in body.observable_objects
                ],
                source_ip=source_ip,
                agent_identity_uuid=agent_identity_uuid,
                observable_object_type=observable_object_type,
                broker_password_hash=password_hash,
                broker_state=BrokerState.OK,
            )
            for old in replaces:
                await session.delete(old)
            if replaces:
                # The unit of work inserts before it deletes; the old row must be gone first
                # or the new one collides with it on the (identity, object type) unique index.
                await session.flush()
            session.add(subscription)
            await session.commit()
    except BaseException:
        if made:  # the locks are released: the broker user and an unused vhost go again
            await unmake(session, provisioner, owner_uuid, subscriptions=[subscription_uuid])
        raise
    log.info("subscription_created", subscription=subscription_uuid.hex, user=owner.uuid.hex)
    if leftovers is not None:
        log.info(
            "subscriptions_replaced",
            replaced=[old.uuid.hex for old in replaces],
            by=subscription_uuid.hex,
        )
        await remove_leftovers(session, provisioner, leftovers)
    return subscription


async def list_subscriptions(
    session: AsyncSession, owner: User, page: Page
) -> Paged[EventSubscription]:
    return await repository.list_owned_subscriptions(session, owner.uuid, page)


async def get_subscription(
    session: AsyncSession, owner: User, subscription_uuid: str
) -> EventSubscription:
    """The caller's subscription by its path uuid; NotFound when it is not theirs."""
    return await find_by_path_uuid(
        subscription_uuid,
        "Event subscription",
        lambda parsed: repository.get_owned_subscription(session, owner.uuid, parsed),
    )


async def delete_subscription(
    session: AsyncSession, provisioner: Provisioner, owner: User, subscription_uuid: str
) -> None:
    async with owner_locked(session, owner.uuid, vhost_exclusive=True):
        subscription = await get_subscription(session, owner, subscription_uuid)
        leftovers = await collect_leftovers(session, [subscription])
        await session.delete(subscription)
        await session.flush()
        await remove_leftovers_held(session, provisioner, leftovers)
        await session.commit()
    log.info("subscriptions_deleted", subscriptions=[subscription.uuid.hex])


async def create_queue(
    engine: AsyncEngine,
    provisioner: Provisioner,
    settings: Settings,
    owner: User,
    subscription_uuid: str,
    body: QueueCreate,
) -> tuple[EventSubscriptionQueue, bool]:
    """Register a queue of the caller's subscription; True when its row is new.

    On no ORM session: its reads run in autocommit (`db.read_one`; an agent starting up
    calls once per offering and object type), and a new row is one transaction on a plain
    connection."""
    # One read, in no transaction: nothing held open while we wait on the broker.
    known = await find_by_path_uuid(
        subscription_uuid,
        "Event subscription",
        lambda parsed: repository.queue_context(
            engine, owner.uuid, parsed, body.offering_uuid, body.object_type
        ),
    )
    try:
        queue, inserted, outcome = await _register_queue(
            engine, provisioner, settings, owner, known, body
        )
    except QueueConflict:
        CREATE_QUEUE.labels(outcome="conflict").inc()
        raise
    except ManagementError:
        CREATE_QUEUE.labels(outcome="broker_unavailable").inc()
        raise
    if outcome in (QueueOutcome.REPAIRED, QueueOutcome.KEPT):
        CREATE_QUEUE.labels(outcome=outcome.value).inc()
    else:
        CREATE_QUEUE.labels(outcome="created" if inserted else "existing").inc()
    return queue, inserted


async def _register_queue(
    engine: AsyncEngine,
    provisioner: Provisioner,
    settings: Settings,
    owner: User,
    known: repository.QueueContext,
    body: QueueCreate,
) -> tuple[EventSubscriptionQueue, bool, QueueOutcome]:
    """Returns (queue, created row?, what the broker needed)."""
    subscription_uuid, offering_uuid = known.subscription_uuid, body.offering_uuid
    if not known.offering_known:
        raise BadRequest(
            f"Unknown offering {offering_uuid.hex}: the backend has not pushed it.",
            field="offering_uuid",
        )
    if not known.has_access:
        raise Forbidden(f"You have no access to offering {offering_uuid.hex}.")
    if known.registered is not None:  # registering an existing queue again is not one more
        return await _ensure_registered(engine, provisioner, known.registered)
    check_quota(settings, "max_queues_per_user", known.queues_held, "queues")

    name = topology.queue_name(subscription_uuid, offering_uuid, body.object_type)
    vhost = topology.vhost_name(owner.uuid)
    queue = EventSubscriptionQueue(
        uuid=uuid.uuid4(),
        subscription_uuid=subscription_uuid,
        offering_uuid=offering_uuid,
        object_type=body.object_type,
        queue_name=name,
        vhost=vhost,
        created=utcnow(),
    )
    # The broker queue exists before its row does. Reconcile deletes `subscription_*`
    # queues without a row, but only while holding the vhost lock exclusively and
    # re-checking the rows; holding it shared from before the declare until the
    # commit makes sure it never sees this queue without seeing its row. The owner lock
    # (docs/decisions/002-owner-lock.md), taken first in the same statement, makes the
    # quota count in the insert exact against the owner's parallel calls.
    limit = settings.max_queues_per_user
    try:
        async with locks.transaction_holding(
            engine, [(locks.user_key(owner.uuid), True), (locks.vhost_key(vhost), False)]
        ) as unit:
            # An agent must start even while its queue waits to change type (a migration).
            outcome = await provisioner.ensure_queue(vhost, name, keep_other_type=True)
            # Access and the quota are checked again in the insert, the grant locked until
            # the commit.
            insert = await repository.insert_queue_with_access(unit, owner.uuid, queue, limit)
            if insert is repository.QueueInsert.NO_ACCESS:
                raise _AccessRevoked  # rolls back, releasing the locks, before the delete
    except _AccessRevoked:
        await best_effort("delete_queue", provisioner.delete_queue(vhost, name), queue=name)
        raise Forbidden(f"Your access to offering {offering_uuid.hex} was revoked.") from None
    except IntegrityError as exc:
        # The subscription, offering or grant went away while we were at the broker.
        await best_effort("delete_queue", provisioner.delete_queue(vhost, name), queue=name)
        raise NotFound(
            "The subscription or the offering was deleted while the queue was being created."
        ) from exc
    inserted = insert is repository.QueueInsert.INSERTED
    if not inserted:
        existing = await repository.find_queue(
            engine, subscription_uuid, offering_uuid, body.object_type
        )
        if existing is None and insert is repository.QueueInsert.AT_QUOTA:
            # The owner's parallel calls took the last places: nothing of ours stays.
            await best_effort(
                "delete_unregistered_queues",
                _drop_unregistered(engine, provisioner, vhost, name),
                queue=name,
            )
            raise QuotaExceeded("queues", limit, "max_queues_per_user")
        if existing is None:  # deleted between our insert attempt and this read
            raise NotFound("The queue was deleted while it was being registered; call again.")
        queue = existing
    log.info(
        "queue_registered",
        queue=name,
        vhost=vhost,
        new_row=inserted,
        broker=outcome.value,
    )
    return queue, inserted, outcome


async def _drop_unregistered(
    engine: AsyncEngine, provisioner: Provisioner, vhost: str, name: str
) -> None:
    """Delete the broker queue `name` unless a row registers it (under the vhost lock held
    exclusively, as every deletion of a queue)."""
    async with locks.transaction_holding(engine, [(locks.vhost_key(vhost), True)]) as unit:
        if not await repository.queue_name_registered(unit, vhost, name):
            await provisioner.delete_queue(vhost, name)


class _AccessRevoked(Exception):
    """The owner's grant went away while the queue was declared (rolls the insert back)."""


async def _ensure_registered(
    engine: AsyncEngine, provisioner: Provisioner, queue: EventSubscriptionQueue
) -> tuple[EventSubscriptionQueue, bool, QueueOutcome]:
    """A repeat call (an agent starting again): the row exists, so only the broker's queue
    is ensured. No advisory lock: reconcile never deletes a queue whose row it can see.
    A revoke or a delete that commits meanwhile removes the row and then the queue; if our
    declare came after its delete, the row is gone when we look again and we remove it.
    When the queue was found right and nothing was declared (VERIFIED, the usual case),
    there is nothing of ours to take back: the call simply happened before the delete."""
    # As for a new row: an agent must start even while its queue waits to change type.
    outcome = await provisioner.ensure_queue(
        queue.vhost, queue.queue_name, keep_other_type=True, known=True
    )
    if outcome is not QueueOutcome.VERIFIED:
        await _check_still_registered(engine, provisioner, queue)
    log.info(
        "queue_registered",
        queue=queue.queue_name,
        vhost=queue.vhost,
        new_row=False,
        broker=outcome.value,
    )
    return queue, False, outcome


async def _check_still_registered(
    engine: AsyncEngine, provisioner: Provisioner, queue: EventSubscriptionQueue
) -> None:
    """After declaring the queue of an existing row: NotFound, and the queue removed
    again, when a revoke or a delete took the row meanwhile."""
    if not await repository.queue_exists(engine, queue.uuid):
        await best_effort(
            "delete_queue",
            provisioner.delete_queue(queue.vhost, queue.queue_name),
            queue=queue.queue_name,
        )
        raise NotFound("The queue was deleted while it was being registered; call again.")


async def list_queues(
    session: AsyncSession, owner: User, where: QueueFilter, page: Page
) -> Paged[EventSubscriptionQueue]:
    return await repository.list_owned_queues(session, owner.uuid, where, page)


async def get_queue(session: AsyncSession, owner: User, queue_uuid: str) -> EventSubscriptionQueue:
    """The caller's queue by its path uuid; NotFound when it is not theirs."""
    return await find_by_path_uuid(
        queue_uuid,
        "Event subscription queue",
        lambda parsed: repository.get_owned_queue(session, owner.uuid, parsed),
    )


async def delete_queue(
    session: AsyncSession, provisioner: Provisioner, owner: User, queue_uuid: str
) -> None:
    queue = await get_queue(session, owner, queue_uuid)
    vhost, name = queue.vhost, queue.queue_name
    await session.delete(queue)
    await session.commit()
    log.info("queue_deleted", queue=name, vhost=vhost)
    await delete_unregistered_queues(session, provisioner, vhost, [name])
