"""Broker users and permissions: what the broker holds, read once per run, and the repairs.

The broker is asked twice per run (every user, every permission) rather than
once per subscription; what is kept is limited to queuekeeper's own users and
vhosts, so memory follows the number of subscriptions, not of queues.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient, UserInfo
from queuekeeper.broker.provisioner import Ownership, Provisioner
from queuekeeper.broker.topology import Permissions
from queuekeeper.common.locks import guard, user_key
from queuekeeper.jobs.runs import JobContext, Run
from queuekeeper.reconcile import repository
from queuekeeper.reconcile.repository import ConsumerAccess, SubscriptionAccess


@dataclass
class BrokerAccess:
    provisioner: Provisioner
    users: dict[str, UserInfo] = field(default_factory=dict)
    permissions: dict[tuple[str, str], Permissions] = field(default_factory=dict)

    @classmethod
    async def load(
        cls, management: ManagementClient, provisioner: Provisioner, vhosts: set[str]
    ) -> BrokerAccess:
        access = cls(provisioner)
        for user in await management.list_users(columns="name,tags,password_hash"):
            # Ours, or named like a subscription's user (one that lost its tag is still ours;
            # one of another installation is reported, see _other_installation).
            if provisioner.owns(user) or topology.named_like_subscription_user(user.name):
                access.users[user.name] = user
        for permission in await management.list_permissions():
            if permission.vhost in vhosts:
                access.permissions[(permission.vhost, permission.user)] = permission.permissions
        return access

    def ours(self) -> list[str]:
        return sorted(name for name, user in self.users.items() if self.provisioner.owns(user))

    def vhost_created(self, vhost: str, service_users: list[str]) -> None:
        """ensure_vhost just gave our service users their rights there."""
        for user in service_users:
            self.permissions[(vhost, user)] = topology.SERVICE_PERMISSIONS


async def check_service_permissions(
    run: Run, provisioner: Provisioner, access: BrokerAccess, vhost: str
) -> None:
    expected = topology.SERVICE_PERMISSIONS
    for user in provisioner.service_users():
        actual = access.permissions.get((vhost, user))
        if actual == expected:
            continue
        run.find("service_permissions_wrong")
        async with run.item(f"{vhost}/{user}"):
            await run.apply(
                "permissions_restored",
                "put_permissions",
                f"{vhost}/{user}",
                partial(provisioner.put_service_permissions, vhost, user),
                detail="queuekeeper's own user: "
                + ("missing" if actual is None else f"{actual.as_body()}"),
            )


async def _write_login(
    context: JobContext,
    owner_uuid: uuid.UUID,
    record: Callable[[AsyncSession, str | None], Awaitable[bool]],
    write: Callable[[str | None], Awaitable[None]],
) -> None:
    """Record, then write to the broker, the owner's current password hash, under the owner
    lock every writer of its broker users holds (docs/decisions/002-owner-lock.md): a token
    change or a deletion racing the run waits, or has committed and is what is read here.
    Nothing is written for a row deleted meanwhile (`record` answers False)."""
    async with (
        context.sessions() as session,
        guard(session, user_key(owner_uuid), exclusive=True),
    ):
        current = await repository.owner_password_hash(session, owner_uuid)
        if await record(session, current):
            await write(current)
        await session.commit()


async def _repair_password(
    context: JobContext,
    run: Run,
    item: str,
    problems: list[str],
    owner_uuid: uuid.UUID,
    record: Callable[[AsyncSession, str | None], Awaitable[bool]],
    write: Callable[[str | None], Awaitable[None]],
) -> None:
    """A broker user whose password or tag is wrong: written again under the owner lock."""
    run.find("users_wrong")
    repair = partial(_write_login, context, owner_uuid, record, write)
    await run.apply("users_restored", "repair_user", item, repair, detail="; ".join(problems))


def _record_subscription(
    subscription_uuid: uuid.UUID,
) -> Callable[[AsyncSession, str | None], Awaitable[bool]]:
    return lambda session, current: repository.set_subscription_broker_state(
        session, subscription_uuid, broker_state="ok", password_hash=current, set_hash=True
    )


def _record_consumer(
    consumer_uuid: uuid.UUID,
) -> Callable[[AsyncSession, str | None], Awaitable[bool]]:
    return lambda session, current: repository.set_consumer_password_hash(
        session, consumer_uuid, current
    )


def _user_problems(access: BrokerAccess, user: UserInfo, owner_hash: str | None) -> list[str]:
    problems = []
    if user.password_hash != (owner_hash or ""):
        problems.append("password is not the owner's current token")
    ownership = access.provisioner.ownership(user)
    if ownership is Ownership.UNCLAIMED:
        problems.append("made before installation identities: adopted (tagged as ours)")
    elif ownership is not Ownership.OURS:
        problems.append(f"tag {access.provisioner.settings.instance_tag!r} missing")
    return problems


def _other_installation(run: Run, access: BrokerAccess, item: str, user: UserInfo) -> bool:
    """A broker user of another installation is never changed, even with our row's name
    (a copy of this database used by another installation makes such pairs)."""
    if access.provisioner.ownership(user) is not Ownership.OTHER_INSTALLATION:
        return False
    run.find("users_other_installation")
    run.fail(item, f"left alone: {access.provisioner.why_not_ours(user)}")
    return True


async def _look_again(
    context: JobContext, name: str, subscription: SubscriptionAccess | ConsumerAccess
) -> tuple[UserInfo | None, str | None]:
    """The broker user and the owner's password hash as they are now.

    What the run read at its start may be stale by now (a subscription made or a
    token changed meanwhile): look again before changing anything.
    """
    user = await context.management.get_user(name)
    async with context.sessions() as session:
        owner_hash = await repository.owner_password_hash(session, subscription.owner_uuid)
    return user, owner_hash


async def check_subscription(
    context: JobContext,
    run: Run,
    access: BrokerAccess,
    vhost: str,
    subscription: SubscriptionAccess,
) -> None:
    """The subscription's broker user exists with the owner's token as password, tagged ours,
    and may read its own queues and nothing else."""
    provisioner = context.provisioner
    name = topology.subscription_user_name(subscription.uuid)
    item = f"broker user {name}"
    run.find("subscriptions")
    user, owner_hash = access.users.get(name), subscription.owner_password_hash
    if user is None or _user_problems(access, user, owner_hash):
        user, owner_hash = await _look_again(context, name, subscription)
    if user is not None and _other_installation(run, access, item, user):
        return

    if user is None:
        run.find("users_missing")
        if owner_hash is None:
            run.find("users_unrestorable")
            if subscription.broker_state != "broken":
                await run.apply(
                    "subscriptions_marked_broken",
                    "mark_broken",
                    item,
                    lambda: _mark_broken(context, subscription.uuid),
                    detail="its owner has no token, so the user cannot get its password back; "
                    "the agent's next register_event_subscription replaces the subscription",
                )
            return

        await run.apply(
            "users_restored",
            "restore_user",
            item,
            partial(
                _write_login,
                context,
                subscription.owner_uuid,
                _record_subscription(subscription.uuid),
                partial(provisioner.ensure_subscription_user, vhost, subscription.uuid),
            ),
            detail="re-created with the owner's token as password, and its permissions",
        )
        return

    problems = _user_problems(access, user, owner_hash)
    if problems:
        await _repair_password(
            context,
            run,
            item,
            problems,
            subscription.owner_uuid,
            _record_subscription(subscription.uuid),
            partial(provisioner.set_subscription_password, subscription.uuid),
        )
    elif subscription.broker_state == "broken" and not run.dry_run:
        # Its user is back (restored by an earlier run, or by hand): usable again.
        async with context.sessions() as session:
            await repository.set_subscription_broker_state(
                session, subscription.uuid, broker_state="ok"
            )
            await session.commit()

    await _check_permissions(
        context,
        run,
        access,
        vhost,
        name,
        topology.subscription_permissions(subscription.uuid),
        partial(provisioner.put_subscription_permissions, vhost, subscription.uuid),
    )


async def _check_permissions(
    context: JobContext,
    run: Run,
    access: BrokerAccess,
    vhost: str,
    name: str,
    expected: Permissions,
    put: Callable[[], Awaitable[None]],
) -> None:
    """The broker user `name` holds exactly `expected` in the vhost, or `put` restores it."""
    actual = access.permissions.get((vhost, name))
    if actual != expected:
        fresh = await context.management.get_permissions(vhost, name)
        actual = fresh.permissions if fresh else None
    if actual != expected:
        run.find("permissions_wrong")
        await run.apply(
            "permissions_restored",
            "put_permissions",
            f"{vhost}/{name}",
            put,
            detail="missing" if actual is None else f"was {_describe(actual)}",
        )


async def check_consumer(
    context: JobContext, run: Run, access: BrokerAccess, vhost: str, consumer: ConsumerAccess
) -> None:
    """A consumer's broker user exists with the owner's token as password, tagged ours, and
    may read its one queue and nothing else (contract §9). Unlike a subscription it is never
    marked broken: the owner's next register_queue sets everything again."""
    provisioner = context.provisioner
    name = topology.consumer_user_name(consumer.uuid)
    item = f"broker user {name}"
    run.find("consumers")
    user, owner_hash = access.users.get(name), consumer.owner_password_hash
    if user is None or _user_problems(access, user, owner_hash):
        user, owner_hash = await _look_again(context, name, consumer)
    if user is not None and _other_installation(run, access, item, user):
        return

    if user is None:
        run.find("users_missing")
        await run.apply(
            "users_restored",
            "restore_user",
            item,
            partial(
                _write_login,
                context,
                consumer.owner_uuid,
                _record_consumer(consumer.uuid),
                partial(provisioner.ensure_consumer_user, vhost, consumer.uuid),
            ),
            detail="a consumer's broker user was missing; re-created with the owner's token as "
            "password, and its permissions",
        )
        return
    problems = _user_problems(access, user, owner_hash)
    if problems:
        await _repair_password(
            context,
            run,
            item,
            problems,
            consumer.owner_uuid,
            _record_consumer(consumer.uuid),
            partial(provisioner.set_consumer_password, consumer.uuid),
        )
    await _check_permissions(
        context,
        run,
        access,
        vhost,
        name,
        topology.consumer_permissions(consumer.uuid),
        partial(provisioner.put_consumer_permissions, vhost, consumer.uuid),
    )


def _describe(permissions: Permissions) -> str:
    return ", ".join(f"{key} {value!r}" for key, value in permissions.as_body().items())


async def _mark_broken(context: JobContext, subscription_uuid: uuid.UUID) -> None:
    async with context.sessions() as session:
        await repository.set_subscription_broker_state(
            session, subscription_uuid, broker_state="broken"
        )
        await session.commit()
