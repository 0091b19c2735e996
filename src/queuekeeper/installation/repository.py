"""Queries for the installation identity and the rows broker objects are checked against."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.models import Installation, User

# The table holds one row; its key is always this.
ROW = 1


async def get(session: AsyncSession) -> uuid.UUID | None:
    found: uuid.UUID | None = await session.scalar(
        select(Installation.uuid).where(Installation.id == ROW)
    )
    return found


async def create_if_absent(session: AsyncSession, identity: uuid.UUID) -> None:
    """Insert the row unless another process did first (then its identity stands)."""
    values = {"id": ROW, "uuid": identity}
    await session.execute(insert(Installation).values(values).on_conflict_do_nothing())


async def known_users(session: AsyncSession, names: Iterable[uuid.UUID]) -> set[uuid.UUID]:
    """Which of these uuids are users of this database (each vhost is named by one)."""
    wanted = list(names)
    found: set[uuid.UUID] = set()
    for start in range(0, len(wanted), 1000):
        rows = await session.scalars(
            select(User.uuid).where(User.uuid.in_(wanted[start : start + 1000]))
        )
        found.update(rows)
    return found
