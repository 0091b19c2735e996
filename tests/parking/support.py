"""Helpers for the parking tests: presence rows as the presence job writes them, and the
state of a queue's copies."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import datetime, timedelta

from sqlalchemy import delete, func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queuekeeper.models import Delivery, QueuePresence, utcnow


async def set_presence(
    sessions: async_sessionmaker[AsyncSession],
    vhost: str,
    queue: str,
    *,
    consumers: int,
    away_for: float | None = None,
) -> None:
    """The queue's presence row: `consumers` now, and away since `away_for` seconds ago
    (None while a consumer is attached)."""
    now = utcnow()
    away_since: datetime | None = None
    if consumers == 0:
        away_since = now - timedelta(seconds=away_for or 0)
    async with sessions() as session:
        await session.execute(
            delete(QueuePresence).where(
                QueuePresence.vhost == vhost, QueuePresence.queue_name == queue
            )
        )
        await session.execute(
            insert(QueuePresence).values(
                vhost=vhost,
                queue_name=queue,
                consumers=consumers,
                away_since=away_since,
                changed=now,
                checked=now,
            )
        )
        await session.commit()


async def copy_states(sessions: async_sessionmaker[AsyncSession], queue: str) -> Counter[str]:
    async with sessions() as session:
        rows = await session.execute(
            select(Delivery.state, func.count())
            .where(Delivery.queue_name == queue)
            .group_by(Delivery.state)
        )
        return Counter({str(state.value if state else state): n for state, n in rows})


async def wait_for_states(
    sessions: async_sessionmaker[AsyncSession],
    queue: str,
    expected: dict[str, int],
    timeout: float = 15.0,
) -> Counter[str]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        states = await copy_states(sessions, queue)
        if states == Counter(expected):
            return states
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"copies of {queue}: {dict(states)}, expected {expected}")
        await asyncio.sleep(0.05)
