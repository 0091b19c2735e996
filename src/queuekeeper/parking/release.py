"""Release on return: a queue with parked copies and a consumer again gets, first, its own
dead letters back, then its parked copies in acceptance order, a bounded number at a time.

Every replica looks every `park_check_interval` (one statement); one replica at a time
releases a queue (a lock per queue: common/locks.py). Each step is a committed state
change that any replica can take up again, so a replica that dies between two steps loses
nothing (docs/architecture.md, "States of a copy"):

- the dead letters are redriven by the redrive job's own rules (a copy is acknowledged only
  once its redriven copy is confirmed);
- a batch of parked copies moves to pending claimed by this replica's relay, and is
  published by it; a replica that dies leaves them due when the lease ends, and the relay
  that takes them parks them again behind the queue's backlog (their `parked_at` keeps
  the queue held), to be released again in order.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from functools import partial

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper.broker.publisher import AmqpPublisher
from queuekeeper.common.locks import job_lock
from queuekeeper.config import Settings
from queuekeeper.deadletters.service import redrive
from queuekeeper.events.relay import Relay
from queuekeeper.jobs.runs import Job, JobRunner, RunStatus, Trigger
from queuekeeper.observability.metrics import COPIES_RELEASED
from queuekeeper.parking import repository
from queuekeeper.parking.gate import ParkingGate
from queuekeeper.parking.repository import Queue

log = structlog.get_logger(__name__)

RELEASE_BATCH = 500  # parked copies moved back to pending at once (at most)
# Queues one process releases at once: each release holds a connection of the relay's pool
# for its whole length (its per-queue lock), beside the relay's own (app.py sizes the pool).
MAX_RELEASES = 2
FULL_PAUSE = 0.2  # seconds to wait while the queue holds its bound of ready messages
STOP_GRACE = 2.0  # seconds a stopping releaser lets a step in flight finish


def release_lock(vhost: str, queue: str) -> str:
    return f"release:{vhost}/{queue}"


class Releaser:
    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine,
        relay: Relay,
        publisher: AmqpPublisher,
        gate: ParkingGate,
        jobs: JobRunner | None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.reader = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.relay = relay
        self.publisher = publisher
        self.gate = gate
        self.jobs = jobs
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._releasing: dict[Queue, asyncio.Task[int]] = {}

    def start(self) -> None:
        self._stopping.clear()
        self._task = asyncio.create_task(self._loop(), name="parking-releaser")

    async def stop(self) -> None:
        self._stopping.set()
        tasks = [task for task in (self._task, *self._releasing.values()) if task is not None]
        if tasks:
            # Each checks `_stopping` between steps: let a statement in flight finish
            # rather than cancel it half-way.
            _done, pending = await asyncio.wait(tasks, timeout=STOP_GRACE)
            tasks = list(pending)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._releasing.clear()

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.tick()
            except Exception as exc:  # the database is down: the next tick tries again
                log.warning("parking_check_failed", error=repr(exc)[:500])
            with suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.settings.park_check_interval)

    async def tick(self) -> list[Queue]:
        """Refresh the gate and start a release for each returned queue not already being
        released here; returns the queues started."""
        await self.gate.refresh()
        async with self.reader.connect() as connection:
            returned = await repository.returned_queues(connection)
        started = []
        for queue in returned:
            if queue in self._releasing:
                continue
            if len(self._releasing) >= MAX_RELEASES:
                break  # the rest start as these end (each holds a connection throughout)
            task = asyncio.create_task(self.release(*queue), name=f"release-{queue[1]}")
            self._releasing[queue] = task
            task.add_done_callback(partial(self._finished, queue))
            started.append(queue)
        return started

    def _finished(self, queue: Queue, task: asyncio.Task[int]) -> None:
        self._releasing.pop(queue, None)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("parking_release_failed", vhost=queue[0], queue=queue[1], error=repr(exc))

    async def release(self, vhost: str, queue: str) -> int:
        """Release one queue (when no other replica is); returns how many copies went out."""
        async with job_lock(self.engine, release_lock(vhost, queue)) as mine:
            if not mine:
                return 0
            if not await self._redrive_first(vhost, queue):
                return 0
            return await self._release_parked(vhost, queue)

    async def _redrive_first(self, vhost: str, queue: str) -> bool:
        """The queue's dead letters (those that expired while its agent was away) go back
        before any parked copy; False when that could not happen now (tried again soon)."""
        if self.jobs is None:
            return True
        record = await self.jobs.run(
            Job.REDRIVE, Trigger.RELEASE, body=partial(redrive, only=vhost, queue=queue)
        )
        held_elsewhere = (record.found or {}).get("held_elsewhere")
        if held_elsewhere:
            # Dead letters another reader held were not seen: sending parked copies now
            # would put them ahead of those; the next tick tries again.
            log.info("parking_redrive_deferred", vhost=vhost, queue=queue, held=held_elsewhere)
            return False
        if record.status in (RunStatus.SUCCEEDED.value, RunStatus.PARTIAL.value):
            async with self.reader.connect() as connection:
                await repository.redriven(connection, vhost, queue)
            return True
        log.info("parking_redrive_deferred", vhost=vhost, queue=queue, status=record.status)
        return False

    async def _release_parked(self, vhost: str, queue: str) -> int:
        bound = self.settings.park_release_max_in_flight
        sent = 0
        while not self._stopping.is_set():
            async with self.reader.connect() as connection:
                if not await repository.is_present(connection, vhost, queue):
                    log.info("parking_release_paused", vhost=vhost, queue=queue, released=sent)
                    return sent  # away again: what is left stays parked
                if await repository.in_flight(connection, vhost, queue):
                    # Older copies are out of our hands (a retry, or a dead replica's lease):
                    # the relay parks them again when they fall due, and a later pass
                    # releases them first. Going on now would overtake them.
                    return sent
            ready = await self.publisher.queue_ready(vhost, queue)
            if ready is None:  # gone or unreadable: the next tick tries again
                return sent
            room = bound - ready
            if room <= 0:
                await asyncio.sleep(FULL_PAUSE)
                continue
            # Claimed for this replica's relay under the outbox's lease rule, as its claims.
            batch, refused = await self.relay.unpark(vhost, queue, min(room, RELEASE_BATCH))
            if not batch:
                if refused:
                    continue  # a batch the owner may no longer receive: given up, go on
                break
            await self.relay.process(batch, park=False)
            sent += len(batch)
            COPIES_RELEASED.inc(len(batch))
        if sent:
            log.info("parked_copies_released", vhost=vhost, queue=queue, released=sent)
        return sent
