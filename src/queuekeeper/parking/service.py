"""Replay (contract §11): every event accepted in a window that a queue received, or would
have received (parked, given up, rejected: whatever became of its copy), and that the
queue's owner may receive now, is written to the outbox again for that queue, marked as a
replay.

The replayed copies are ordinary outbox copies: published by the relay with their original
`message_id`, in acceptance order (the order of their first copies), parked like any other
while the queue's agent is away, and lost by nothing that loses no other copy. They fall
due `replay_copies_per_second` apart, all replays together, so live copies never wait
behind a replay; one replay of a queue at a time, and at most `replay_max_copies` copies
(docs/decisions/021-authorized-when-published.md).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from queuekeeper.config import Settings
from queuekeeper.consumers.service import get_consumer
from queuekeeper.events.outbox import Outbox
from queuekeeper.events.recipients import Copy
from queuekeeper.exceptions import BadRequest, Conflict, NotFound
from queuekeeper.models import User, utcnow
from queuekeeper.observability.metrics import REPLAYS
from queuekeeper.parking import repository
from queuekeeper.parking.schemas import ReplayAdminWindow, ReplayOut, ReplayWindow


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


def checked_window(
    window: ReplayWindow, settings: Settings, now: datetime
) -> tuple[datetime, datetime]:
    """(since, until), or a BadRequest naming the field at fault."""
    since = _utc(window.since)
    until = _utc(window.until) if window.until is not None else now
    if since > now:
        raise BadRequest(
            f"`since` ({since.isoformat()}) is in the future (now: {now.isoformat()}).",
            field="since",
        )
    if until < since:
        raise BadRequest(
            f"`until` ({until.isoformat()}) is before `since` ({since.isoformat()}).",
            field="until",
        )
    oldest = now - settings.event_retention
    if since < oldest:
        raise BadRequest(
            f"`since` ({since.isoformat()}) is older than retention "
            f"(QUEUEKEEPER_EVENT_RETENTION_DAYS={settings.event_retention_days:g}); the oldest "
            f"time available is {oldest.isoformat()}.",
            field="since",
            extra={"oldest_available": oldest.isoformat()},
        )
    return since, min(until, now)


async def _replay(
    engine: AsyncEngine,
    settings: Settings,
    target: Copy,
    window: ReplayWindow,
    caller: str,
) -> ReplayOut:
    now = utcnow()
    since, until = checked_window(window, settings, now)
    # The outbox writes the copies (one transaction, under the queue's replay lock).
    replayed = await Outbox(engine, settings).add_replays(
        target,
        since,
        until,
        window.object_types or None,
        now,
        settings.replay_max_copies,
        settings.replay_copies_per_second,
    )
    if replayed.in_flight:
        started = replayed.in_flight_since.isoformat() if replayed.in_flight_since else "?"
        raise Conflict(
            f"A replay of queue {target.queue_name!r} (vhost {target.vhost!r}), written at "
            f"{started}, is still being published: {replayed.in_flight} of its copies are not "
            "yet on the queue. One replay of a queue runs at a time: try again when it is "
            "done.",
            extra={"in_flight": replayed.in_flight, "in_flight_since": started},
        )
    if replayed.window > settings.replay_max_copies:
        raise BadRequest(
            f"The window holds {replayed.window} copies for this queue, more than one replay "
            f"may write (QUEUEKEEPER_REPLAY_MAX_COPIES={settings.replay_max_copies}): narrow "
            "it with `until` or `object_types`.",
            field="since",
            extra={"copies": replayed.window, "max_copies": settings.replay_max_copies},
        )
    REPLAYS.labels(caller=caller).inc()
    return ReplayOut(replayed=replayed.added)


async def replay_consumer(
    session: AsyncSession,
    engine: AsyncEngine,
    settings: Settings,
    caller: User | None,
    consumer_uuid: str,
    window: ReplayWindow,
) -> ReplayOut:
    """The owner's (or, for a service token, any) consumer; another user's is NotFound."""
    consumer = await get_consumer(session, caller, consumer_uuid)
    target = Copy(None, consumer.uuid, consumer.queue_name, consumer.vhost)
    return await _replay(engine, settings, target, window, "service" if caller is None else "agent")


async def replay_queue(
    session: AsyncSession, engine: AsyncEngine, settings: Settings, window: ReplayAdminWindow
) -> ReplayOut:
    """Any registered queue, legacy or consumer, by vhost and name."""
    target = await repository.find_queue(session, window.vhost, window.queue_name)
    if target is None:
        raise NotFound(
            f"No registered queue {window.queue_name!r} in vhost {window.vhost!r}.",
            field="queue_name",
        )
    return await _replay(engine, settings, target, window, "admin")
