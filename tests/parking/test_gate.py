"""The gate's decision is the same in every process (contract §11: per-queue order holds with
several relays): a copy parks by its own acceptance time, and a backlog one process has seen
drain is asked about again while another process may still park behind it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper import db
from queuekeeper.config import Settings
from queuekeeper.events.outbox import Claimed, Outbox
from queuekeeper.events.repository import DELIVERIES
from queuekeeper.models import QueuePresence
from queuekeeper.parking.gate import ParkingGate
from tests.test_db import _copy_of, _event

T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.fixture
async def engine(settings: Settings, clean_state: None) -> AsyncIterator[AsyncEngine]:
    engine = db.create_engine(settings)
    yield engine
    await engine.dispose()


@pytest.fixture
def slow_views(settings: Settings) -> Settings:
    # Views change only when a test refreshes them.
    return settings.model_copy(update={"park_check_interval": 600, "park_after_seconds": 300})


async def _presence(engine: AsyncEngine, away_since: datetime | None) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            insert(QueuePresence).values(
                vhost="v",
                queue_name="q",
                consumers=0 if away_since else 1,
                away_since=away_since,
                changed=T0,
            )
        )


async def _copies(outbox: Outbox, created: list[datetime]) -> list[Claimed]:
    """Copies of queue v/q accepted at `created`, claimed by relay-a (as registered copies)."""
    async with outbox.store_unit() as unit:
        names = [f"e{n}" for n in range(len(created))]
        await unit.insert(
            [_event(name) for name in names],
            [{**_copy_of(name), "created": at} for name, at in zip(names, created, strict=True)],
        )
    claimed, _ = await outbox.claim("relay-a", T0 + timedelta(days=1), 10)
    return [replace(item, queue_uuid=uuid.uuid4()) for item in claimed]


async def _states(engine: AsyncEngine) -> list[str]:
    async with engine.connect() as connection:
        rows = await connection.execute(select(DELIVERIES.c.state).order_by(DELIVERIES.c.id))
        return [str(state) for (state,) in rows]


async def test_a_copy_parks_by_its_acceptance_time_not_by_the_age_of_the_view(
    engine: AsyncEngine, slow_views: Settings
) -> None:
    await _presence(engine, away_since=T0)
    outbox = Outbox(engine, slow_views)
    before, after = await _copies(
        outbox, [T0 + timedelta(seconds=299), T0 + timedelta(seconds=300)]
    )
    gate = ParkingGate(slow_views, engine)
    await gate.refresh()
    # Accepted before the queue was away for park_after: published; from then on: parked.
    assert await gate.hold_back("relay-a", [before, after]) == [before]
    assert await _states(engine) == ["pending", "parked"]


async def test_a_backlog_drained_in_one_view_is_asked_about_before_publishing(
    engine: AsyncEngine, slow_views: Settings
) -> None:
    await _presence(engine, away_since=None)
    outbox = Outbox(engine, slow_views)
    first, older, newer = await _copies(outbox, [T0, T0, T0])
    await outbox.park("relay-a", [first.id], T0)  # a backlog, seen by both processes
    a, b = ParkingGate(slow_views, engine), ParkingGate(slow_views, engine)
    await a.refresh()
    await b.refresh()
    released, _, _ = await outbox.unpark("relay-a", "v", "q", 10, T0)
    await outbox.publish([item.id for item in released], T0)  # the backlog is out
    await b.refresh()  # b sees it drained; a still acts on its older view
    assert await a.hold_back("relay-a", [older]) == []  # parked behind a backlog it still sees
    # b must not publish the newer copy ahead of the older one a has just parked.
    assert await b.hold_back("relay-a", [newer]) == []
    assert await _states(engine) == ["published", "parked", "parked"]
