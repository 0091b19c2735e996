"""Presence: whether each registered queue has a consumer, since when it has none, and why a
queue is silent (contract §11; docs/decisions/014-presence.md).

Two writers keep `queue_presence`, on every replica:

* `PresenceWriter`, fed by the broker's consumer events (broker/presence.py): within
  a second of a consumer arriving or leaving, it asks the queue for its consumer count
  (a passive declare) and writes that count;
* the `presence` job (`check`), every QUEUEKEEPER_PRESENCE_INTERVAL_SECONDS: the
  Management API's listing is compared with the rows, and each queue where they
  disagree (or that has no row yet: first sight) is asked the same way. It repairs a
  missed event, a replica's restart, a listener that was down.

Both write an absolute count stamped with the time it was asked (`record`): whichever
replica asked last wins, in whatever order the writes commit, so any number of replicas
agree. `away_since` is set when the count drops to 0 (to the departure event's time) or
when a queue is first seen without a consumer, kept while it stays at 0, and cleared
when a consumer arrives.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import Collection, Sequence
from datetime import datetime, timedelta

import structlog
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queuekeeper.broker import topology
from queuekeeper.broker.amqp import CONNECT_ERRORS, describe
from queuekeeper.broker.management import ConnectionInfo, ManagementClient, QueueInfo
from queuekeeper.broker.presence import STOP_SECONDS, ConsumerEvent, consumer_counts
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.common.tasks import cancel_within
from queuekeeper.config import Settings
from queuekeeper.consumers import service as consumers
from queuekeeper.jobs.runs import JobContext, Run
from queuekeeper.models import EventConsumer, QueuePresence, User, utcnow
from queuekeeper.observability.metrics import (
    OLDEST_PARKED_AGE,
    PARKED_COPIES,
    QUEUES_LONGEST_AWAY,
    QUEUES_WITHOUT_CONSUMER,
)
from queuekeeper.presence import repository
from queuekeeper.presence.repository import Key, Outbox, Registration
from queuekeeper.presence.schemas import (
    BlockedReason,
    ConnectionOut,
    QueueStatusFields,
    QueueStatusOut,
)
from queuekeeper.webhooks import service as webhooks

log = structlog.get_logger(__name__)

# Events arriving together (an agent with several queues, a broker restart) are handled
# as one batch: one query and one connection per vhost.
GATHER_SECONDS = 0.2
# How long a status call waits for a vhost's first dead-letter census after its own broker
# calls, which the count runs beside (an empty dead-letter queue is counted by then); never
# for a later one, answered from the one before (docs/decisions/023-dead-letter-census.md).
CENSUS_WAIT_SECONDS = 0.025


# --- the event path -----------------------------------------------------------------------
class PresenceWriter:
    """Turns the consumer events of registered queues into presence rows, a batch at a
    time. A failure is logged and left to the `presence` job to repair."""

    def __init__(self, settings: Settings, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.settings = settings
        self.sessions = sessions
        self._pending: dict[Key, ConsumerEvent] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def on_event(self, event: ConsumerEvent) -> None:
        if not topology.is_registered_kind(event.queue):
            return  # the dead-letter queue, our own listener's queue, anything not an agent's
        key = (event.vhost, event.queue)
        known = self._pending.get(key)
        # A departure's time is what `away_since` becomes: keep the latest event per queue.
        if known is None or event.at >= known.at:
            self._pending[key] = event
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="presence-writer")

    async def stop(self) -> None:
        if self._task is not None:
            # Its write asks the broker (`observe`): a stop must not wait on a dead connection.
            await cancel_within(self._task, STOP_SECONDS)
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(GATHER_SECONDS)
            self._wake.clear()
            batch, self._pending = self._pending, {}
            try:
                await self._write(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the periodic check repairs what this missed
                log.warning("presence_events_not_written", queues=len(batch), error=describe(exc))

    async def _write(self, batch: dict[Key, ConsumerEvent]) -> None:
        async with self.sessions() as session:
            wanted = await repository.registered(session, batch.keys())
        by_vhost: dict[str, list[ConsumerEvent]] = defaultdict(list)
        for key in wanted:
            by_vhost[key[0]].append(batch[key])
        for vhost, events in by_vhost.items():
            try:
                await observe(
                    self.settings,
                    self.sessions,
                    vhost,
                    [event.queue for event in events],
                    away_from={event.queue: event.at for event in events if not event.arrived},
                )
            except CONNECT_ERRORS as exc:  # this vhost only (deleted meanwhile, node down)
                log.info("presence_not_asked", vhost=vhost, error=describe(exc))
                continue
            log.info(
                "presence_changed",
                vhost=vhost,
                queues={event.queue: "arrived" if event.arrived else "left" for event in events},
            )


async def observe(
    settings: Settings,
    sessions: async_sessionmaker[AsyncSession],
    vhost: str,
    queues: Sequence[str],
    *,
    away_from: dict[str, datetime] | None = None,
) -> int:
    """Ask these queues of `vhost` for their consumers now and write the answers; a queue
    not on the broker has none. Returns how many rows were written."""
    observed = utcnow()  # before asking: a write is never stamped newer than what it saw
    counts = await consumer_counts(settings, vhost, queues)
    written = 0
    async with sessions.begin() as session:
        for name in queues:
            if await repository.record(
                session,
                vhost,
                name,
                counts.get(name) or 0,
                observed=observed,
                away_from=(away_from or {}).get(name, observed),
            ):
                written += 1
    return written


# --- the periodic check (the `presence` job) ------------------------------------------------
async def check(context: JobContext, run: Run) -> None:
    """Compare every registered queue's presence row with the broker's listing; ask the
    queues where they disagree (or that have no row); forget rows of unregistered queues."""
    settings = context.settings
    async with context.sessions() as session:
        vhosts = sorted(await repository.registered_vhosts(session))
    owned = set(await context.provisioner.owned_vhosts())
    for vhost in vhosts:
        if vhost not in owned:
            continue  # a foreign or missing vhost: nothing of ours to ask there
        async with run.item(vhost):
            async with context.sessions() as session:
                names = await repository.registered_in(session, vhost)
                rows = await repository.presence_in(session, vhost)
            listed = await _listed_consumers(context.management, vhost, settings)
            run.find("queues", len(names))
            suspects = [
                name
                for name in sorted(names)
                if name not in rows or (rows[name].consumers > 0) != (listed.get(name, 0) > 0)
            ]
            if suspects and not run.dry_run:
                before = {name: rows.get(name) for name in suspects}
                await observe(settings, context.sessions, vhost, suspects)
                async with context.sessions() as session:
                    after = await repository.presence_in(session, vhost)
                for name in suspects:
                    now, was = after.get(name), before[name]
                    if now is None:
                        continue
                    if was is None:
                        run.done(
                            "seen", "first_seen", f"{vhost}/{name}", f"{now.consumers} consumers"
                        )
                    elif (was.consumers > 0) != (now.consumers > 0):
                        what = "arrived" if now.consumers else "left"
                        run.done(what, f"consumer_{what}", f"{vhost}/{name}", "missed event")
            async with context.sessions.begin() as session:
                await repository.mark_checked(session, vhost, names, utcnow())
    if not run.dry_run:
        async with context.sessions.begin() as session:
            forgotten = await repository.forget_unregistered(session)
        if forgotten:
            run.done("forgotten", "forget", "queue_presence", f"{forgotten} unregistered queues")
    await refresh_gauges(context.sessions)


async def _listed_consumers(
    management: ManagementClient, vhost: str, settings: Settings
) -> dict[str, int]:
    """The Management API's consumer count of each queue of `vhost` (statistics, seconds
    old: only a hint of where to ask)."""
    counts: dict[str, int] = {}
    page = 1
    while True:
        listing = await management.list_queues_page(
            vhost, page=page, page_size=settings.reconcile_page_size, columns="name,consumers"
        )
        counts.update({info.name: info.consumers or 0 for info in listing.items})
        if page >= listing.page_count:
            return counts
        page += 1


async def refresh_gauges(sessions: async_sessionmaker[AsyncSession]) -> None:
    now = utcnow()
    async with sessions() as session:
        away, longest = await repository.without_consumer(session)
        parked, oldest = await repository.parked_totals(session)
    QUEUES_WITHOUT_CONSUMER.set(away)
    QUEUES_LONGEST_AWAY.set((now - longest).total_seconds() if longest else 0)
    PARKED_COPIES.set(parked)
    OLDEST_PARKED_AGE.set((now - oldest).total_seconds() if oldest else 0)


# --- why a queue is silent ------------------------------------------------------------------
def _when(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M UTC")


def blocked_reason(
    reg: Registration,
    *,
    now: datetime,
    park_after: timedelta,
    info: QueueInfo | None,
    differences: Sequence[str],
    broker_user_present: bool | None,
    consumers: int | None,
    away_since: datetime | None,
    published_types: Collection[str],
) -> tuple[BlockedReason | None, str | None]:
    """The one reason events do not reach this queue's agent, and what to do about it.

    Checked in this order, the first that holds being the answer: what stops queuekeeper
    from sending at all comes first (the owner, its token, then the access), then what stops the
    broker from holding the copies (the queue), then what stops the agent from reading
    them (its login), then what makes its filter exclude every event, and last the agent's
    own absence (its copies are parked, nothing is lost). Fixing a reason reveals the next.
    """
    if not reg.owner_active:
        return BlockedReason.OWNER_INACTIVE, (
            "The queue's owner is inactive in the marketplace, so no events are sent to it: "
            "ask the marketplace's staff to reactivate the user."
        )
    if reg.token_expires_at is not None and reg.token_expires_at <= now:
        return BlockedReason.TOKEN_EXPIRED, (
            f"The owner's API token expired on {_when(reg.token_expires_at)}: no events are "
            "sent and the agent cannot log in to the broker; renew the token in the "
            "marketplace and restart the agent with it."
        )
    if not reg.has_token:
        return BlockedReason.NO_TOKEN, (
            "The marketplace removed the owner's API token: no events are sent and the agent "
            "cannot log in to the broker; push a token for the owner from the marketplace "
            f"(PUT /api/internal/users/{reg.vhost}/ with a token) and restart the agent with it."
        )
    if reg.consumer and not reg.may_receive:
        bound = ", ".join(reg.bindings) or "none"
        return BlockedReason.NO_ACCESS, (
            "The owner may receive nothing through any of the consumer's bindings "
            f"({bound}): it holds no grant or role on what they name, so no events are sent "
            "here: ask for the access again, or register the consumer with scopes the owner "
            "holds."
        )
    if not reg.consumer and not reg.granted:
        offerings = ", ".join(offering.hex for offering in reg.offerings) or "none"
        return BlockedReason.NO_ACCESS, (
            f"The owner has no access to the queue's offering ({offerings}), so its events "
            "are not sent here: ask the offering's provider to grant access."
        )
    if info is None:
        return BlockedReason.QUEUE_MISSING, (
            "The queue is not on the broker, so nothing can be delivered to it: restart the "
            "agent (its registration declares the queue again) or ask an operator to run a "
            "reconcile (POST /api/admin/reconcile/)."
        )
    if differences:
        return BlockedReason.QUEUE_MISCONFIGURED, (
            f"The queue exists with other arguments than queuekeeper's ({'; '.join(differences)}"
            "): copies may be refused or dropped. Empty and without consumer it is repaired by "
            "the next reconcile: stop the agent, let an operator run POST /api/admin/reconcile/, "
            "then start the agent again."
        )
    if broker_user_present is False:
        return BlockedReason.BROKER_USER_MISSING, (
            f"The broker user {reg.broker_user.hex} the agent logs in as does not exist, so "
            "the agent cannot read the queue (copies wait in it): restart the agent (its "
            "registration makes the user again) or ask an operator to run a reconcile."
        )
    if reg.consumer and reg.object_types and published_types:
        matching = set(published_types) & set(reg.object_types)
        if not matching:
            return BlockedReason.FILTER_MATCHES_NOTHING, (
                f"Events of type {', '.join(sorted(published_types))} were published for your "
                f"offerings since {_when(reg.registered_at)}, but this queue's filter holds only "
                f"{', '.join(sorted(reg.object_types))}: register again with object_types "
                "including them (or [] for every type)."
            )
    if not consumers and away_since is not None and now - away_since >= park_after:
        return BlockedReason.AGENT_AWAY, (
            f"No consumer has read this queue since {_when(away_since)}: new events are parked "
            "in the outbox, and arrive in order when your agent subscribes again "
            f"(/amq/queue/{reg.queue_name}, vhost {reg.vhost})."
        )
    return None, None


async def statuses(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    regs: Sequence[Registration],
) -> dict[Key, QueueStatusFields]:
    """Each registration's status. The database is read first and its transaction ended
    before any broker call. What the broker says is what it holds at the moment it is asked,
    never its statistics, which lag their collection interval: the queues' counts and who
    reads them right after an agent (re)connects (docs/decisions/028-status-without-lag.md)."""
    if not regs:
        return {}
    keys = [reg.key for reg in regs]
    presence = await repository.presence_of(session, keys)
    outbox = await repository.outbox_of(session, regs)
    published: dict[Key, set[str]] = {}
    for reg in regs:
        if reg.consumer and reg.object_types and reg.granted:
            published[reg.key] = await repository.types_published_since(
                session, reg.granted, reg.registered_at
            )
    await session.commit()

    management = provisioner.management
    limit = asyncio.Semaphore(8)
    by_vhost: dict[str, list[Registration]] = defaultdict(list)
    for reg in regs:
        by_vhost[reg.vhost].append(reg)
    vhosts = sorted(by_vhost)

    async def queues_now(vhost: str) -> dict[str, QueueInfo]:
        async with limit:
            return await management.queues_now(vhost, [reg.queue_name for reg in by_vhost[vhost]])

    async def readers(vhost: str) -> dict[str, list[ConnectionInfo]]:
        # Only a queue that may have a consumer (or that no check has seen yet) is asked.
        wanted = {
            reg.queue_name: reg.broker_user.hex
            for reg in by_vhost[vhost]
            if (row := presence.get(reg.key)) is None or row.consumers > 0
        }
        if not wanted:
            return {}
        async with limit:
            return await management.queue_connections(vhost, wanted)

    async def user_present(reg: Registration) -> bool:
        async with limit:
            return await management.get_user(reg.broker_user.hex) is not None

    census = provisioner.dead_letters
    for vhost in vhosts:
        census.latest(vhost)  # a count that is due starts now, beside the calls below

    queues, users, connections = await asyncio.gather(
        asyncio.gather(*(queues_now(vhost) for vhost in vhosts)),
        asyncio.gather(*(user_present(reg) for reg in regs)),
        asyncio.gather(*(readers(vhost) for vhost in vhosts)),
    )
    letters = await asyncio.gather(*(census.read(vhost, CENSUS_WAIT_SECONDS) for vhost in vhosts))
    await _first_sight(
        session, settings, [reg for reg in regs if reg.key not in presence], presence
    )
    connected_by_vhost: dict[str, dict[str, list[ConnectionInfo]]] = dict(
        zip(vhosts, connections, strict=True)
    )
    letters_by_vhost = dict(zip(vhosts, letters, strict=True))
    now = utcnow()
    park_after = timedelta(seconds=settings.park_after_seconds)
    found: dict[Key, QueueStatusFields] = {}
    queues_by_vhost = dict(zip(vhosts, queues, strict=True))
    for reg, present in zip(regs, users, strict=True):
        info = queues_by_vhost[reg.vhost].get(reg.queue_name)
        row = presence.get(reg.key)
        consumers = row.consumers if row is not None else None
        away_since = row.away_since if row is not None and not consumers else None
        differences = provisioner.differences(info) if info is not None else []
        reason, detail = blocked_reason(
            reg,
            now=now,
            park_after=park_after,
            info=info,
            differences=differences,
            broker_user_present=present,
            consumers=consumers,
            away_since=away_since,
            published_types=published.get(reg.key, set()),
        )
        waiting = outbox.get(reg.uuid, Outbox())
        counted = letters_by_vhost[reg.vhost]
        found[reg.key] = QueueStatusFields(
            connected=None if consumers is None else consumers > 0,
            consumers=consumers,
            connections=[
                ConnectionOut.from_info(c)
                for c in connected_by_vhost[reg.vhost].get(reg.queue_name, [])
            ]
            if consumers
            else [],
            away_since=away_since,
            ready=info.messages_ready if info else None,
            unacked=info.messages_unacknowledged if info else None,
            parked=waiting.parked,
            oldest_parked_at=waiting.oldest_parked_at,
            dead_letters=None if counted is None else counted.by_queue.get(reg.queue_name, 0),
            dead_letters_counted_at=None if counted is None else counted.counted_at,
            last_delivered_at=waiting.last_delivered_at,
            delivery_blocked_reason=reason,
            delivery_blocked_detail=detail,
        )
    return found


async def _first_sight(
    session: AsyncSession,
    settings: Settings,
    unseen: Sequence[Registration],
    presence: dict[Key, QueuePresence],
) -> None:
    """Queues no check has seen yet (registered since): asked now, recorded as the periodic
    check would (no consumer: away from now on), and added to `presence`."""
    by_vhost: dict[str, list[str]] = defaultdict(list)
    for reg in unseen:
        by_vhost[reg.vhost].append(reg.queue_name)
    for vhost, names in by_vhost.items():
        observed = utcnow()
        try:
            counts = await consumer_counts(settings, vhost, names)
        except CONNECT_ERRORS as exc:
            log.info("presence_not_asked", vhost=vhost, error=describe(exc))
            continue
        for name in names:
            if counts.get(name) is None:
                continue  # not on the broker: the status says queue_missing
            await repository.record(
                session, vhost, name, counts[name] or 0, observed=observed, away_from=observed
            )
    if by_vhost:
        await session.commit()
        presence.update(await repository.presence_of(session, [reg.key for reg in unseen]))
        await session.commit()


async def statuses_of(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    keys: Collection[Key],
) -> dict[Key, QueueStatusFields]:
    """The status of each registered queue among `keys` (the admin queue view's page);
    queues nobody registered are left out."""
    regs = await repository.registrations(session, keys)
    return await statuses(session, provisioner, settings, list(regs.values()))


async def consumer_status(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    caller: User | None,
    consumer_uuid: str,
) -> QueueStatusOut:
    """GET /api/event-consumers/{uuid}/status/: NotFound for another user's consumer."""
    consumer = await consumers.get_consumer(session, caller, consumer_uuid)
    if consumer.delivery == consumers.WEBHOOK:
        return await _webhook_status(session, settings, consumer)
    key = (consumer.vhost, consumer.queue_name)
    found_uuid: uuid.UUID = consumer.uuid
    regs = await repository.registrations(session, [key])
    status = (await statuses(session, provisioner, settings, [regs[key]]))[key]
    return QueueStatusOut(uuid=found_uuid, queue_name=key[1], vhost=key[0], **status.model_dump())


_WEBHOOK_DETAILS = {
    BlockedReason.OWNER_INACTIVE: "The consumer's owner is inactive in the marketplace, so no "
    "events are sent: ask the marketplace's staff to reactivate the user.",
    BlockedReason.NO_TOKEN: "The marketplace removed the owner's API token, so no events are "
    "sent: push a token for the owner from the marketplace.",
    BlockedReason.TOKEN_EXPIRED: "The owner's API token expired, so no events are sent: renew "
    "it in the marketplace.",
    BlockedReason.NO_ACCESS: "The owner may no longer hold any of the consumer's bindings, so "
    "its events are not sent: restore the owner's role or update the consumer's scopes.",
    BlockedReason.WEBHOOK_GONE: "The receiver answered 410 Gone, so nothing more is sent to "
    "it: fix or move the receiver and call update_webhook (with a new webhook_url if it "
    "moved); waiting copies are then delivered in order.",
    BlockedReason.WEBHOOK_FAILING: "The last attempt failed ({error}); copies wait and are "
    "retried (next at {next}), in order: fix the receiver, or update_webhook to point "
    "elsewhere.",
}


async def _webhook_status(
    session: AsyncSession, settings: Settings, consumer: EventConsumer
) -> QueueStatusOut:
    """A webhook consumer's status (contract §13): no broker is asked; what waits for its
    receiver and why it does not arrive, from the database."""
    facts = (await consumers.facts_of(session, settings, [consumer]))[consumer.uuid]
    waiting = await webhooks.webhook_pending(session, consumer.uuid)
    await session.commit()
    reason = BlockedReason(facts.delivery_blocked_reason) if facts.delivery_blocked_reason else None
    detail = None
    if reason is not None:
        when = waiting.next_attempt_at
        detail = (
            _WEBHOOK_DETAILS.get(reason, "").format(
                error=consumer.last_error or "unknown error",
                next=_when(when) if when is not None else "when a copy waits",
            )
            or None
        )
    return QueueStatusOut(
        uuid=consumer.uuid,
        queue_name=consumer.queue_name,
        vhost=consumer.vhost,
        last_delivered_at=consumer.last_delivered_at,
        delivery_blocked_reason=reason,
        delivery_blocked_detail=detail,
        pending=waiting.pending,
        oldest_pending_at=waiting.oldest_pending_at,
        next_attempt_at=waiting.next_attempt_at,
    )
