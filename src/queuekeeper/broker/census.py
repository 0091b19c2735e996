"""The vhost's dead-letter queue as the broker holds it: which queue each dead letter came
from (its `x-death`), and a census of them per vhost that each process keeps
(docs/decisions/023-dead-letter-census.md).

The dead-letter queue is one per vhost and its arguments, like the registered queues'
`x-dead-letter-*`, cannot change without making every existing queue inequivalent; the
broker counts only the whole queue. So the dead letters of each queue are counted by
looking at them: a consumer with a prefetch as large as the queue takes them all
unacknowledged, reads their headers, and closes its channel, which gives every one back
to the queue in its place. A status call never does this itself: it answers from the
latest census, and asks for a new one (in the background, one at a time per vhost) when
that is older than QUEUEKEEPER_DEAD_LETTER_CENSUS_SECONDS.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from aio_pika.exceptions import ChannelNotFoundEntity
from aiormq.abc import DeliveredMessage

from queuekeeper.broker.amqp import (
    CONNECT_ERRORS,
    amqp_nodes,
    amqp_ssl_context,
    connect_vhost,
    describe,
)
from queuekeeper.config import Settings

log = structlog.get_logger(__name__)

# basic.qos's prefetch-count is a 16-bit field: no consumer can hold more unacknowledged.
MAX_PREFETCH = 65_535
# A count ends when this long passes without a delivery: the dead letters still missing are
# held unacknowledged by another reader (a redrive in progress), not on their way.
IDLE_SECONDS = 0.5
# Counts of different vhosts running at once in a process (an admin page spans many vhosts):
# each holds an AMQP connection and its vhost's dead letters while it runs.
CONCURRENT_COUNTS = 4


def deaths(headers: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A message's `x-death` entries, newest first."""
    value = headers.get("x-death")
    if not isinstance(value, list):
        return []
    return [dict(death) for death in value if isinstance(death, dict)]


def origin(headers: Mapping[str, Any], found: list[dict[str, Any]] | None = None) -> str | None:
    """The queue a dead letter last died in; None when its headers do not say."""
    found = deaths(headers) if found is None else found
    # x-death is newest first; its first entry names the queue it last died in.
    for candidate in (found[0].get("queue") if found else None, headers.get("x-first-death-queue")):
        if isinstance(candidate, bytes):
            candidate = candidate.decode("utf-8", "replace")
        if isinstance(candidate, str) and candidate:
            return candidate
    return None


@dataclass(frozen=True)
class Census:
    """How many of a vhost's dead letters came from each queue, as counted at `counted_at`.
    `complete` is False when some were not seen: held by another reader at that moment,
    or beyond the count's bound (`redrive_max_messages`)."""

    by_queue: Mapping[str, int]
    counted_at: datetime
    complete: bool


async def count_dead_letters(settings: Settings, vhost: str) -> Census:
    """Count the vhost's dead letters by their original queue; every one stays in the
    dead-letter queue, in its order (unacknowledged, given back when the channel closes)."""
    counted_at = datetime.now(UTC)  # before looking: the census is never newer than it saw
    connection, _node = await connect_vhost(
        amqp_nodes(settings),
        vhost,
        connect_timeout=settings.amqp_connect_timeout,
        ssl_context=amqp_ssl_context(settings),
    )
    counts: dict[str, int] = {}
    try:
        channel = await connection.channel(publisher_confirms=False)
        try:
            queue = await channel.declare_queue(settings.dlq_name, passive=True)
        except ChannelNotFoundEntity:
            return Census(counts, counted_at, complete=True)
        ready = queue.declaration_result.message_count or 0
        wanted = min(ready, settings.redrive_max_messages, MAX_PREFETCH)
        if not wanted:
            return Census(counts, counted_at, complete=True)
        seen = 0
        all_seen = asyncio.Event()

        async def on_message(message: DeliveredMessage) -> None:
            nonlocal seen
            if seen >= wanted:
                return  # past the bound (a dead letter that arrived meanwhile): not counted
            name = origin(message.header.properties.headers or {}) or ""
            counts[name] = counts.get(name, 0) + 1
            seen += 1
            if seen >= wanted:
                all_seen.set()

        await channel.set_qos(prefetch_count=wanted)
        # aiormq's own consumer: only the headers are read, so no aio-pika message (and
        # no second task) is made per dead letter.
        underlay = await channel.get_underlay_channel()
        await underlay.basic_consume(settings.dlq_name, on_message, no_ack=False)
        while not all_seen.is_set():
            before = seen
            with suppress(TimeoutError):
                await asyncio.wait_for(all_seen.wait(), IDLE_SECONDS)
            if seen == before:
                break  # nothing for a while: the rest is held by another reader
        return Census(dict(counts), counted_at, complete=seen >= ready)
    finally:
        # Closing returns every message taken to the queue, in its place.
        with suppress(*CONNECT_ERRORS):
            await connection.close()


class DeadLetterCensus:
    """Each vhost's latest census, kept by this process; at most one count per vhost runs
    at a time, and a new one starts only when the latest is `interval` old."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._latest: dict[str, Census] = {}
        self._started: dict[str, float] = {}  # the loop's clock when the last count began
        self._running: dict[str, asyncio.Task[None]] = {}
        self._slots: asyncio.Semaphore | None = None

    def latest(self, vhost: str) -> Census | None:
        """The vhost's latest census, at once (None before the first one ends); starts a
        new count when the last began an interval ago and none is running."""
        loop = asyncio.get_running_loop()
        started = self._started.get(vhost)
        due = started is None or loop.time() - started >= self.settings.dead_letter_census_seconds
        if due and vhost not in self._running:
            self._started[vhost] = loop.time()
            self._running[vhost] = loop.create_task(
                self._count(vhost), name=f"dead-letter-census-{vhost}"
            )
        return self._latest.get(vhost)

    async def read(self, vhost: str, wait: float) -> Census | None:
        """`latest`, waiting up to `wait` seconds for a first count of the vhost (one that
        finds an empty dead-letter queue takes a few milliseconds)."""
        found = self.latest(vhost)
        running = self._running.get(vhost)
        if found is None and running is not None and wait > 0:
            # Shielded: a caller that stops waiting does not stop the count the others share.
            with suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(running), wait)
            found = self._latest.get(vhost)
        return found

    async def _count(self, vhost: str) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(CONCURRENT_COUNTS)
        try:
            async with self._slots:
                census = await count_dead_letters(self.settings, vhost)
        except CONNECT_ERRORS as exc:  # vhost gone, node down: the last census stays
            log.info("dead_letters_not_counted", vhost=vhost, error=describe(exc))
        except Exception as exc:  # a census is only a view: never let it take a task down
            log.warning("dead_letters_not_counted", vhost=vhost, error=describe(exc))
        else:
            if not census.complete:
                log.info(
                    "dead_letters_partly_counted",
                    vhost=vhost,
                    counted=sum(census.by_queue.values()),
                )
            self._latest[vhost] = census
        finally:
            self._running.pop(vhost, None)

    async def aclose(self) -> None:
        running = list(self._running.values())
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        self._running.clear()
