"""Which copies park: the relay asks the gate before publishing (docs/decisions/015-parking.md).

Each process keeps a view of the queues without a consumer (and since when) and of the
queues still holding a parked backlog, read in one statement every `park_check_interval`
(and before a decision when the view is older than two intervals). A copy parks when its
queue holds a backlog, or when it was accepted `park_after_seconds` or more after its
queue's last consumer left: a rule on the copy itself, so relays in other processes, whose
views differ by up to an interval, decide the same for it. Where the views can still
disagree (a backlog that has just drained here may look undrained in another process's
older view, which would park an older copy while this one published a newer), a queue
that had a backlog in a recent view is asked about once more, by one statement for the
batch. Otherwise the relay's question is a set lookup per copy: parking adds no statement
to the single-event path unless a copy parks or a backlog just drained.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper.config import Settings
from queuekeeper.events.outbox import Claimed, Outbox
from queuekeeper.models import utcnow
from queuekeeper.observability.metrics import COPIES_PARKED
from queuekeeper.parking import repository
from queuekeeper.parking.repository import Queue

log = structlog.get_logger(__name__)

# A backlog seen in a view this many check intervals ago is asked about again before a copy
# of its queue is published (another process may still act on a view that old).
RECENT_VIEWS = 4


class ParkingGate:
    def __init__(self, settings: Settings, engine: AsyncEngine) -> None:
        self.settings = settings
        # Single statements: autocommit, as the relay's own.
        self.engine = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.outbox = Outbox(engine, settings)  # parks the copies (the outbox writes them)
        self.away: dict[Queue, datetime] = {}
        self.held: frozenset[Queue] = frozenset()  # queues with a backlog, in the last view
        self._recent: dict[Queue, float] = {}  # queue -> when a view last saw its backlog
        self._read_at: float | None = None
        self._lock = asyncio.Lock()

    async def refresh(self) -> frozenset[Queue]:
        async with self._lock:
            return await self._refresh()

    async def _refresh(self) -> frozenset[Queue]:
        async with self.engine.connect() as connection:
            view = await repository.park_view(connection)
        now = time.monotonic()
        self.away, self.held, self._read_at = view.away, view.backlog, now
        for queue in view.backlog:
            self._recent[queue] = now
        # Long enough to cover another process's view that is older than ours.
        keep = RECENT_VIEWS * self.settings.park_check_interval
        for queue, seen in list(self._recent.items()):
            if now - seen > keep:
                del self._recent[queue]
        return self.held

    def _stale(self) -> bool:
        return (
            self._read_at is None
            or time.monotonic() - self._read_at > 2 * self.settings.park_check_interval
        )

    async def hold_back(self, relay_id: str, claimed: list[Claimed]) -> list[Claimed]:
        """Park the copies that must wait (they are `relay_id`'s, claimed or handed over);
        returns the others, to publish. A copy whose queue row is gone is never parked: the
        relay gives it up.

        Decisions and refreshes take turns (one lock): two batches of this process in
        flight together never see different views, so a newer copy is never published
        while an older one of its queue is being parked."""
        async with self._lock:
            if self._stale():  # a fresh process must not publish past a parked backlog
                await self._refresh()
            if not (self.held or self.away or self._recent):
                return claimed
            after = timedelta(seconds=self.settings.park_after_seconds)
            parked: list[Claimed] = []
            ask: dict[Queue, list[Claimed]] = {}
            for item in claimed:
                if item.queue_uuid is None and item.consumer_uuid is None:
                    continue
                queue = (item.vhost, item.queue_name)
                away_since = self.away.get(queue)
                if queue in self.held or (
                    away_since is not None and item.created >= away_since + after
                ):
                    parked.append(item)
                elif queue in self._recent:
                    ask.setdefault(queue, []).append(item)
            if ask:
                async with self.engine.connect() as connection:
                    for queue in await repository.backlogged(connection, ask):
                        parked.extend(ask[queue])
            if not parked:
                return claimed
            await self.outbox.park(relay_id, [item.id for item in parked], utcnow())
        COPIES_PARKED.inc(len(parked))
        ids = {item.id for item in parked}
        return [item for item in claimed if item.id not in ids]
