"""Puts the topology of contract §3 on the broker, and takes it off again.

Every `ensure_*` is idempotent and verifies what it asked for by reading it
back: a 2xx from the Management API does not prove a queue has our arguments.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

import structlog

from queuekeeper.broker import topology
from queuekeeper.broker.census import DeadLetterCensus
from queuekeeper.broker.management import (
    BrokerUnavailable,
    ManagementBadRequest,
    ManagementClient,
    ManagementNotFound,
    QueueInfo,
    UserInfo,
    VhostInfo,
)
from queuekeeper.config import Settings

log = structlog.get_logger(__name__)


VANISHED = "queue vanished while being checked"
VHOST_DESCRIPTION = "queuekeeper: event queues of one user"


class QueueOutcome(enum.StrEnum):
    CREATED = "created"
    EXISTING = "existing"
    # Found right by a read alone (ensure_queue with `known`): nothing was declared.
    VERIFIED = "verified"
    REPAIRED = "repaired"
    # Of the other queue type (classic/quorum) and busy: kept as it is, see ensure_queue.
    KEPT = "kept"


class QueueConflict(Exception):
    """A queue exists with other arguments and cannot be repaired without losing messages."""

    def __init__(self, vhost: str, name: str, reason: str) -> None:
        super().__init__(reason)
        self.vhost = vhost
        self.name = name
        self.reason = reason


class Ownership(enum.StrEnum):
    """Whose a vhost or broker user is (docs/decisions/001-installation-identity.md)."""

    # Tagged with this installation's identity.
    OURS = "ours"
    # Tagged `queuekeeper:<our instance name>` but with no installation identity: made
    # before identities existed. Adopted only for rows of this database, never deleted.
    UNCLAIMED = "unclaimed"
    # Tagged with our instance name and another installation's identity: another
    # queuekeeper with the same QUEUEKEEPER_INSTANCE_NAME shares this broker.
    OTHER_INSTALLATION = "other_installation"
    # Anything else (not queuekeeper's, or another instance name).
    NOT_OURS = "not_ours"


class ForeignVhost(Exception):
    """The vhost exists but is not this installation's: we never touch it."""

    def __init__(self, vhost: str, tags: list[str], reason: str = "") -> None:
        super().__init__(vhost)
        self.vhost = vhost
        self.tags = tags
        self.reason = reason or f"not tagged as this installation's (tags: {tags})"


def busy(info: QueueInfo | None) -> str:
    """Why a queue cannot be repaired (it holds messages or has consumers); empty if it can."""
    if info is None:
        return ""
    parts = []
    if info.messages:
        parts.append(f"holds {info.messages} messages")
    if info.consumers:
        parts.append(f"has {info.consumers} consumers")
    return ", ".join(parts)


Identity = Callable[[], Awaitable[uuid.UUID]]


class Provisioner:
    """`identity` is the installation's uuid, or how to read it (from the database, once,
    by `identify`)."""

    def __init__(
        self,
        management: ManagementClient,
        settings: Settings,
        identity: uuid.UUID | Identity | None = None,
    ) -> None:
        self.management = management
        self.settings = settings
        self.installation = identity if isinstance(identity, uuid.UUID) else None
        self._read_identity = None if isinstance(identity, uuid.UUID) else identity
        self.queue_arguments = topology.queue_arguments(settings)
        # What a queue declared before a change of queue_type looks like (classic <-> quorum).
        other = topology.CLASSIC if settings.queue_type == topology.QUORUM else topology.QUORUM
        self.other_type_arguments = topology.queue_arguments(
            settings.model_copy(update={"queue_type": other})
        )
        self.dlq_arguments = topology.dead_letter_queue_arguments(settings)
        # Each vhost's dead letters by queue, counted in the background for status answers.
        self.dead_letters = DeadLetterCensus(settings)

    # --- ownership -------------------------------------------------------------------
    async def identify(self) -> uuid.UUID:
        """This installation's uuid, read once."""
        if self.installation is None:
            if self._read_identity is None:
                raise RuntimeError("this Provisioner was given no installation identity")
            self.installation = await self._read_identity()
        return self.installation

    async def tags(self) -> list[str]:
        """What every vhost and broker user we make carries."""
        identity = await self.identify()
        return [self.settings.instance_tag, topology.installation_tag(identity)]

    def ownership(self, info: VhostInfo | UserInfo) -> Ownership:
        if self.installation is None:
            # A caller that forgot identify() would see nothing as ours: fail loudly instead.
            raise RuntimeError("Provisioner.identify() must be awaited before ownership()")
        installations = topology.installations_of(info.tags)
        if self.installation.hex in installations:
            return Ownership.OURS
        if self.settings.instance_tag not in info.tags:
            return Ownership.NOT_OURS
        return Ownership.OTHER_INSTALLATION if installations else Ownership.UNCLAIMED

    def owns(self, info: VhostInfo | UserInfo) -> bool:
        """A vhost or broker user is ours when it carries this installation's identity."""
        return self.ownership(info) is Ownership.OURS

    def why_not_ours(self, info: VhostInfo | UserInfo) -> str:
        """Why an object is left alone, in words an operator can act on."""
        ownership = self.ownership(info)
        if ownership is Ownership.OTHER_INSTALLATION:
            others = ", ".join(topology.installations_of(info.tags))
            return (
                f"it belongs to installation {others}, another queuekeeper using the instance "
                f"name {self.settings.instance_name!r} on this broker (give each installation "
                "its own QUEUEKEEPER_INSTANCE_NAME)"
            )
        if ownership is Ownership.UNCLAIMED:
            return (
                f"it is tagged {self.settings.instance_tag!r} without an installation identity "
                "(made before identities existed) and this database has no rows for it"
            )
        return f"it is not tagged {self.settings.instance_tag!r} (tags: {list(info.tags)})"

    # --- vhosts ------------------------------------------------------------------------
    async def owned_vhosts(self) -> list[str]:
        """Names of the vhosts tagged as this installation's, sorted."""
        await self.identify()
        vhosts = await self.management.list_vhosts()
        return sorted(info.name for info in vhosts if self.owns(info))

    async def owns_vhost(self, vhost: str) -> bool:
        if not topology.is_vhost_name(vhost):
            return False  # never ours: no need to ask the broker
        await self.identify()
        info = await self.management.get_vhost(vhost)
        return info is not None and self.owns(info)

    async def owned_users(self) -> list[str]:
        """Names of the broker users tagged as this installation's, sorted."""
        await self.identify()
        users = await self.management.list_users()
        return sorted(info.name for info in users if self.owns(info))

    async def adopt_vhost(self, info: VhostInfo) -> None:
        """Give a vhost made before installation identities ours (its tags kept)."""
        tags = list(dict.fromkeys([*info.tags, *await self.tags()]))
        await self.management.put_vhost(info.name, description=VHOST_DESCRIPTION, tags=tags)
        log.info("vhost_adopted", vhost=info.name, tags=tags)

    async def ensure_vhost(self, vhost: str) -> bool:
        """Vhost tagged as ours, our own users with full rights, the dead-letter queue.

        A vhost made before installation identities (`UNCLAIMED`) is adopted: whoever calls
        this acts for the vhost's user, a row of this database. Returns True when the vhost
        was created.
        """
        tags = await self.tags()
        info = await self.management.get_vhost(vhost)
        created = info is None
        if info is None:
            await self.management.put_vhost(vhost, description=VHOST_DESCRIPTION, tags=tags)
            log.info("vhost_created", vhost=vhost)
        elif self.ownership(info) is Ownership.UNCLAIMED:
            await self.adopt_vhost(info)
        elif not self.owns(info):
            raise ForeignVhost(vhost, list(info.tags), self.why_not_ours(info))
        for user in self.service_users():
            await self.put_service_permissions(vhost, user)
        await self.ensure_vhost_limits(vhost, read_first=not created)
        await self.ensure_dead_letter_queue(vhost)
        return created

    async def put_service_permissions(self, vhost: str, user: str) -> None:
        await self.management.put_permissions(vhost, user, topology.SERVICE_PERMISSIONS)

    def service_users(self) -> list[str]:
        """The Management API user and the AMQP users (they may differ) all need full rights."""
        users = {self.settings.management_user}
        for url in self.settings.amqp_urls:
            amqp_user = urlsplit(url).username
            if amqp_user:
                users.add(unquote(amqp_user))
        return sorted(users)

    async def ensure_dead_letter_queue(self, vhost: str) -> None:
        name = self.settings.dlq_name
        try:
            await self.management.put_queue(vhost, name, arguments=self.dlq_arguments)
        except ManagementBadRequest as exc:
            # A dead-letter queue with other bounds still holds messages worth
            # keeping: report it, never delete it.
            log.warning("dead_letter_queue_drifted", vhost=vhost, queue=name, reason=exc.reason)

    async def repair_dead_letter_queue(self, vhost: str, found: list[str]) -> None:
        """Re-create the dead-letter queue with our bounds, only when empty and unconsumed."""
        name = self.settings.dlq_name
        await self._delete_if_idle(
            vhost,
            name,
            f"dead-letter queue has other arguments ({'; '.join(found)}) and is not empty "
            "or has consumers, so it was kept",
            ". Redrive or purge it, then run reconcile again.",
        )
        await self.management.put_queue(vhost, name, arguments=self.dlq_arguments)

    async def delete_vhost(self, vhost: str) -> bool:
        """Delete a vhost only if it carries our tag. Returns True when deleted."""
        await self.identify()
        info = await self.management.get_vhost(vhost)
        if info is None:
            return False
        if not self.owns(info):
            log.warning("vhost_not_ours_left_alone", vhost=vhost, reason=self.why_not_ours(info))
            return False
        deleted = await self.management.delete_vhost(vhost)
        if deleted:
            log.info("vhost_deleted", vhost=vhost)
        return deleted

    # --- subscription broker users ------------------------------------------------
    # A subscription's and a consumer's broker users (below) are made the same way: the
    # agent's STOMP login, password = the owner's API token, read on its own queues only.
    async def ensure_subscription_user(
        self, vhost: str, subscription_uuid: uuid.UUID, password_hash: str | None
    ) -> None:
        await self.set_subscription_password(subscription_uuid, password_hash)
        await self.put_subscription_permissions(vhost, subscription_uuid)

    async def put_subscription_permissions(self, vhost: str, subscription_uuid: uuid.UUID) -> None:
        await self._put_reader_permissions(
            vhost,
            topology.subscription_user_name(subscription_uuid),
            topology.subscription_permissions(subscription_uuid),
        )

    async def set_subscription_password(
        self, subscription_uuid: uuid.UUID, password_hash: str | None
    ) -> None:
        await self._put_reader_user(
            topology.subscription_user_name(subscription_uuid), password_hash
        )

    async def subscription_user_intact(self, vhost: str, subscription_uuid: uuid.UUID) -> bool:
        """The broker user exists and holds permissions in the owner's vhost.

        Without either the agent cannot log in or cannot read its queues.
        """
        return await self._user_intact(vhost, topology.subscription_user_name(subscription_uuid))

    # --- consumer broker users (contract §9) ----------------------------------------------------
    async def ensure_consumer_user(
        self, vhost: str, consumer_uuid: uuid.UUID, password_hash: str | None
    ) -> None:
        await self.set_consumer_password(consumer_uuid, password_hash)
        await self.put_consumer_permissions(vhost, consumer_uuid)

    async def put_consumer_permissions(self, vhost: str, consumer_uuid: uuid.UUID) -> None:
        await self._put_reader_permissions(
            vhost,
            topology.consumer_user_name(consumer_uuid),
            topology.consumer_permissions(consumer_uuid),
        )

    async def set_consumer_password(
        self, consumer_uuid: uuid.UUID, password_hash: str | None
    ) -> None:
        await self._put_reader_user(topology.consumer_user_name(consumer_uuid), password_hash)

    async def consumer_user_intact(self, vhost: str, consumer_uuid: uuid.UUID) -> bool:
        return await self._user_intact(vhost, topology.consumer_user_name(consumer_uuid))

    async def delete_consumer_user(self, consumer_uuid: uuid.UUID) -> bool:
        return await self.delete_user(topology.consumer_user_name(consumer_uuid))

    async def _put_reader_user(self, name: str, password_hash: str | None) -> None:
        await self.management.put_user(
            # An empty hash means "no password login": used when the owner has no token.
            name,
            password_hash=password_hash or "",
            tags=await self.tags(),
        )
        # RabbitMQ's own limits on an agent login (a PUT may also re-create a user deleted
        # by hand, without them).
        await self.ensure_user_limits(name)

    async def _put_reader_permissions(
        self, vhost: str, name: str, permissions: topology.Permissions
    ) -> None:
        try:
            await self.management.put_permissions(vhost, name, permissions)
        except ManagementNotFound as exc:
            if not exc.vhost_not_found:
                raise
            await self.ensure_vhost(vhost)
            await self.management.put_permissions(vhost, name, permissions)

    async def holds_password(self, name: str, password_hash: str | None) -> bool | None:
        """Whether the broker user `name` holds this password hash (None: no password
        login); None when there is no such user."""
        info = await self.management.get_user(name)
        if info is None:
            return None
        return info.password_hash == (password_hash or "")

    async def login_hashes(self) -> dict[str, str]:
        """Every broker user of ours and the password hash it holds ("" for none): one
        listing, for comparing what the broker holds with what the rows want.

        Users made before installation identities (`UNCLAIMED`) count too: the caller
        matches names against this database's rows, so only users it has rows for are
        acted on, and an expired token must not outlive an upgrade until reconcile adopts
        them (decision 001)."""
        await self.identify()
        users = await self.management.list_users(columns="name,tags,password_hash")
        wanted = (Ownership.OURS, Ownership.UNCLAIMED)
        return {info.name: info.password_hash for info in users if self.ownership(info) in wanted}

    async def _user_intact(self, vhost: str, name: str) -> bool:
        """The broker user exists and holds permissions in the vhost."""
        if await self.management.get_user(name) is None:
            return False
        return await self.management.get_permissions(vhost, name) is not None

    async def delete_subscription_user(self, subscription_uuid: uuid.UUID) -> bool:
        return await self.delete_user(topology.subscription_user_name(subscription_uuid))

    async def delete_user(self, name: str) -> bool:
        """Delete a broker user by name (one of ours: callers checked). True when deleted."""
        return await self.management.delete_user(name)

    # --- broker limits (quotas the broker itself enforces) ----------------------------
    async def ensure_vhost_limits(self, vhost: str, *, read_first: bool = True) -> None:
        """Give the vhost our `max-connections`/`max-queues`.

        Without `read_first` (a vhost just created, or drift already known) each is set
        without reading the current ones back.
        """
        expected = topology.vhost_limits(self.settings)
        current = await self.management.get_vhost_limits(vhost) if read_first else {}
        for name, value in expected.items():
            if current.get(name) != value:
                await self.management.put_vhost_limit(vhost, name, value)

    async def ensure_user_limits(self, user: str, *, read_first: bool = True) -> None:
        """Give an agent broker user our connection and channel limits (as above)."""
        expected = topology.user_limits(self.settings)
        current = await self.management.get_user_limits(user) if read_first else {}
        for name, value in expected.items():
            if current.get(name) != value:
                await self.management.put_user_limit(user, name, value)

    async def limit_drift(
        self, vhosts: Iterable[str], users: Iterable[str]
    ) -> list[tuple[str, str, list[str]]]:
        """(kind, name, differences) for each of these vhosts and agent broker users whose
        broker limits are not ours; two Management API calls for all of them."""
        drift: list[tuple[str, str, list[str]]] = []
        for kind, names, current, expected in (
            ("vhost", vhosts, await self.management.list_vhost_limits(), topology.vhost_limits),
            ("user", users, await self.management.list_user_limits(), topology.user_limits),
        ):
            for name in names:
                differences = topology.limit_differences(
                    expected(self.settings), current.get(name, {})
                )
                if differences:
                    drift.append((kind, name, differences))
        return drift

    async def restore_limits(self, kind: str, name: str) -> None:
        if kind == "vhost":
            await self.ensure_vhost_limits(name, read_first=False)
        else:
            await self.ensure_user_limits(name, read_first=False)

    # --- revocation ------------------------------------------------------------------
    async def close_connections(self, usernames: Iterable[str]) -> int:
        """Close every open broker connection of these broker users (subscriptions' and,
        through the same call, unified consumers'); returns how many calls succeeded.

        Best effort per user: a failure is logged and the rest still go.
        """
        closed = 0
        for name in usernames:
            if await best_effort(
                "close_connections", self.management.close_user_connections(name), user=name
            ):
                closed += 1
        return closed

    # --- queues ------------------------------------------------------------------------
    async def ensure_queue(
        self, vhost: str, name: str, *, keep_other_type: bool = False, known: bool = False
    ) -> QueueOutcome:
        """Declare a subscription queue with exactly our arguments.

        A queue that exists with other arguments (the agent-subscribed-first race,
        or changed settings) is deleted and re-created when the broker confirms it
        is empty and unconsumed; otherwise QueueConflict. With `keep_other_type` (an
        agent registering), a busy queue whose only difference is its type (classic or
        quorum: a migration in progress) is kept as it is (KEPT): it delivers as well,
        and it is converted once it is empty and unconsumed.

        `known`: the caller has a row saying the queue was declared, so it is most
        likely there and right. It is read first and left alone when it is (one call
        instead of a declare and a read-back, which would change nothing); anything
        else, missing or different, takes the declare path below.
        """
        if known:
            info = await self.management.get_queue(vhost, name)
            if info is not None and not self.differences(info):
                return QueueOutcome.VERIFIED
        try:
            created = await self._put_queue(vhost, name)
        except ManagementBadRequest as exc:
            if not exc.inequivalent:
                raise
            return await self._repair_or_keep(vhost, name, exc.reason, keep_other_type)
        if created:
            # 201: the broker found no queue of that name and made it from our body, so it
            # holds exactly our arguments. contract §3's read-back is for the 204, where the broker
            # may have kept an older queue and ignored what we sent.
            return QueueOutcome.CREATED
        differences = await self.queue_differences(vhost, name)
        if differences:
            return await self._repair_or_keep(vhost, name, "; ".join(differences), keep_other_type)
        return QueueOutcome.EXISTING

    async def _repair_or_keep(
        self, vhost: str, name: str, reason: str, keep_other_type: bool
    ) -> QueueOutcome:
        try:
            return await self._repair(vhost, name, reason)
        except QueueConflict:
            if not keep_other_type:
                raise
            info = await self.management.get_queue(vhost, name)
            # Kept only when it is exactly our queue as the other type declares it.
            if info is None or _differences(self.other_type_arguments, info):
                raise
            log.warning(
                "queue_type_drift_kept",
                vhost=vhost,
                queue=name,
                reason=f"queue type: expected {self.settings.queue_type}, broker has "
                f"{topology.queue_type(info.arguments)}",
                detail="the queue holds messages or has consumers; kept, converted when "
                "empty and unconsumed (reconcile, or the agent's next registration)",
            )
            return QueueOutcome.KEPT

    async def _put_queue(self, vhost: str, name: str) -> bool:
        try:
            return await self.management.put_queue(vhost, name, arguments=self.queue_arguments)
        except ManagementNotFound as exc:
            if not exc.vhost_not_found:
                raise
            await self.ensure_vhost(vhost)
            return await self.management.put_queue(vhost, name, arguments=self.queue_arguments)

    async def queue_differences(self, vhost: str, name: str) -> list[str]:
        info = await self.management.get_queue(vhost, name)
        if info is None:
            # Deleted between our PUT and GET (a concurrent repair): the broker
            # will hold a correct one once that repair finishes.
            return [VANISHED]
        return self.differences(info)

    def differences(self, info: QueueInfo) -> list[str]:
        """How a subscription queue on the broker differs from contract §3; empty when right."""
        return _differences(self.queue_arguments, info)

    def dead_letter_queue_differences(self, info: QueueInfo) -> list[str]:
        return _differences(self.dlq_arguments, info)

    async def _delete_if_idle(self, vhost: str, name: str, refused: str, advice: str = "") -> None:
        """Delete a queue only if the broker confirms, atomically, that it is empty and
        unconsumed; otherwise QueueConflict: `refused`, the broker's reason, `advice`."""
        try:
            await self.management.delete_queue(vhost, name, if_empty=True, if_unused=True)
        except ManagementBadRequest as exc:
            raise QueueConflict(vhost, name, f"{refused}: {exc.reason}{advice}") from exc

    async def _repair(self, vhost: str, name: str, reason: str) -> QueueOutcome:
        await self._delete_if_idle(
            vhost,
            name,
            f"queue {name!r} in vhost {vhost!r} exists with other arguments ({reason}) "
            "and cannot be re-created safely",
        )
        # An identical call repairing the same queue at the same moment may delete the
        # empty queue we just declared (its if-empty delete succeeds): declare again.
        for _ in range(3):
            await self._put_queue(vhost, name)
            differences = await self.queue_differences(vhost, name)
            if differences != [VANISHED]:
                break
        if differences:
            raise QueueConflict(vhost, name, "; ".join(differences))
        log.warning(
            "queue_repaired",
            vhost=vhost,
            queue=name,
            reason=reason,
            detail="queue existed with other arguments while empty and unconsumed; re-created",
        )
        return QueueOutcome.REPAIRED

    async def delete_queue(self, vhost: str, name: str) -> bool:
        return await self.management.delete_queue(vhost, name)


def _differences(expected_arguments: dict[str, Any], info: QueueInfo) -> list[str]:
    found = topology.argument_differences(expected_arguments, info.arguments)
    if info.durable is not True:
        found.append("durable: expected True")
    if info.auto_delete is not False:
        found.append("auto_delete: expected False")
    return found


async def best_effort(action: str, coro: Any, **context: Any) -> bool:
    """Run a broker clean-up step; log a failure instead of raising it.

    Deletions in the database must not wait on the broker (contract §7): whatever is
    left on the broker is removed by the next reconcile.
    """
    try:
        await coro
    except (BrokerUnavailable, ManagementNotFound, ManagementBadRequest) as exc:
        log.warning("broker_cleanup_failed", action=action, error=str(exc), **context)
        return False
    except Exception as exc:  # a clean-up step never turns a deletion into a 500
        log.error("broker_cleanup_failed", action=action, error=repr(exc), **context)
        return False
    return True
