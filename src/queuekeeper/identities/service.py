"""Agent identities and register_event_subscription: what waldur-site-agent does at start-up.

The agent registers on every start and never cleans up after itself, so every
call here is idempotent: a restart gets back the identity, the subscriptions,
the broker users and (through create_queue) the queues it had, and nothing
piles up on the broker or in the database.
"""

from __future__ import annotations

import uuid

import structlog
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.exc import StaleDataError

from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient, QueueInfo
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.common import locks
from queuekeeper.common.pagination import Page, Paged
from queuekeeper.common.quotas import check_quota, check_text
from queuekeeper.common.schemas import find_by_path_uuid
from queuekeeper.config import Settings
from queuekeeper.consumers import repository as consumers_repository
from queuekeeper.exceptions import BadRequest, Conflict, Forbidden, NotFound
from queuekeeper.identities import repository
from queuekeeper.identities.schemas import (
    AdminConsumer,
    AdminIdentityOut,
    AdminQueue,
    AdminSubscription,
    IdentityWrite,
    RegisterEventSubscription,
)
from queuekeeper.models import (
    AgentIdentity,
    BrokerState,
    EventConsumer,
    EventSubscription,
    Offering,
    User,
    utcnow,
)
from queuekeeper.observability.metrics import AGENT_OFFERING_UUID_FORM, AGENT_REGISTRATIONS
from queuekeeper.owners import service as owners
from queuekeeper.owners.repository import has_access
from queuekeeper.subscriptions import service as subscriptions
from queuekeeper.subscriptions.schemas import ObservableObject, SubscriptionCreate

log = structlog.get_logger(__name__)


def agent_computes_our_queue_names(offering_text: str) -> bool:
    """Whether the agent's queue names will match ours for this configured offering uuid.

    waldur-site-agent builds `..._offering_{uuid with '-' removed}_...` from its
    configuration as written; queuekeeper names queues with lowercase hex.
    """
    return offering_text.replace("-", "") == uuid.UUID(offering_text).hex


def warn_about_offering_form(offering_text: str, user: User, identity_name: str) -> None:
    if agent_computes_our_queue_names(offering_text):
        return
    AGENT_OFFERING_UUID_FORM.inc()
    log.warning(
        "agent_offering_uuid_not_lowercase_hex",
        user=user.uuid.hex,
        identity=identity_name,
        configured=offering_text,
        expected=uuid.UUID(offering_text).hex,
        detail="waldur-site-agent computes its queue names from waldur_offering_uuid exactly "
        "as configured (dashes removed). This form gives names queuekeeper never creates: the "
        "agent will reconnect in a loop, refused NOT_FOUND. Configure the offering uuid in "
        "lowercase.",
    )


async def _offering_for(session: AsyncSession, user: User, body: IdentityWrite) -> Offering:
    offering = await session.get(Offering, body.offering_uuid)
    if offering is None:
        raise BadRequest(
            f"Unknown offering {body.offering_uuid.hex}: the backend has not pushed it.",
            field="offering",
        )
    if not await has_access(session, user.uuid, offering.uuid):
        raise Forbidden(f"You have no access to offering {offering.uuid.hex}.")
    return offering


async def require_access(session: AsyncSession, user: User, identity: AgentIdentity) -> None:
    if not await has_access(session, user.uuid, identity.offering_uuid):
        raise Forbidden(
            f"You have no access to offering {identity.offering_uuid.hex}, which agent identity "
            f"{identity.uuid.hex} belongs to."
        )


async def list_identities(
    session: AsyncSession,
    user: User,
    *,
    name: str | None,
    offering_uuid: uuid.UUID | None,
    page: Page,
) -> Paged[AgentIdentity]:
    return await repository.list_owned_identities(
        session, user.uuid, name=name, offering_uuid=offering_uuid, page=page
    )


async def get_identity(session: AsyncSession, user: User, identity_uuid: str) -> AgentIdentity:
    """The caller's identity by its path uuid; NotFound when it is not theirs."""
    return await find_by_path_uuid(
        identity_uuid,
        "Agent identity",
        lambda parsed: repository.get_owned_identity(session, user.uuid, parsed),
    )


def _name_taken(name: str, existing: AgentIdentity) -> Conflict:
    return Conflict(
        f"You already have an agent identity named {name!r} ({existing.uuid.hex}); update it "
        f"with PUT /api/marketplace-site-agent-identities/{existing.uuid.hex}/ instead.",
        field="name",
    )


async def create_identity(
    session: AsyncSession, settings: Settings, user: User, body: IdentityWrite
) -> AgentIdentity:
    check_text(settings, name=body.name)
    # Counted and inserted under the owner lock: parallel calls cannot pass the quota together.
    async with locks.guard(session, locks.user_key(user.uuid), exclusive=True):
        held = await repository.count_identities(session, user.uuid)
        check_quota(settings, "max_identities_per_user", held, "agent identities")
        offering = await _offering_for(session, user, body)
        warn_about_offering_form(body.offering, user, body.name)
        now = utcnow()
        identity = AgentIdentity(
            uuid=uuid.uuid4(),
            offering_uuid=offering.uuid,
            name=body.name,
            version=body.version,
            dependencies=[item.model_dump() for item in body.dependencies or []],
            config_file_path=body.config_file_path,
            config_file_content=body.config_file_content,
            last_restarted=body.last_restarted or now,
            created_by=user.uuid,
            created=now,
            modified=now,
        )
        session.add(identity)
        user_uuid, offering_uuid = user.uuid, offering.uuid  # a rollback expires the objects
        try:
            await session.commit()
        except IntegrityError as exc:
            await session.rollback()
            existing = await repository.find_by_name(session, user_uuid, body.name)
            if existing is not None:
                raise _name_taken(body.name, existing) from exc
            raise BadRequest(
                f"Offering {offering_uuid.hex} was deleted while the identity was being created.",
                field="offering",
            ) from exc
    log.info(
        "agent_identity_created",
        identity=identity.uuid.hex,
        name=identity.name,
        offering=offering.uuid.hex,
        user=user.uuid.hex,
        version=identity.version,
    )
    return identity


async def update_identity(
    session: AsyncSession, settings: Settings, user: User, identity_uuid: str, body: IdentityWrite
) -> AgentIdentity:
    """The agent's PUT on every restart. Optional fields left out keep their value."""
    check_text(settings, name=body.name)
    identity = await get_identity(session, user, identity_uuid)
    await require_access(session, user, identity)
    offering = await _offering_for(session, user, body)
    warn_about_offering_form(body.offering, user, body.name)
    sent = body.model_fields_set
    identity.offering_uuid = offering.uuid
    identity.name = body.name
    if "version" in sent:
        identity.version = body.version
    if "dependencies" in sent:
        identity.dependencies = [item.model_dump() for item in body.dependencies or []]
    if "config_file_path" in sent:
        identity.config_file_path = body.config_file_path
    if "config_file_content" in sent:
        identity.config_file_content = body.config_file_content
    if body.last_restarted is not None:
        identity.last_restarted = body.last_restarted
    identity.modified = utcnow()
    user_uuid, identity_key = user.uuid, identity.uuid  # a rollback expires the objects
    try:
        await session.commit()
    except IntegrityError as exc:
        await session.rollback()
        existing = await repository.find_by_name(session, user_uuid, body.name)
        if existing is not None and existing.uuid != identity_key:
            raise _name_taken(body.name, existing) from exc
        raise NotFound(
            "The identity or its offering was deleted while it was being updated."
        ) from exc
    log.info(
        "agent_identity_updated",
        identity=identity.uuid.hex,
        name=identity.name,
        user=user.uuid.hex,
        version=identity.version,
        last_restarted=identity.last_restarted.isoformat() if identity.last_restarted else None,
    )
    return identity


async def delete_identity(
    session: AsyncSession, provisioner: Provisioner, user: User, identity_uuid: str
) -> None:
    """Deletes the identity and the subscriptions registered through it, with their queues
    and broker users, and its consumer (which goes by cascade) with its queue and broker
    user: nothing else would ever clean them up."""
    # Under the owner lock, the broker objects go before the rows commit: no registration in
    # flight can make them again in between (docs/decisions/002-owner-lock.md).
    async with owners.owner_locked(session, user.uuid, vhost_exclusive=True):
        identity = await get_identity(session, user, identity_uuid)
        owned = await repository.subscriptions_of_identity(session, user.uuid, identity.uuid)
        leftovers = await owners.collect_leftovers(session, owned)
        leftovers.add_consumers(await consumers_repository.of_identities(session, [identity.uuid]))
        for subscription in owned:
            await session.delete(subscription)
        await session.delete(identity)
        await session.flush()
        await owners.remove_leftovers_held(session, provisioner, leftovers)
        await session.commit()
    log.info(
        "agent_identity_deleted",
        identity=identity.uuid.hex,
        user=user.uuid.hex,
        subscriptions=[s.uuid.hex for s in owned],
    )


async def _reuse(
    session: AsyncSession,
    provisioner: Provisioner,
    user_uuid: uuid.UUID,
    identity_uuid: uuid.UUID,
    object_type: str,
) -> tuple[EventSubscription | None, bool]:
    """The subscription registered for (identity, type), and True when it was intact and
    its broker user now holds the owner's current token; False when there is none or it is
    broken (to be replaced).

    Read under the owner lock, with the owner's token in the same statement: a token change
    or deactivation that committed while this call was in flight is what the broker user
    gets (docs/decisions/002-owner-lock.md)."""
    vhost = topology.vhost_name(user_uuid)
    async with owners.owner_locked(session, user_uuid, vhost_exclusive=False):
        found = await repository.registered_subscription_and_login(
            session, user_uuid, identity_uuid, object_type
        )
        # Each way out commits (nothing written) to release the locks: the guard's rollback
        # would expire the row the caller may still replace.
        if found is None:
            await session.commit()
            return None, False
        subscription, password_hash = found
        if subscription.broker_state == BrokerState.BROKEN or not (
            await provisioner.subscription_user_intact(vhost, subscription.uuid)
        ):
            await session.commit()
            return subscription, False
        # Also re-asserts the read-only permissions, should they have drifted.
        await provisioner.ensure_subscription_user(vhost, subscription.uuid, password_hash)
        subscription.broker_password_hash = password_hash
        await session.commit()
    return subscription, True


async def register_event_subscription(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    user: User,
    identity_uuid: str,
    body: RegisterEventSubscription,
    *,
    source_ip: str | None,
) -> tuple[EventSubscription, bool]:
    """The caller's subscription for (identity, object type); True when a new one was made.

    An existing one is returned while its broker user is intact. A broken one (its
    broker user or its permissions are gone, or a reconcile marked it broken) is
    replaced: the new row goes in as the old one goes out, in one transaction, and
    the old one's queues and broker user are removed from the broker afterwards.
    """
    identity = await get_identity(session, user, identity_uuid)
    await require_access(session, user, identity)
    object_type = body.observable_object_type
    user_uuid, identity_key = user.uuid, identity.uuid  # a rollback expires the objects
    await session.commit()
    existing, reused = await _reuse(session, provisioner, user_uuid, identity_key, object_type)
    if existing is not None and reused:
        AGENT_REGISTRATIONS.labels(outcome="reused").inc()
        log.info(
            "agent_subscription_reused",
            identity=identity.uuid.hex,
            object_type=object_type,
            subscription=existing.uuid.hex,
        )
        return existing, False

    try:
        subscription = await subscriptions.create_subscription(
            session,
            provisioner,
            settings,
            user,
            SubscriptionCreate(
                description=body.description,
                observable_objects=[ObservableObject(object_type=object_type)],
            ),
            source_ip=source_ip,
            agent_identity_uuid=identity.uuid,
            observable_object_type=object_type,
            replaces=[existing] if existing is not None else [],
        )
    except (IntegrityError, StaleDataError) as exc:
        # A concurrent call for the same (identity, type) committed first: use its row.
        winner = await repository.registered_subscription(
            session, user_uuid, identity_key, object_type
        )
        if winner is None:
            raise NotFound(
                f"Agent identity {identity_key.hex} was deleted while registering; call again."
            ) from exc
        await session.refresh(user)  # the rollback expired it; the answer needs its fields
        AGENT_REGISTRATIONS.labels(outcome="reused").inc()
        log.info(
            "agent_subscription_reused",
            identity=identity_key.hex,
            object_type=object_type,
            subscription=winner.uuid.hex,
            detail="a concurrent registration made it",
        )
        return winner, False

    outcome = "replaced" if existing is not None else "created"
    AGENT_REGISTRATIONS.labels(outcome=outcome).inc()
    log_method = log.warning if existing is not None else log.info
    log_method(
        f"agent_subscription_{outcome}",
        identity=identity.uuid.hex,
        object_type=object_type,
        subscription=subscription.uuid.hex,
        replaced=existing.uuid.hex if existing is not None else None,
        detail="the previous subscription's broker user or permissions were gone; it was "
        "retired with its queues"
        if existing is not None
        else None,
    )
    return subscription, True


async def _broker_queues(
    management: ManagementClient, vhosts: set[str]
) -> dict[tuple[str, str], QueueInfo]:
    """(vhost, queue name) -> the broker's row, listed page by page per vhost."""
    found: dict[tuple[str, str], QueueInfo] = {}
    for vhost in sorted(vhosts):
        page = 1
        while True:
            # Subscription and consumer queues (the dead-letter queue comes along; unused).
            body = await management.list_queues_page(
                vhost,
                page=page,
                page_size=500,
                columns="name,consumers,messages,arguments,durable,auto_delete",
            )
            for item in body.items:
                found[(vhost, item.name)] = item
            if page >= body.page_count:
                break
            page += 1
    return found


def _admin_consumer(
    provisioner: Provisioner,
    consumer: EventConsumer | None,
    broker: dict[tuple[str, str], QueueInfo] | None,
) -> AdminConsumer | None:
    if consumer is None:
        return None
    if broker is None:
        return AdminConsumer.from_row(consumer, None, None)
    seen = broker.get((consumer.vhost, consumer.queue_name))
    return AdminConsumer.from_row(consumer, seen, provisioner.differences(seen) if seen else [])


async def admin_overview(
    session: AsyncSession,
    provisioner: Provisioner,
    *,
    offering_uuid: uuid.UUID | None,
    user_uuid: uuid.UUID | None,
    page: Page,
    with_broker: bool,
) -> Paged[AdminIdentityOut]:
    """Every identity with what it registered and, optionally, who consumes it on the broker."""
    identities, total = await repository.admin_identities(
        session,
        offering_uuid=offering_uuid,
        user_uuid=user_uuid,
        offset=page.offset,
        limit=page.page_size,
    )
    identity_uuids = [identity.uuid for identity, _owner in identities]
    rows = await repository.subscriptions_with_queues(session, identity_uuids)
    consumers = {
        consumer.agent_identity_uuid: consumer
        for consumer in await consumers_repository.of_identities(session, identity_uuids)
    }
    await session.commit()  # nothing stays open while we ask the broker
    vhosts = {queue.vhost for _s, queue in rows if queue is not None}
    vhosts |= {consumer.vhost for consumer in consumers.values()}
    broker = await _broker_queues(provisioner.management, vhosts) if with_broker else None
    subscriptions: dict[uuid.UUID, dict[uuid.UUID, AdminSubscription]] = {}
    for subscription, queue in rows:
        if subscription.agent_identity_uuid is None:  # detached meanwhile
            continue
        entry = subscriptions.setdefault(subscription.agent_identity_uuid, {}).setdefault(
            subscription.uuid, AdminSubscription.from_row(subscription)
        )
        if queue is None:
            continue
        seen = broker.get((queue.vhost, queue.queue_name)) if broker is not None else None
        entry.queues.append(
            AdminQueue(
                queue_name=queue.queue_name,
                vhost=queue.vhost,
                offering_uuid=queue.offering_uuid,
                present=None if broker is None else seen is not None,
                consumers=(seen.consumers or 0) if seen else None,
                messages=(seen.messages or 0) if seen else None,
            )
        )
    return Paged(
        total,
        [
            AdminIdentityOut.from_row(
                identity,
                owner,
                list(subscriptions.get(identity.uuid, {}).values()),
                _admin_consumer(provisioner, consumers.get(identity.uuid), broker),
            )
            for identity, owner in identities
        ],
    )
