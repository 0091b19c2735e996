"""The directory the backend pushes: users, offerings and who may use which offering.

Every call is idempotent, so the backend can simply retry after a 503.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Collection
from functools import partial
from typing import TypeVar

import structlog
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.auth.repository import UserGone, login_hash_now
from queuekeeper.auth.tokens import token_digest
from queuekeeper.broker import topology
from queuekeeper.broker.management import BrokerUnavailable, ManagementError
from queuekeeper.broker.passwords import rabbit_password_hash
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.common import locks
from queuekeeper.common.schemas import parse_path_uuid
from queuekeeper.consumers import repository as consumers_repository
from queuekeeper.consumers import service as consumers_service
from queuekeeper.directory import repository
from queuekeeper.directory.schemas import (
    CustomerPut,
    OfferingPut,
    ProjectPut,
    RolePut,
    UserPut,
)
from queuekeeper.events import outbox
from queuekeeper.exceptions import BadRequest, NotFound, Unavailable
from queuekeeper.jobs.runs import JobContext, Run
from queuekeeper.models import (
    Customer,
    EventConsumer,
    EventSubscription,
    Offering,
    OfferingAccess,
    Project,
    Role,
    RoleScope,
    User,
    utcnow,
)
from queuekeeper.owners.service import (
    BrokerLeftovers,
    collect_leftovers,
    owner_locked,
    remove_leftovers,
    remove_leftovers_held,
)

log = structlog.get_logger(__name__)

# The API token is also the agents' broker password (contract §3), guessable over STOMP at the
# broker's pace: shorter tokens are logged (docs/howto/security.md).
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
    # False when absent: the backend pushes the whole user, and a privilege left out is one
    # the user no longer has (contract §12).
    user.is_staff = body.is_staff
    user.is_support = body.is_support
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
    await sync_broker_passwords(session, provisioner, user_uuid)
    return user, created


async def sync_broker_passwords(
    session: AsyncSession,
    provisioner: Provisioner,
    user_uuid: uuid.UUID,
    *,
    wrong_on_broker: Collection[str] = (),
) -> int:
    """Give every broker user of the user (its subscriptions' and consumers') the password it
    should have now (its token's, or none while inactive or expired), then close their open
    connections, so a changed, removed or expired token stops working on the broker at once;
    returns how many changed.

    Under the owner lock, from the read of the token to the commit: a registration in
    flight either ran before (its row is then listed here, as needing the new password) or
    runs after and reads the new token itself (docs/decisions/002-owner-lock.md). The rows
    say what was last written; `wrong_on_broker` names broker users found holding something
    else (revoke_expired compares with the broker's own listing), set again whatever the
    rows say.
    """
    async with locks.guard(session, locks.user_key(user_uuid), exclusive=True):
        try:
            wanted = await login_hash_now(session, user_uuid)
        except UserGone:
            await session.commit()
            return 0
        # Looked at again under the lock: what the listing saw may have been set right since
        # (a PUT in flight), and a login that holds the right password stays open.
        wrong_on_broker = [
            name
            for name in wrong_on_broker
            if await provisioner.holds_password(name, wanted) is False
        ]
        subscriptions = await repository.subscriptions_needing_password(
            session, user_uuid, wanted, also=wrong_on_broker
        )
        consumers = await consumers_repository.needing_password(
            session, user_uuid, wanted, also=wrong_on_broker
        )
        # (row, broker user, change)
        changes: list[
            tuple[EventSubscription | EventConsumer, str, Callable[[], Awaitable[None]]]
        ] = [
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
            user=user_uuid.hex,
            subscriptions=len(subscriptions),
            consumers=len(consumers),
            login=wanted is not None,
        )
    return len(changes)


async def revoke_expired(context: JobContext, run: Run) -> None:
    """The `revoke_expired` job: compare the password every broker user of ours holds (one
    listing of the broker's users) with what its owner's row wants now (none when the user
    is inactive or its token expired, its token's otherwise), and for each owner with a
    login that does not match, set it again under the owner lock and close its
    connections. Run every `token_expiry_interval_seconds`: an expiry, and any write that
    a race left wrong on the broker, is undone within that interval plus one run."""
    held = await context.provisioner.login_hashes()
    async with context.sessions() as session:
        logins = await repository.broker_logins(session, utcnow())
        await session.commit()
        wrong: dict[uuid.UUID, list[str]] = {}
        for login in logins:
            actual = held.get(login.name)
            # A missing broker user is reconcile's to restore; nothing logs in with it.
            if actual is not None and actual != (login.wanted or ""):
                wrong.setdefault(login.owner_uuid, []).append(login.name)
        run.find("users_to_revoke", len(wrong))
        for owner_uuid, names in sorted(wrong.items()):
            async with run.item(owner_uuid.hex):
                await run.apply(
                    "logins_revoked",
                    "revoke_broker_logins",
                    owner_uuid.hex,
                    partial(
                        sync_broker_passwords,
                        session,
                        context.provisioner,
                        owner_uuid,
                        wrong_on_broker=names,
                    ),
                    detail=f"broker users holding another password than the owner's: {names}",
                )


async def delete_user(
    session: AsyncSession, provisioner: Provisioner, user_uuid: uuid.UUID
) -> None:
    # Under the owner lock the broker objects go before the rows commit: a registration in
    # flight waits, then finds no user (docs/decisions/002-owner-lock.md).
    async with owner_locked(session, user_uuid, vhost_exclusive=True):
        user = await session.get(User, user_uuid)
        if user is None:
            await session.commit()
            return
        leftovers = await collect_leftovers(
            session, await repository.subscriptions_of_user(session, user_uuid)
        )
        # Its consumers go by cascade; their queues and broker users are removed below.
        owned = await consumers_repository.of_owner(session, user_uuid)
        await consumers_service.give_up_copies_of_webhooks_deleted(session, owned, utcnow())
        leftovers.add_consumers(owned)
        leftovers.owner_uuids.add(user_uuid)
        await consumers_repository.delete_bindings_on(session, [("user", user_uuid)])
        await session.delete(user)
        await session.flush()
        await remove_leftovers_held(session, provisioner, leftovers)
        await session.commit()
    log.info("user_deleted", user=user_uuid.hex, subscriptions=len(leftovers.subscription_uuids))


def own_record(caller: User, user_uuid: str) -> User:
    """An agent may read only its own user record; anyone else's is not found."""
    if parse_path_uuid(user_uuid) != caller.uuid:
        raise NotFound(f"User {user_uuid!r} not found.")
    return caller


async def _known(
    session: AsyncSession, table: type[Customer | Project | Offering], key: uuid.UUID, field: str
) -> None:
    """A 400 naming `field` unless the entity it references was pushed."""
    if await session.get(table, key) is None:
        what = table.__name__.lower()
        raise BadRequest(
            f"Unknown {what} {key.hex}: PUT the {what} first.",
            field=field,
        )


Row = TypeVar("Row", Offering, Customer, Project, Role)


async def _upsert(
    session: AsyncSession,
    table: type[Row],
    key: uuid.UUID,
    make: Callable[[], Row],
    apply: Callable[[Row], None],
    *,
    gone: BadRequest | None = None,
) -> tuple[Row, bool]:
    """The backend's idempotent PUT of one directory row, committed; True when created. A
    conflict (a concurrent PUT created the row first, or a row it references was deleted
    meanwhile) is tried once more on what is there now; a second is `gone` when given (the
    reference is missing), else raised."""
    for attempt in range(2):
        row = await session.get(table, key)
        created = row is None
        if row is None:
            row = make()
            session.add(row)
        apply(row)
        try:
            await session.commit()
            return row, created
        except IntegrityError as exc:
            await session.rollback()
            if attempt:
                if gone is not None:
                    raise gone from exc
                raise
    raise AssertionError("unreachable")  # pragma: no cover


async def put_offering(
    session: AsyncSession, offering_uuid: uuid.UUID, body: OfferingPut
) -> tuple[Offering, bool]:
    if body.customer_uuid is not None:
        await _known(session, Customer, body.customer_uuid, "customer_uuid")
    if body.project_uuid is not None:
        await _known(session, Project, body.project_uuid, "project_uuid")
    sent = body.model_fields_set

    def apply(offering: Offering) -> None:
        offering.name = body.name
        if body.state is not None:
            offering.state = body.state
        if "customer_uuid" in sent:
            offering.customer_uuid = body.customer_uuid
        if "project_uuid" in sent:
            offering.project_uuid = body.project_uuid

    return await _upsert(
        session,
        Offering,
        offering_uuid,
        lambda: Offering(uuid=offering_uuid, name=body.name, state=body.state or ""),
        apply,
    )


async def put_customer(
    session: AsyncSession, customer_uuid: uuid.UUID, body: CustomerPut
) -> tuple[Customer, bool]:
    def apply(customer: Customer) -> None:
        customer.name = body.name

    return await _upsert(
        session,
        Customer,
        customer_uuid,
        lambda: Customer(uuid=customer_uuid, name=body.name),
        apply,
    )


async def put_project(
    session: AsyncSession, project_uuid: uuid.UUID, body: ProjectPut
) -> tuple[Project, bool]:
    await _known(session, Customer, body.customer_uuid, "customer_uuid")

    def apply(project: Project) -> None:
        project.name = body.name
        project.customer_uuid = body.customer_uuid

    return await _upsert(
        session,
        Project,
        project_uuid,
        lambda: Project(uuid=project_uuid, name=body.name, customer_uuid=body.customer_uuid),
        apply,
        gone=BadRequest(
            f"Customer {body.customer_uuid.hex} was deleted meanwhile: PUT it first.",
            field="customer_uuid",
        ),
    )


async def delete_customer(session: AsyncSession, customer_uuid: uuid.UUID) -> None:
    """Its projects go with it (cascade), and the roles on it and on them; its offerings
    stay, without a customer."""
    projects = await repository.projects_of(session, customer_uuid)
    scopes = [(str(RoleScope.CUSTOMER), customer_uuid)] + [
        (str(RoleScope.PROJECT), p) for p in projects
    ]
    await repository.delete_roles_on(session, scopes)
    await consumers_repository.delete_bindings_on(session, scopes)
    customer = await session.get(Customer, customer_uuid)
    if customer is not None:
        await session.delete(customer)
    await session.commit()
    log.info("customer_deleted", customer=customer_uuid.hex, projects=len(projects))


async def delete_project(session: AsyncSession, project_uuid: uuid.UUID) -> None:
    await repository.delete_roles_on(session, [(RoleScope.PROJECT, project_uuid)])
    await consumers_repository.delete_bindings_on(session, [(RoleScope.PROJECT, project_uuid)])
    project = await session.get(Project, project_uuid)
    if project is not None:
        await session.delete(project)
    await session.commit()
    log.info("project_deleted", project=project_uuid.hex)


_ROLE_SCOPES: dict[str, type[Customer | Project | Offering]] = {
    RoleScope.CUSTOMER: Customer,
    RoleScope.PROJECT: Project,
    RoleScope.OFFERING: Offering,
}


async def put_role(session: AsyncSession, role_uuid: uuid.UUID, body: RolePut) -> tuple[Role, bool]:
    """A user's role on a customer, project or offering; True when created. The user and
    the scope must have been pushed (else a 400 naming which). An update that takes a role
    away from its user (another user or scope, or an expiry now past) is swept as any loss
    of access is: the copies that user may no longer receive leave its queues
    (docs/decisions/030-queued-copies-on-every-access-loss.md)."""
    if await session.get(User, body.user_uuid) is None:
        raise BadRequest(
            f"Unknown user {body.user_uuid.hex}: PUT the user first.", field="user_uuid"
        )
    await _known(session, _ROLE_SCOPES[body.scope.type], body.scope.uuid, "scope.uuid")

    def apply(role: Role) -> None:
        role.user_uuid = body.user_uuid
        role.role_name = body.role_name
        role.scope_type = body.scope.type
        role.scope_uuid = body.scope.uuid
        role.expires_at = body.expires_at

    role, created = await _upsert(
        session,
        Role,
        role_uuid,
        lambda: Role(uuid=role_uuid),
        apply,
        gone=BadRequest(
            f"User {body.user_uuid.hex} was deleted meanwhile: PUT it first.", field="user_uuid"
        ),
    )
    log.info(
        "role_saved",
        role=role_uuid.hex,
        user=body.user_uuid.hex,
        scope=f"{body.scope.type}:{body.scope.uuid.hex}",
        created=created,
    )
    return role, created


async def delete_role(session: AsyncSession, role_uuid: uuid.UUID) -> None:
    """The role stops counting for the next event (authorization at delivery, contract
    §12), and the copies its user may no longer receive leave its queues with the
    `sweep_access` job (docs/decisions/030-queued-copies-on-every-access-loss.md). 204
    also when gone."""
    role = await session.get(Role, role_uuid)
    if role is not None:
        await session.delete(role)
    await session.commit()
    log.info("role_deleted", role=role_uuid.hex, existed=role is not None)


async def delete_offering(
    session: AsyncSession, provisioner: Provisioner, offering_uuid: uuid.UUID
) -> None:
    if await session.get(Offering, offering_uuid) is None:
        return
    # Each grantee loses access first, as a revoke does, under its own owner lock: its
    # broker objects for the offering go before that commits, a registration racing it
    # waits and then finds no grant, and consumers that keep other offerings lose this
    # one's copies (decisions 002, 003).
    for user_uuid in await repository.grantees(session, offering_uuid):
        await session.commit()  # end the read: revoke_access takes the lock first
        await revoke_access(session, provisioner, user_uuid, offering_uuid)
    offering = await session.get(Offering, offering_uuid, with_for_update=True)
    if offering is None:
        await session.commit()
        return
    queues = await repository.queues_of_offering(session, offering_uuid)
    # Consumers bound to it alone go with it; others only lose it as a scope (cascade).
    consumers = await consumers_repository.scoped_only_to(session, offering_uuid)
    await consumers_service.give_up_copies_of_webhooks_deleted(session, consumers, utcnow())
    for consumer in consumers:
        await session.delete(consumer)
    # Before the offering: its deletion cascades to identities and so to these consumers.
    await session.flush()
    await repository.delete_roles_on(session, [(RoleScope.OFFERING, offering_uuid)])
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
    # The owner lock, then the vhost lock exclusively (create_queue holds it shared until its
    # row commits), then the grant: the order every writer takes them in.
    async with owner_locked(session, user_uuid, vhost_exclusive=True):
        grant = await repository.get_grant(session, user_uuid, offering_uuid, lock=True)
        queues = await repository.queues_of_user_for_offering(session, user_uuid, offering_uuid)
        # The user's consumers bound to this offering alone are deleted; those bound to
        # others too only lose this scope, and the offering's copies already in their queue
        # go with the `sweep_access` job that the grant's deletion wakes
        # (docs/decisions/030-queued-copies-on-every-access-loss.md).
        consumers = await consumers_repository.scoped_only_to(session, offering_uuid, user_uuid)
        gone = {consumer.uuid for consumer in consumers}
        scopes = await consumers_repository.scopes_of_owner_for(session, user_uuid, offering_uuid)
        narrowed = sorted({s.consumer_uuid for s in scopes if s.consumer_uuid not in gone})
        # Every copy of the offering's events not yet on the broker, for the queues and
        # consumers that lose it, is given up before the rows go (a deleted queue's copies
        # would lose their link to it): docs/decisions/021-authorized-when-published.md.
        await outbox.give_up_waiting(
            session,
            utcnow(),
            "the owner's access to the offering was revoked",
            "not_authorized",
            consumer_uuids=[*narrowed, *gone],
            queue_uuids=[queue.uuid for queue in queues],
            offering_uuid=offering_uuid,
        )
        if grant is not None:
            await session.delete(grant)
        for row in [*queues, *consumers, *(s for s in scopes if s.consumer_uuid not in gone)]:
            await session.delete(row)
        await session.flush()
        leftovers = BrokerLeftovers(queues=[(q.vhost, q.queue_name) for q in queues])
        await remove_leftovers_held(session, provisioner, leftovers.add_consumers(consumers))
        await session.commit()
    log.info(
        "access_revoked",
        user=user_uuid.hex,
        offering=offering_uuid.hex,
        queues=len(queues),
        consumers=len(consumers),
        narrowed_consumers=len(narrowed),
    )
    # A consumer of a deleted queue is cancelled by the broker; closing the logins that
    # read the offering's queues also ends anything else they held open for it.
    await provisioner.close_connections(
        sorted({topology.subscription_user_name(q.subscription_uuid) for q in queues})
    )
