"""Which copies park: the relay asks the gate before publishing (docs/decisions/015-parking.md).

Each replica keeps a snapshot of the queues whose new copies park (away longer than
`park_after_seconds`, or still holding a parked backlog), read in one statement every
`park_check_interval`. The relay's question is then a set lookup per copy: parking adds
no statement to the single-event path unless a copy does park.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper.config import Settings
from queuekeeper.events.outbox import Claimed, Outbox
from queuekeeper.models import utcnow
from queuekeeper.observability.metrics import COPIES_PARKED
from queuekeeper.parking import repository
from queuekeeper.parking.repository import Queue

log = structlog.get_logger(__name__)


class ParkingGate:
    def __init__(self, settings: Settings, engine: AsyncEngine) -> None:
        self.settings = settings
        # Single statements: autocommit, as the relay's own.
        self.engine = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.outbox = Outbox(engine, settings)  # parks the copies (the outbox writes them)
        self.held: frozenset[Queue] = frozenset()
        self._read = False
        self._lock = asyncio.Lock()

    async def refresh(self) -> frozenset[Queue]:
        async with self._lock:
            return await self._refresh()

    async def _refresh(self) -> frozenset[Queue]:
        away_before = utcnow() - timedelta(seconds=self.settings.park_after_seconds)
        async with self.engine.connect() as connection:
            self.held = frozenset(await repository.held_queues(connection, away_before))
        self._read = True
        return self.held

    async def hold_back(self, relay_id: str, claimed: list[Claimed]) -> list[Claimed]:
        """Park the copies of held queues (they are `relay_id`'s, claimed or handed over);
        returns the others, to publish. A copy whose queue row is gone is never parked: the
        relay gives it up.

        Decisions and refreshes take turns (one lock): two batches of this process in
        flight together never see different snapshots, so a newer copy is never published
        while an older one of its queue is being parked."""
        async with self._lock:
            if not self._read:  # a fresh process must not publish past a parked backlog
                await self._refresh()
            held = self.held
            if not held:
                return claimed
            parked = [
                item
                for item in claimed
                if (item.vhost, item.queue_name) in held
                and (item.queue_uuid is not None or item.consumer_uuid is not None)
            ]
            if not parked:
                return claimed
            await self.outbox.park(relay_id, [item.id for item in parked], utcnow())
        COPIES_PARKED.inc(len(parked))
        ids = {item.id for item in parked}
        return [item for item in claimed if item.id not in ids]
