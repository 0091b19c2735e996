"""Broker users and permissions: what the broker holds, read once per run, and the repairs.

The broker is asked twice per run (every user, every permission) rather than
once per subscription; what is kept is limited to queuekeeper's own users and
vhosts, so memory follows the number of subscriptions, not of queues.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.jobs.runs import Run
from queuekeeper.reconcile import repository
from queuekeeper.reconcile.repository import ConsumerAccess, SubscriptionAccess
from queuekeeper.state import AppState

_UUID_HEX = re.compile(r"^[0-9a-f]{32}$")


def _tags(value: Any) -> list[str]:
    """The broker answers tags as a list (3.10) or a comma-separated string (older)."""
    if isinstance(value, str):
        return [tag for tag in value.split(",") if tag]
    return [str(tag) for tag in value or []]


@dataclass(frozen=True)
class BrokerUser:
    name: str
    password_hash: str
    tags: tuple[str, ...]


@dataclass
class BrokerAccess:
    instance_tag: str
    users: dict[str, BrokerUser] = field(default_factory=dict)
    permissions: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)

    @classmethod
    async def load(
        cls, management: ManagementClient, instance_tag: str, vhosts: set[str]
    ) -> BrokerAccess:
        access = cls(instance_tag)
        for user in await management.list_users(columns="name,tags,password_hash"):
            name = str(user.get("name") or "")
            tags = tuple(_tags(user.get("tags")))
            # Ours, or named like a subscription's user (one that lost its tag is still ours).
            if instance_tag in tags or _UUID_HEX.match(name):
                access.users[name] = BrokerUser(name, str(user.get("password_hash") or ""), tags)
        for permission in await management.list_permissions():
            vhost, holder = permission.get("vhost"), permission.get("user")
            if vhost in vhosts and isinstance(holder, str):
                access.permissions[(vhost, holder)] = {
                    key: str(permission.get(key)) for key in ("configure", "write", "read")
                }
        return access

    def ours(self) -> list[str]:
        return sorted(name for name, user in self.users.items() if self.instance_tag in user.tags)

    def vhost_created(self, vhost: str, service_users: list[str]) -> None:
        """ensure_vhost just gave our service users their rights there."""
        for user in service_users:
            self.permissions[(vhost, user)] = topology.SERVICE_PERMISSIONS.as_body()


async def check_service_permissions(
    run: Run, provisioner: Provisioner, access: BrokerAccess, vhost: str
) -> None:
    expected = topology.SERVICE_PERMISSIONS.as_body()
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
                partial(
                    provisioner.management.put_permissions,
                    vhost,
                    user,
                    topology.SERVICE_PERMISSIONS,
                ),
                detail="queuekeeper's own user: " + ("missing" if actual is None else f"{actual}"),
            )


async def _settle_password(
    state: AppState, subscription: SubscriptionAccess, written: str | None
) -> None:
    """Record the password now on the broker, catching a token change that raced us.

    The directory commits a new token before it writes the broker, so re-reading
    the owner after our write is enough: either we see the new hash and write it
    too, or the directory's write comes after ours.
    """
    async with state.sessions() as session:
        current = await repository.owner_password_hash(session, subscription.owner_uuid)
        if current != written:
            await state.provisioner.set_subscription_password(subscription.uuid, current)
        await repository.set_subscription_broker_state(
            session, subscription.uuid, broker_state="ok", password_hash=current, set_hash=True
        )


def _user_problems(access: BrokerAccess, user: BrokerUser, owner_hash: str | None) -> list[str]:
    problems = []
    if user.password_hash != (owner_hash or ""):
        problems.append("password is not the owner's current token")
    if access.instance_tag not in user.tags:
        problems.append(f"tag {access.instance_tag!r} missing")
    return problems


async def _look_again(
    state: AppState, name: str, subscription: SubscriptionAccess | ConsumerAccess
) -> tuple[BrokerUser | None, str | None]:
    """The broker user and the owner's password hash as they are now.

    What the run read at its start may be stale by now (a subscription made or a
    token changed meanwhile): look again before changing anything.
    """
    found = await state.management.get_user(name)
    user = (
        BrokerUser(name, str(found.get("password_hash") or ""), tuple(_tags(found.get("tags"))))
        if found is not None
        else None
    )
    async with state.sessions() as session:
        owner_hash = await repository.owner_password_hash(session, subscription.owner_uuid)
    return user, owner_hash


async def check_subscription(
    state: AppState, run: Run, access: BrokerAccess, vhost: str, subscription: SubscriptionAccess
) -> None:
    """The subscription's broker user exists with the owner's token as password, tagged ours,
    and may read its own queues and nothing else."""
    provisioner = state.provisioner
    name = topology.subscription_user_name(subscription.uuid)
    item = f"broker user {name}"
    run.find("subscriptions")
    user, owner_hash = access.users.get(name), subscription.owner_password_hash
    if user is None or _user_problems(access, user, owner_hash):
        user, owner_hash = await _look_again(state, name, subscription)

    if user is None:
        run.find("users_missing")
        if owner_hash is None:
            run.find("users_unrestorable")
            if subscription.broker_state != "broken":
                await run.apply(
                    "subscriptions_marked_broken",
                    "mark_broken",
                    item,
                    lambda: _mark_broken(state, subscription.uuid),
                    detail="its owner has no token, so the user cannot get its password back; "
                    "the agent's next register_event_subscription replaces the subscription",
                )
            return

        async def restore() -> None:
            await provisioner.ensure_subscription_user(vhost, subscription.uuid, owner_hash)
            await _settle_password(state, subscription, owner_hash)

        await run.apply(
            "users_restored",
            "restore_user",
            item,
            restore,
            detail="re-created with the owner's token as password, and its permissions",
        )
        return

    problems = _user_problems(access, user, owner_hash)
    if problems:
        run.find("users_wrong")

        async def repair() -> None:
            await provisioner.set_subscription_password(subscription.uuid, owner_hash)
            await _settle_password(state, subscription, owner_hash)

        await run.apply("users_restored", "repair_user", item, repair, detail="; ".join(problems))
    elif subscription.broker_state == "broken" and not run.dry_run:
        # Its user is back (restored by an earlier run, or by hand): usable again.
        async with state.sessions() as session:
            await repository.set_subscription_broker_state(
                session, subscription.uuid, broker_state="ok"
            )

    await _check_permissions(
        state,
        run,
        access,
        vhost,
        name,
        topology.subscription_permissions(subscription.uuid).as_body(),
        partial(provisioner.put_subscription_permissions, vhost, subscription.uuid),
    )


async def _check_permissions(
    state: AppState,
    run: Run,
    access: BrokerAccess,
    vhost: str,
    name: str,
    expected: dict[str, str],
    put: Callable[[], Awaitable[None]],
) -> None:
    """The broker user `name` holds exactly `expected` in the vhost, or `put` restores it."""
    actual = access.permissions.get((vhost, name))
    if actual != expected:
        fresh = await state.management.get_permissions(vhost, name)
        actual = {key: str(fresh.get(key)) for key in expected} if fresh else None
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
    state: AppState, run: Run, access: BrokerAccess, vhost: str, consumer: ConsumerAccess
) -> None:
    """A consumer's broker user exists with the owner's token as password, tagged ours, and
    may read its one queue and nothing else (SPEC 9)."""
    provisioner = state.provisioner
    name = topology.consumer_user_name(consumer.uuid)
    item = f"broker user {name}"
    run.find("consumers")
    user, owner_hash = access.users.get(name), consumer.owner_password_hash
    if user is None or _user_problems(access, user, owner_hash):
        user, owner_hash = await _look_again(state, name, consumer)

    async def settle() -> None:
        # A token change racing us: re-read the owner after our write (as for subscriptions).
        async with state.sessions() as session:
            current = await repository.owner_password_hash(session, consumer.owner_uuid)
            if current != owner_hash:
                await provisioner.set_consumer_password(consumer.uuid, current)
            await repository.set_consumer_password_hash(session, consumer.uuid, current)

    if user is None:
        run.find("users_missing")

        async def restore() -> None:
            await provisioner.ensure_consumer_user(vhost, consumer.uuid, owner_hash)
            await settle()

        await run.apply(
            "users_restored",
            "restore_user",
            item,
            restore,
            detail="a consumer's broker user was missing; re-created with the owner's token as "
            "password, and its permissions",
        )
        return
    problems = _user_problems(access, user, owner_hash)
    if problems:
        run.find("users_wrong")

        async def repair() -> None:
            await provisioner.set_consumer_password(consumer.uuid, owner_hash)
            await settle()

        await run.apply("users_restored", "repair_user", item, repair, detail="; ".join(problems))
    await _check_permissions(
        state,
        run,
        access,
        vhost,
        name,
        topology.consumer_permissions(consumer.uuid).as_body(),
        partial(provisioner.put_consumer_permissions, vhost, consumer.uuid),
    )


def _describe(permissions: dict[str, Any]) -> str:
    return ", ".join(f"{key} {permissions.get(key)!r}" for key in ("configure", "write", "read"))


async def _mark_broken(state: AppState, subscription_uuid: uuid.UUID) -> None:
    async with state.sessions() as session:
        await repository.set_subscription_broker_state(
            session, subscription_uuid, broker_state="broken"
        )
