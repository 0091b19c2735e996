"""Bulk import of the directory from a file: what the backend would PUT, item by item.

The same service calls as the internal API, so the result is the same as if the backend
had pushed each item, and running it twice changes nothing the second time. It adds
and updates; it never deletes what the file leaves out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queuekeeper.broker.management import ManagementError
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.directory import service
from queuekeeper.directory.schemas import DirectoryFile, OfferingPut, UserPut
from queuekeeper.exceptions import DomainError

log = structlog.get_logger(__name__)


@dataclass
class ImportReport:
    created: Counter[str] = field(default_factory=Counter)
    updated: Counter[str] = field(default_factory=Counter)
    failures: list[tuple[str, str]] = field(default_factory=list)

    def count(self, kind: str, created: bool) -> None:
        (self.created if created else self.updated)[kind] += 1

    def summary(self) -> str:
        parts = [
            f"{kind}: {self.created[kind]} created, {self.updated[kind]} updated"
            for kind in ("offerings", "users", "grants")
        ]
        return "; ".join(parts) + f"; {len(self.failures)} failed"


async def _item(
    session: AsyncSession,
    report: ImportReport,
    label: str,
    kind: str,
    action: Awaitable[tuple[object, bool]],
) -> None:
    """Runs one item; a refusal (bad item, broker down) is recorded and the import goes on."""
    try:
        _, created = await action
    except (DomainError, ManagementError) as exc:
        await session.rollback()
        reason = getattr(exc, "detail", None) or str(exc)
        report.failures.append((label, reason))
        log.warning("import_item_failed", item=label, reason=reason)
        return
    report.count(kind, created)


async def import_directory(
    sessions: async_sessionmaker[AsyncSession],
    provisioner: Provisioner,
    data: DirectoryFile,
    advance: Callable[[], None] = lambda: None,
) -> ImportReport:
    """Offerings, then users, then grants (a grant needs both)."""
    report = ImportReport()
    async with sessions() as session:
        for offering in data.offerings:
            body = OfferingPut.model_validate(offering.model_dump(exclude={"uuid"}))
            await _item(
                session,
                report,
                f"offering {offering.uuid.hex}",
                "offerings",
                service.put_offering(session, offering.uuid, body),
            )
            advance()
        for user in data.users:
            # Only the fields the file sets: left-out fields keep their stored value.
            body_user = UserPut.model_validate(
                user.model_dump(exclude={"uuid"}, exclude_unset=True)
            )
            await _item(
                session,
                report,
                f"user {user.uuid.hex}",
                "users",
                service.put_user(session, provisioner, user.uuid, body_user),
            )
            advance()
        for grant in data.grants:
            await _item(
                session,
                report,
                f"grant {grant.user_uuid.hex} → {grant.offering_uuid.hex}",
                "grants",
                service.grant_access(session, grant.user_uuid, grant.offering_uuid),
            )
            advance()
    log.info("directory_imported", summary=report.summary())
    return report
