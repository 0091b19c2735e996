"""The directory the backend pushes: users, offerings and who may use which offering.

Every call is idempotent, so the backend can simply retry after a 503.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from functools import partial

import structlog
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.auth.tokens import token_digest
from queuekeeper.broker import topology
from queuekeeper.broker.management import BrokerUnavailable, ManagementError
from queuekeeper.broker.passwords import rabbit_password_hash
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.common.schemas import parse_path_uuid
from queuekeeper.consumers import repository as consumers_repository
from queuekeeper.directory import repository
from queuekeeper.directory.schemas import OfferingPut, UserPut
from queuekeeper.exceptions import BadRequest, NotFound, Unavailable
from queuekeeper.jobs.runs import JobContext, Run
from queuekeeper.models import (
    EventConsumer,
    EventSubscription,
    Offering,
    OfferingAccess,
    User,
    utcnow,
)
from queuekeeper.subscriptions.service import (
    BrokerLeftovers,
    collect_leftovers,
    remove_leftovers,
)

log = structlog.get_logger(__name__)

# The API token is also the agents' broker password (contract §3), guessable over STOMP at the
# broker's pace: shorter tokens are logged (docs/operations.md, Security).
RECOMMENDED_TOKEN_LENGTH = 32


def _apply_user(user: User, body: UserPut) -> bool:
    """Copy the fields the caller sent; True when the token changed."""
    sent = body.model_fields_set
    user.username = body.username
    if "full_name" in sent:
        user.full_name = body.full_name or ""
    if "email" in sent:
        user.email = body.email or ""
    if "is_active" in sent and body.is_active is not None:
        user.is_active = body.is_active
    if "token_expires_at" in sent:
        user.token_expires_at = body.token_expires_at
    if "token" not in sent:
        return False
    if body.token and len(body.token) < RECOMMENDED_TOKEN_LENGTH:
        # Accepted (the backend chooses tokens) but said: it is also the broker password.
        log.warning(
            "short_token",
            user=str(user.uuid),
            length=len(body.token),
            recommended=RECOMMENDED_TOKEN_LENGTH,
        )
    digest = token_digest(body.token) if body.token else None
    if digest == user.token_hash:
        return False
    user.token_hash = digest
    user.broker_password_hash = rabbit_password_hash(body.token) if body.token else None
    return True


async def put_user(
    session: AsyncSession,
    provisioner: Provisioner,
    user_uuid: uuid.UUID,
    body: UserPut,
) -> tuple[User, bool]:
    """Create or update a user; True when created.

    A changed token changes the broker password of every subscription of the
    user. Should the broker be down, the row is saved and the answer is 503, and
    the backend's retry (or the reconcile) brings the broker users up to date.
    """
    for attempt in range(2):
        existing = await session.get(User, user_uuid)
        created = existing is None
        user = existing or User(uuid=user_uuid, username=body.username, full_name="", email="")
        if created:
            session.add(user)
        token_changed = _apply_user(user, body)
        try:
            await session.commit()
            break
        except IntegrityError as exc:
            await session.rollback()
            if "token" in str(exc.orig).lower() and token_changed:
                raise BadRequest(
                    "This token already belongs to another user; tokens must be unique.",
                    field="token",
                ) from exc
            if attempt:  # a concurrent PUT created the same user: update it instead
                raise
    log.info("user_saved", user=user_uuid.hex, created=created, token_changed=token_changed)
    await sync_broker_passwords(session, provisioner, user)
    return user, created


async def sync_broker_passwords(session: AsyncSession, provisioner: Provisioner, user: User) -> int:
    """Give every broker user of the user (its subscriptions' and consumers') the password it
    should have now (its token's, or none while inactive or expired), then close their open
    connections, so a changed, removed or expired token stops working on the broker at once;
    returns how many changed.
    """
    wanted = user.broker_login_hash(utcnow())
    subscriptions = await repository.subscriptions_needing_password(session, user.uuid, wanted)
    consumers = await consumers_repository.needing_password(session, user.uuid, wanted)
    # (row, broker user, change)
    changes: list[tuple[EventSubscription | EventConsumer, str, Callable[[], Awaitable[None]]]] = [
        (
            s,
            topology.subscription_user_name(s.uuid),
            partial(provisioner.set_subscription_password, s.uuid, wanted),
        )
        for s in subscriptions
    ] + [
        (
            c,
            topology.consumer_user_name(c.uuid),
            partial(provisioner.set_consumer_password, c.uuid, wanted),
        )
        for c in consumers
    ]
    # No transaction stays open across the broker calls.
    await session.commit()
    done: list[str] = []
    try:
        for row, broker_user, change in changes:
            await change()
            row.broker_password_hash = wanted
            done.append(broker_user)
    except (BrokerUnavailable, ManagementError) as exc:
        raise Unavailable(
            "The user was saved, but RabbitMQ could not be given the new token as the "
            f"broker password ({exc}); repeat the same PUT to finish."
        ) from exc
    finally:
        await session.commit()
        # Connections opened with the old password keep working until closed: close them,
        # also when only some passwords could be changed.
        await provisioner.close_connections(done)
    if changes:
        log.info(
            "broker_passwords_updated",
            user=user.uuid.hex,
            subscriptions=len(subscriptions),
            consumers=len(consumers),
            login=wanted is not None,
        )
    return len(changes)


async def revoke_expired(context: JobContext, run: Run) -> None:
    """The `revoke_expired` job: take the broker logins of users whose token has expired (or
    who were deactivated) while a broker user still holds their password, and close their
    connections. Run every `token_expiry_interval_seconds`, so an expiry reaches the broker
    within seconds rather than at the next stale cleanup (which then deletes them)."""
    async with context.sessions() as session:
        users = await repository.users_with_revoked_logins(session, utcnow())
        await session.commit()
        run.find("users_to_revoke", len(users))
        for user in users:
            async with run.item(user.uuid.hex):
                await run.apply(
                    "logins_revoked",
                    "revoke_broker_logins",
                    user.uuid.hex,
                    partial(sync_broker_passwords, session, context.provisioner, user),
                    detail=_revoked_because(user),
                )


def _revoked_because(user: User) -> str:
    if not user.is_active:
        return "user is inactive"
    expires = user.token_expires_at
    return f"token expired at {expires.isoformat() if expires else '?'}"


async def delete_user(
    session: AsyncSession, provisioner: Provisioner, user_uuid: uuid.UUID
) -> None:
    user = await session.get(User, user_uuid)
    if user is None:
        return
    leftovers = await collect_leftovers(
        session, await repository.subscriptions_of_user(session, user_uuid)
    )
    # Its consumers go by cascade; their queues and broker users are removed below.
    leftovers.add_consumers(await consumers_repository.of_owner(session, user_uuid))
    leftovers.owner_uuids.add(user_uuid)
    await session.delete(user)
    await session.commit()
    log.info("user_deleted", user=user_uuid.hex, subscriptions=len(leftovers.subscription_uuids))
    await remove_leftovers(session, provisioner, leftovers)


def own_record(caller: User, user_uuid: str) -> User:
    """An agent may read only its own user record; anyone else's is not found."""
    if parse_path_uuid(user_uuid) != caller.uuid:
        raise NotFound(f"User {user_uuid!r} not found.")
    return caller


async def put_offering(
    session: AsyncSession, offering_uuid: uuid.UUID, body: OfferingPut
) -> tuple[Offering, bool]:
    for attempt in range(2):
        offering = await session.get(Offering, offering_uuid)
        created = offering is None
        if offering is None:
            offering = Offering(uuid=offering_uuid, name=body.name, state=body.state or "")
            session.add(offering)
        offering.name = body.name
        if body.state is not None:
            offering.state = body.state
        try:
            await session.commit()
            return offering, created
        except IntegrityError:
            await session.rollback()
            if attempt:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


async def delete_offering(
    session: AsyncSession, provisioner: Provisioner, offering_uuid: uuid.UUID
) -> None:
    offering = await session.get(Offering, offering_uuid)
    if offering is None:
        return
    queues = await repository.queues_of_offering(session, offering_uuid)
    # Consumers bound to it alone go with it; others only lose it as a scope (cascade).
    consumers = await consumers_repository.scoped_only_to(session, offering_uuid)
    for consumer in consumers:
        await session.delete(consumer)
    # Before the offering: its deletion cascades to identities and so to these consumers.
    await session.flush()
    await session.delete(offering)  # grants, queue rows, identities go by cascade
    await session.commit()
    log.info(
        "offering_deleted",
        offering=offering_uuid.hex,
        queues=len(queues),
        consumers=len(consumers),
    )
    await remove_leftovers(
        session,
        provisioner,
        BrokerLeftovers(queues=[(q.vhost, q.queue_name) for q in queues]).add_consumers(consumers),
    )


async def grant_access(
    session: AsyncSession, user_uuid: uuid.UUID, offering_uuid: uuid.UUID
) -> tuple[OfferingAccess, bool]:
    if await session.get(User, user_uuid) is None:
        raise NotFound(f"User {user_uuid.hex} is not known: PUT the user first.")
    if await session.get(Offering, offering_uuid) is None:
        raise NotFound(f"Offering {offering_uuid.hex} is not known: PUT the offering first.")
    grant = await repository.get_grant(session, user_uuid, offering_uuid)
    if grant is not None:
        return grant, False
    grant = OfferingAccess(user_uuid=user_uuid, offering_uuid=offering_uuid)
    session.add(grant)
    try:
        await session.commit()
    except IntegrityError:
        await session.rollback()
        existing = await repository.get_grant(session, user_uuid, offering_uuid)
        if existing is None:
            raise
        return existing, False
    log.info("access_granted", user=user_uuid.hex, offering=offering_uuid.hex)
    return grant, True


async def revoke_access(
    session: AsyncSession, provisioner: Provisioner, user_uuid: uuid.UUID, offering_uuid: uuid.UUID
) -> None:
    """Delivery stops at once: the user's queues for the offering go with the grant."""
    # Locked before the queues are listed: a create_queue in flight holds the grant
    # FOR SHARE until it commits its row, so the list below includes that row.
    grant = await repository.get_grant(session, user_uuid, offering_uuid, lock=True)
    queues = await repository.queues_of_user_for_offering(session, user_uuid, offering_uuid)
    # The user's consumers bound to this offering alone are deleted; those bound to others
    # too only lose this scope. register_queue holds the grant FOR SHARE until it commits.
    consumers = await consumers_repository.scoped_only_to(session, offering_uuid, user_uuid)
    gone = {consumer.uuid for consumer in consumers}
    scopes = await consumers_repository.scopes_of_owner_for(session, user_uuid, offering_uuid)
    if grant is not None:
        await session.delete(grant)
    for row in [*queues, *consumers, *(s for s in scopes if s.consumer_uuid not in gone)]:
        await session.delete(row)
    await session.commit()
    log.info(
        "access_revoked",
        user=user_uuid.hex,
        offering=offering_uuid.hex,
        queues=len(queues),
        consumers=len(consumers),
    )
    await remove_leftovers(
        session,
        provisioner,
        BrokerLeftovers(queues=[(q.vhost, q.queue_name) for q in queues]).add_consumers(consumers),
    )
    # A consumer of a deleted queue is cancelled by the broker; closing the logins that
    # read the offering's queues also ends anything else they held open for it.
    await provisioner.close_connections(
        sorted({topology.subscription_user_name(q.subscription_uuid) for q in queues})
    )
