"""The installation identity, and a survey of what the broker holds under our instance name
that this database does not know (docs/decisions/001-installation-identity.md)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import structlog
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queuekeeper.broker import topology
from queuekeeper.broker.management import UserInfo, VhostInfo
from queuekeeper.broker.provisioner import Ownership, Provisioner
from queuekeeper.installation import repository
from queuekeeper.reconcile.repository import existing_subscription_users, subscribed_vhosts

log = structlog.get_logger(__name__)

# Names kept per kind in a survey (the log and /readyz show these; the counts are exact).
EXAMPLES = 5


async def identity(sessions: async_sessionmaker[AsyncSession]) -> uuid.UUID:
    """This database's installation uuid; made now if `migrate` did not (a database made
    from the models)."""
    async with sessions() as session:
        found = await repository.get(session)
        if found is None:
            await repository.create_if_absent(session, uuid.uuid4())
            await session.commit()
            found = await repository.get(session)
    if found is None:  # pragma: no cover - the row was inserted or another process's won
        raise RuntimeError("the installation row could not be read back")
    return found


@dataclass
class Survey:
    """Objects tagged with our instance name that are not this database's."""

    # Tagged with another installation's identity.
    other_installation: list[str] = field(default_factory=list)
    # Ours or made before identities, but no row of this database names them.
    unknown: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    taken: float = field(default_factory=time.monotonic)

    def add(self, kind: str, name: str, *, other: bool = False) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        target = self.other_installation if other else self.unknown
        if len(target) < EXAMPLES:
            target.append(name)

    def detail(self, instance_name: str) -> str | None:
        """One sentence for /readyz and the start-up warning; None when all is known."""
        if not self.counts:
            return None
        what = ", ".join(f"{count} {kind.replace('_', ' ')}" for kind, count in self.counts.items())
        return (
            f"the broker holds objects named for instance {instance_name!r} that this database "
            f"does not know ({what}): another installation uses the same "
            "QUEUEKEEPER_INSTANCE_NAME, or this database was restored from an older backup. "
            "They are never touched; run `queuekeeper reconcile --dry-run` before anything "
            "deletes (docs/howto/backup-and-restore.md, One instance name per installation)."
        )


async def adopt_unclaimed_vhosts(
    provisioner: Provisioner, sessions: async_sessionmaker[AsyncSession]
) -> list[str]:
    """At start-up: vhosts made before installation identities whose owner has subscriptions
    or consumers in this database become ours (the upgrade path; reconcile does the same, and
    adopts broker users, whose passwords it checks against the owners' rows). Returns them."""
    await provisioner.identify()
    unclaimed = [
        info
        for info in await provisioner.management.list_vhosts()
        if provisioner.ownership(info) is Ownership.UNCLAIMED
    ]
    if not unclaimed:
        return []
    async with sessions() as session:
        expected = await subscribed_vhosts(session)
    adopted = []
    for info in unclaimed:
        if info.name in expected:
            await provisioner.adopt_vhost(info)
            adopted.append(info.name)
    return adopted


async def survey(provisioner: Provisioner, sessions: async_sessionmaker[AsyncSession]) -> Survey:
    """Two broker calls (every vhost, every user) and a few queries."""
    await provisioner.identify()
    management = provisioner.management
    found = Survey()
    candidates: dict[str, list[str]] = {"vhosts": [], "broker users": []}
    listed: list[tuple[str, list[VhostInfo] | list[UserInfo]]] = [
        ("vhosts", await management.list_vhosts()),
        ("broker users", await management.list_users()),
    ]
    for kind, infos in listed:
        for info in infos:
            ownership = provisioner.ownership(info)
            if ownership is Ownership.OTHER_INSTALLATION:
                found.add(f"{kind} of another installation", info.name, other=True)
            elif ownership is not Ownership.NOT_OURS:
                candidates[kind].append(info.name)
    vhosts, users = candidates["vhosts"], candidates["broker users"]
    async with sessions() as session:
        owners = [owner for owner in map(topology.uuid_of, vhosts) if owner is not None]
        known_owners = {owner.hex for owner in await repository.known_users(session, owners)}
        known_users = await existing_subscription_users(session, list(users))
    for name in sorted(set(vhosts) - known_owners):
        found.add("vhosts without a user here", name)
    for name in sorted(set(users) - known_users):
        found.add("broker users without a subscription here", name)
    return found
