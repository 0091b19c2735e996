"""The transactional outbox (the `deliveries` table, and `events`) and its one owner.

Every write of a copy's life goes through here: `Outbox`'s `store` (accepted events and
their copies, in the request's transaction), `claim`, `renew`, the settlements (`publish`,
`published_at`, `reject`, `give_up`, `reschedule`), `release` and `judge_held` (copies held
in memory judged again before they go out, docs/decisions/029-judged-as-it-leaves.md);
parking's (parking/ decides when, the outbox writes): `park`, `unpark` (parked copies back
to pending, claimed as a claim claims), `give_up_parked` and `prune_events` (retention) and
`add_replays` (a replay's new copies); and, in the caller's session and transaction, what a
request decides: `give_up_waiting` (a revocation, a consumer deleted or narrowed) and
`webhook_copies_due_now`. No other module writes a copy's state
(docs/decisions/032-one-owner-of-copy-state.md; tests/events/test_copy_state_owner.py). The
lease rule lives in `Outbox.lease` alone: a copy is held by a relay until its lease ends,
and a held copy is simply not due (`next_attempt_at` is the lease's end), so a relay that
dies leaves its copies due again when its leases run out. Only `state = 'pending'` copies
that are due are ever claimed; any other state (published, rejected, given up, parked) is
never taken, except that `unpark` takes a queue's parked copies back.

The statements themselves are in `outbox_postgres.py` (plain SQL: on asyncpg for `Outbox`,
docs/decisions/008-driver-path.md; through SQLAlchemy for a session's), each written once.
Who gets a copy is decided in `recipients.py`; how requests share a transaction, in
`intake.py`; what the relay does with a claimed copy, in `relay.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from queuekeeper.common.locks import lock_key
from queuekeeper.config import Settings
from queuekeeper.events import outbox_postgres as sql
from queuekeeper.events.outbox_postgres import (
    KeptConnection,
    RecipientCache,
    StoreUnit,
    checked_out,
)
from queuekeeper.events.recipients import Copy, RecipientIndex, Recipients
from queuekeeper.events.schemas import EventAccepted, EventIn
from queuekeeper.exceptions import BadRequest, DomainError
from queuekeeper.models import DeliveryState, utcnow
from queuekeeper.observability.metrics import (
    COPIES,
    COPIES_REFUSED,
    EVENTS_ACCEPTED,
    EVENTS_DUPLICATE,
    SKIPPED_UNREGISTERED,
)

log = structlog.get_logger(__name__)
_DEBUG = logging.getLogger(__name__)

# PostgreSQL NOTIFY channel on which a trigger of `deliveries` (migrations 0006, 0015)
# announces queue copies committed unclaimed: a relay anywhere may take them now. Relays
# poll as well, so a lost notification delays a copy by at most the poll interval and
# loses nothing.
DUE_CHANNEL = "queuekeeper_outbox_due"
# The same for webhook copies (migration 0015), which only the webhook dispatcher takes.
WEBHOOKS_DUE_CHANNEL = "queuekeeper_webhooks_due"

# Why a copy is parked, or was given up while parked (its `last_error`, listed with the
# event's copies).
PARKED_REASON = (
    "parked: its queue has had no consumer for longer than park_after_seconds; published, "
    "in acceptance order, when one returns"
)
RETENTION_REASON = "retention: parked longer than event_retention_days; not published"
# Bound once: a child's lookup per store costs more than its increment.
_QUEUED_CONSUMER = COPIES.labels(kind="consumer", stage="queued")
_QUEUED_LEGACY = COPIES.labels(kind="legacy", stage="queued")


@dataclass(frozen=True)
class Claimed:
    id: int
    event_id: str
    queue_uuid: uuid.UUID | None
    consumer_uuid: uuid.UUID | None  # a consumer's copy (contract §9) has this instead
    queue_name: str
    vhost: str
    attempts: int
    created: datetime
    last_error: str | None
    copy_offering_uuid: uuid.UUID | None  # a fan-out's copy: its queue's offering
    offering_uuid: uuid.UUID | None  # the event's (first) offering; none: an identity event
    object_type: str
    accepted: datetime
    body: str  # the stored payload JSON, sent as it is
    replay: bool = False  # a replay's copy (contract §11): marked with a header
    # The access epoch it was last judged under, and a time no later than that judgment:
    # what a holder proves unchanged before publishing it without judging it again
    # (`Access.unchanged_since`; docs/decisions/029-judged-as-it-leaves.md).
    judged_epoch: int | None = None
    judged_at: datetime | None = None


@dataclass(frozen=True)
class Access:
    """The access epoch now and the latest role or token expiry passed by now (None: none)."""

    epoch: int
    expired: datetime | None

    def unchanged_since(self, item: Claimed) -> bool:
        """Whether nothing the rule reads has changed since `item` was judged: the epoch is
        the one it was judged under (every UPDATE or DELETE that can change a verdict bumps
        it, in its own transaction), and no expiry passed since (time ends access with no
        write). Otherwise its judgment proves nothing now."""
        return (
            item.judged_epoch is not None
            and item.judged_at is not None
            and item.judged_epoch == self.epoch
            and (self.expired is None or self.expired <= item.judged_at)
        )


class SharedAccess:
    """`Outbox.access` read once for every holder that asks while the read has not been
    sent yet: each caller gets the answer of a statement sent after it asked, so read after
    its copies' wait (docs/decisions/029-judged-as-it-leaves.md), and at most one read is in
    flight. Holders that finish a wait together (batches, webhook runs of several
    consumers) share one round trip instead of one each."""

    def __init__(
        self, outbox: Outbox, read: Callable[[datetime], Awaitable[Access]] | None = None
    ) -> None:
        self.outbox = outbox
        self._read = read or outbox.access  # the dispatcher's reads on a kept connection
        self._next: asyncio.Task[Access] | None = None  # not sent yet: joined by askers
        self._last: asyncio.Task[Access] | None = None

    async def read(self) -> Access:
        if self._next is None:
            self._next = self._last = asyncio.create_task(self._read_after(self._last))
        return await asyncio.shield(self._next)

    async def _read_after(self, previous: asyncio.Task[Access] | None) -> Access:
        if previous is not None and not previous.done():
            await asyncio.wait([previous])
        self._next = None  # whoever asks from now on may have waited past this read
        return await self._read(utcnow())


@dataclass(frozen=True)
class Tried:
    """One attempt, as the copy's attempt log keeps it (contract §14): when it ended, how
    long it took, and the answer: an HTTP status for a webhook, `confirmed`, `returned` or
    `nacked` for a queue; None when none came."""

    at: datetime
    ms: int | None = None
    status: int | str | None = None


class GivenUp(NamedTuple):
    """A copy to give up: why (`error`, the sentence; `code`, `given_up_reason`), and the
    failed attempt that made it too old to try again, if one did."""

    id: int
    error: str
    code: str
    tried: Tried | None = None


class Retry(NamedTuple):
    """A failed attempt's copy, due again at `next`."""

    id: int
    next: datetime
    error: str
    tried: Tried | None = None


@dataclass(frozen=True)
class Lease:
    """A relay's hold on copies until `until`."""

    relay_id: str
    until: datetime


@dataclass
class Request:
    """One accept request's validated events, as the store takes them."""

    events: Sequence[EventIn]
    bodies: list[dict[str, Any]]
    field_prefix: str


@dataclass
class Accepted:
    answers: list[EventAccepted]
    new_deliveries: int


@dataclass
class Stored:
    """What one store committed: each request's outcome, and the copies held by the lease."""

    results: list[Accepted | DomainError] = field(default_factory=list)
    handed: list[Claimed] = field(default_factory=list)
    # Whether the write that judged the handed copies was the store's last statement: no
    # statement ran between their judgment and their hand-over (one for repeated events
    # does), so a relay that takes them at once holds a judgment no later than a claim's
    # (docs/decisions/029-judged-as-it-leaves.md).
    handed_straight: bool = False
    deliveries: int = 0
    # Copies for webhook consumers: written unclaimed, for the webhook dispatcher.
    webhooks: int = 0
    webhook_consumers: set[uuid.UUID] = field(default_factory=set)


class Outbox:
    def __init__(self, engine: AsyncEngine, settings: Settings) -> None:
        self.engine = engine
        self.lease_length = timedelta(seconds=settings.relay_lease_seconds)
        self.recipients = RecipientCache()

    def lease(self, relay_id: str, now: datetime) -> Lease:
        """The lease rule: a claim, a store handed to a relay, an unpark and a renewal all
        hold the copies for `relay_lease_seconds` from now."""
        return Lease(relay_id, now + self.lease_length)

    # --- the intake's side ---------------------------------------------------------------
    @asynccontextmanager
    async def store_unit(self, kept: KeptConnection | None = None) -> AsyncIterator[StoreUnit]:
        """One store's connection (`kept`'s, when given): its recipients' read, then its
        one write."""
        async with checked_out(self.engine) if kept is None else kept.use() as driver:
            yield StoreUnit(driver, self.recipients)

    async def store(
        self,
        group: Sequence[Request],
        now: datetime,
        lease: Lease | None,
        kept: KeptConnection | None = None,
    ) -> Stored:
        """Store a group of requests, committed on return. With `lease`, the copies are
        written already claimed by it (the lease is in the insert) and returned as
        `handed`; without, they are written pending for any relay. On `kept`'s connection
        when given (one store at a time on it), else on one checked out for this store.

        What is written is written at once or not at all: by one statement after the
        recipients' read (docs/decisions/017-single-event-cost.md)."""
        async with self.store_unit(kept) as unit:
            return await _Store(unit, group, now, lease).run()

    # --- the relay's side: each statement stands alone, guarded by the row's state ------
    async def _run(self, statement: str, *arguments: Any) -> list[Any]:
        async with checked_out(self.engine) as driver:
            return await driver.fetch(statement, *arguments)

    async def claim(self, relay_id: str, now: datetime, limit: int) -> tuple[list[Claimed], Lease]:
        """Take up to `limit` due copies for `relay_id`, oldest first; those the owner may no
        longer receive are given up instead (docs/decisions/021-authorized-when-published.md,
        029-judged-as-it-leaves.md)."""
        lease = self.lease(relay_id, now)
        rows = await self._run(sql.CLAIM, now, limit, relay_id, lease.until)
        return _claimed(rows)[0], lease

    async def access(self, now: datetime) -> Access:
        """The access epoch and the latest expiry passed by `now`, in one light statement:
        what a holder compares its copies' judgment with before publishing them
        (docs/decisions/029-judged-as-it-leaves.md)."""
        ((epoch, expired),) = await self._run(sql.ACCESS, now)
        return Access(int(epoch), expired)

    async def judge_held(
        self, holder: str, items: Sequence[Claimed], now: datetime
    ) -> tuple[list[Claimed], int]:
        """Judge again, in one statement, copies `holder` holds whose judgment is no longer
        proven (`Access.unchanged_since`): those the owner may no longer receive are given up
        (the claim's reason, counted as refused); returns the others, recording this
        judgment, in the order given, and how many were refused. A copy no longer held
        (given up by a revocation, or its lease lost) is in neither: not to publish."""
        if not items:
            return [], 0
        rows = await self._run(sql.JUDGE_HELD, [item.id for item in items], holder, now)
        verdicts = {row[0]: (bool(row[1]), int(row[2])) for row in rows}
        kept = [
            replace(item, judged_epoch=verdicts[item.id][1], judged_at=now)
            for item in items
            if verdicts.get(item.id, (False, 0))[0]
        ]
        refused = sum(1 for ok, _ in verdicts.values() if not ok)
        if refused:
            COPIES_REFUSED.inc(refused)
        return kept, refused

    async def renew_held(self, holder: str, held: dict[int, datetime]) -> int:
        """Extend the lease of the copies `held` (copy -> lease end, updated) whose lease is
        past its first third, so copies that wait (a busy process, a slow broker or
        receiver) stay the holder's; a holder that dies stops renewing and its copies fall
        due when the lease ends. Returns how many were renewed."""
        now = utcnow()
        third = self.lease_length / 3
        due = [i for i, until in held.items() if until - now < third * 2]
        if not due:
            return 0
        renewed, lease = await self.renew(holder, due, now)
        for i in renewed:
            if i in held:
                held[i] = lease.until
        return len(renewed)

    async def renew(
        self, relay_id: str, ids: Collection[int], now: datetime
    ) -> tuple[set[int], Lease]:
        """Extend `relay_id`'s lease on these copies; returns those still pending and its own."""
        lease = self.lease(relay_id, now)
        if not ids:
            return set(), lease
        rows = await self._run(sql.RENEW, list(ids), relay_id, lease.until)
        return {row[0] for row in rows}, lease

    async def release(self, relay_id: str, ids: Collection[int], now: datetime) -> None:
        """Give back `relay_id`'s claim on copies it never published: due again at once."""
        if ids:
            await self._run(sql.RELEASE, list(ids), relay_id, now, DUE_CHANNEL)

    async def publish(
        self, ids: Collection[int], now: datetime, ms: Sequence[int | None] = ()
    ) -> None:
        """Settle copies the broker confirmed at `now`, after attempts of `ms` milliseconds
        (per copy, in `ids`' order; none: unknown)."""
        await self._finish(ids, DeliveryState.PUBLISHED, now, None, "confirmed", ms)

    async def published_at(self, confirmed: Sequence[tuple[int, datetime, int | None]]) -> None:
        """Settle (id, when the broker confirmed it, the attempt's milliseconds) as
        published, in one statement."""
        if confirmed:
            ids, times, ms = ([row[k] for row in confirmed] for k in range(3))
            await self._run(sql.PUBLISHED_AT, ids, times, ms)

    async def reject(
        self, ids: Collection[int], now: datetime, error: str, ms: Sequence[int | None] = ()
    ) -> None:
        """Settle copies the broker nacked and dead-lettered (a full queue)."""
        await self._finish(ids, DeliveryState.REJECTED, now, error, "nacked", ms)

    async def give_up(self, reasons: Sequence[GivenUp], now: datetime) -> None:
        """Settle copies as given up: never published."""
        if reasons:
            tried = [reason.tried for reason in reasons]
            await self._run(
                sql.GIVE_UP,
                [reason.id for reason in reasons],
                [reason.error for reason in reasons],
                now,
                [reason.code for reason in reasons],
                [t.at if t else None for t in tried],
                [t.ms if t else None for t in tried],
                [None if t is None or t.status is None else str(t.status) for t in tried],
            )

    async def reschedule(self, relay_id: str, retries: Sequence[Retry]) -> None:
        """Release our claim on each failed attempt's copy, due again at its `next`, unless
        another relay took it since."""
        if retries:
            now = utcnow()
            tried = [retry.tried or Tried(now) for retry in retries]
            await self._run(
                sql.RESCHEDULE,
                [retry.id for retry in retries],
                [retry.next for retry in retries],
                [retry.error for retry in retries],
                relay_id,
                [t.at for t in tried],
                [t.ms for t in tried],
                [None if t.status is None else str(t.status) for t in tried],
            )

    async def _finish(
        self,
        ids: Collection[int],
        state: DeliveryState,
        now: datetime,
        error: str | None,
        status: str,
        ms: Sequence[int | None],
    ) -> None:
        """A settled copy stays settled: only a pending one is settled."""
        if ids:
            await self._run(sql.FINISH, list(ids), state.value, now, error, status, list(ms))

    # --- parking's side (docs/decisions/015-parking.md): parking decides, the outbox writes
    async def park(self, relay_id: str, ids: Collection[int], now: datetime) -> None:
        """Park copies `relay_id` holds (claimed or handed over): from pending to parked."""
        if ids:
            await self._run(sql.PARK, list(ids), relay_id, now, PARKED_REASON)

    async def unpark(
        self, relay_id: str, vhost: str, queue: str, limit: int, now: datetime
    ) -> tuple[list[Claimed], int, Lease]:
        """Move the queue's oldest `limit` parked copies back to pending, claimed for
        `relay_id` under the lease rule as a claim is (a relay that dies leaves them due, and
        they park again behind the queue's backlog: nothing is lost), and give up those the
        owner may no longer receive. Returns the claimed in acceptance order (outbox id
        order) and how many were given up."""
        lease = self.lease(relay_id, now)
        rows = await self._run(sql.UNPARK, vhost, queue, limit, relay_id, lease.until, now)
        claimed, refused = _claimed(rows)
        # The relay's delivery_max_age counts from the release: a copy parked for days is
        # not too old to publish (retention bounds it instead).
        return [replace(item, created=now) for item in claimed], refused, lease

    async def give_up_parked(self, before: datetime, limit: int, now: datetime) -> int:
        """Give up (for retention) up to `limit` parked copies created before `before`;
        returns how many."""
        rows = await self._run(sql.GIVE_UP_PARKED, before, limit, now, RETENTION_REASON)
        return int(rows[0][0])

    async def prune_events(self, cutoff: datetime, limit: int) -> int:
        """Delete (retention) up to `limit` events accepted before `cutoff` whose copies all
        settled before it, their copies with them; returns how many events."""
        rows = await self._run(sql.PRUNE_EVENTS, cutoff, limit)
        return int(rows[0][0])

    async def add_resync(
        self, to: Copy, webhook: bool, snapshots: Sequence[Snapshot], now: datetime
    ) -> int:
        """Write each snapshot as a new event with one pending copy for the consumer `to`
        alone, of those its owner may receive now (contract §13's resync); returns how many.
        One statement: all or none, announced to the relays and the webhook dispatcher by
        the `deliveries` trigger."""
        if not snapshots:
            return 0
        async with checked_out(self.engine) as driver:
            rows = await driver.fetch(
                sql.ADD_RESYNC,
                [s.event_id for s in snapshots],
                [s.offering_uuid for s in snapshots],
                [json.dumps(s.payload, separators=(",", ":")) for s in snapshots],
                [s.project_uuid for s in snapshots],
                [s.subject_user_uuid for s in snapshots],
                now,
                to.consumer_uuid,
                to.queue_name,
                to.vhost,
                webhook,
            )
        return int(rows[0][0])

    async def add_replays(
        self,
        to: Copy,
        since: datetime,
        until: datetime,
        object_types: Sequence[str] | None,
        now: datetime,
        max_copies: int,
        per_second: float,
    ) -> Replayed:
        """Write a new pending copy for `to`'s queue, marked as a replay, of every event
        accepted in [since, until) (of `object_types`, or all) that had a copy for that
        queue (whatever became of it) and that its owner may receive now, in acceptance
        order, falling due `per_second` a second behind every other replay's; nothing
        while a replay of the queue is in flight or when the window holds more than
        `max_copies` (docs/decisions/021-authorized-when-published.md). One transaction
        under the replay lock, so two replays of one queue never both find none in flight
        and two replays never pace from the same start."""
        async with checked_out(self.engine) as driver, driver.driver.transaction():
            await driver.fetch(sql.REPLAY_LOCK, lock_key("replays"))
            rows = await driver.fetch(
                sql.ADD_REPLAYS,
                to.vhost,
                to.queue_name,
                to.queue_uuid,
                to.consumer_uuid,
                since,
                until,
                list(object_types) if object_types else None,
                now,
                max_copies,
                1.0 / per_second,
            )
        row = rows[0]
        return Replayed(int(row[0]), row[1], int(row[2]), int(row[3]))

    # --- the webhook dispatcher's side (docs/decisions/026-webhooks-on-the-outbox.md) ------
    async def claim_webhooks(
        self,
        dispatcher_id: str,
        now: datetime,
        per_consumer: int,
        consumers: int,
        skip: Collection[uuid.UUID] = (),
    ) -> tuple[list[WebhookCopy], Lease]:
        """Take, for up to `consumers` webhook consumers (not in `skip`) whose oldest
        pending copy is due,
        the run of up to `per_consumer` due copies from that oldest, in acceptance order,
        leased to `dispatcher_id` as a claim leases; those the owner may no longer receive
        are given up instead. One claim at a time across dispatchers (an advisory lock), so
        one consumer's copies are never held by two."""
        lease = self.lease(dispatcher_id, now)
        # A statement failing leaves the connection in the transaction: `checked_out`
        # drops such a connection, and the transaction with it.
        async with checked_out(self.engine) as driver:
            heads = await driver.fetch(sql.WEBHOOK_DUE_HEADS, now, list(skip))
            unchanged, other = heads[0]
            if not (unchanged or other):
                return [], lease
            claim = (now, per_consumer, dispatcher_id, lease.until)
            await driver.execute(sql.WEBHOOK_CLAIM_LOCK)
            # The form without the rule in its plan when every due head was proven
            # unchanged: it proves that again itself and takes nothing it cannot
            # (docs/decisions/029-judged-as-it-leaves.md).
            rows = await driver.fetch(sql.WEBHOOK_CLAIM[not other], *claim, consumers, list(skip))
            taken = len({row[3] for row in rows})
            if not other and taken < min(unchanged, consumers):
                # Fewer than the read found: access changed in between (or another
                # dispatcher took some). The rule's form judges the rest, in the same
                # transaction (what was just claimed is no longer due).
                rows += await driver.fetch(
                    sql.WEBHOOK_CLAIM[False], *claim, consumers - taken, list(skip)
                )
            await driver.execute(sql.COMMIT)
        copies = [
            WebhookCopy(Claimed(*row[:17]), row[17], tuple((row[18] or "").split()))
            for row in rows
            if row[-1]
        ]
        if len(copies) < len(rows):
            COPIES_REFUSED.inc(len(rows) - len(copies))
        copies.sort(key=lambda copy: copy.claimed.id)
        return copies, lease

    async def settle_webhooks(self, dispatcher_id: str, run: WebhookRun, now: datetime) -> None:
        """Write what one consumer's run of attempts came to (copies and consumer), in one
        statement; only copies `dispatcher_id` still holds are touched."""
        tried = list(run.tried.items())
        await self._run(
            sql.WEBHOOK_SETTLE,
            run.delivered,
            now,
            dispatcher_id,
            run.failed,
            run.retry_at,
            run.error,
            run.released,
            run.consumer_uuid,
            run.gone,
            [i for i, _ in tried],
            [t.at for _, t in tried],
            [t.ms for _, t in tried],
            [t.status if isinstance(t.status, int) else None for _, t in tried],
        )

    async def give_up_stranded_webhooks(
        self, before: datetime, limit: int, now: datetime, gone: str, too_old: str
    ) -> int:
        """Give up up to `limit` webhook copies no claim takes: a deleted consumer's (reason
        `gone`), and those unclaimed past retention, created before `before` (`too_old`);
        returns how many."""
        rows = await self._run(sql.WEBHOOK_GIVE_UP_STRANDED, before, limit, now, gone, too_old)
        return int(rows[0][0])

    async def webhook_gauges(self) -> WebhookGauges:
        rows = await self._run(sql.WEBHOOK_GAUGES)
        gauges = WebhookGauges()
        for kind, count, oldest in rows:
            if kind is None:
                gauges.failing, gauges.failing_since = int(count), oldest
            elif kind:
                gauges.webhook_pending, gauges.webhook_oldest = int(count), oldest
            else:
                gauges.queue_pending, gauges.queue_oldest = int(count), oldest
        return gauges


# --- a request's writes of copies, in its unit of work ------------------------------------
# The service decides which copies and why; the outbox writes them through the caller's
# session, so they commit or roll back with what decided them (a revocation, a consumer
# deleted or narrowed): docs/decisions/032-one-owner-of-copy-state.md.


async def _in_session(session: AsyncSession, statement: str, *arguments: Any) -> Any:
    """Run one of `outbox_postgres.py`'s statements in the session's transaction."""
    connection = await session.connection()
    return await connection.exec_driver_sql(statement, arguments)


async def give_up_waiting(
    session: AsyncSession,
    now: datetime,
    reason: str,
    code: str,
    *,
    consumer_uuids: Collection[uuid.UUID] = (),
    queue_uuids: Collection[uuid.UUID] = (),
    offering_uuid: uuid.UUID | None = None,
    unauthorized_only: bool = False,
) -> int:
    """Give up the copies not yet on the broker (pending or parked) of these consumers and
    subscription queues, with the reason `reason` and the code `code` (`given_up_reason`):
    of the offering `offering_uuid` alone if given, and with `unauthorized_only` only those
    the owner may no longer receive (docs/decisions/021-authorized-when-published.md).
    Returns how many."""
    if not consumer_uuids and not queue_uuids:
        return 0
    result = await _in_session(
        session,
        sql.GIVE_UP_WAITING,
        list(consumer_uuids),
        list(queue_uuids),
        now,
        reason,
        code,
        offering_uuid,
        unauthorized_only,
    )
    return int(result.scalar_one())


async def webhook_copies_due_now(
    session: AsyncSession, consumer_uuid: uuid.UUID, now: datetime
) -> None:
    """A webhook consumer's pending copies fall due now, except those a dispatcher holds:
    made due, the next claim would post them beside the run that holds them (two at a time,
    out of order); that run's end makes the rest due."""
    await _in_session(session, sql.WEBHOOK_DUE_NOW, consumer_uuid, now, WEBHOOKS_DUE_CHANNEL)


@dataclass(frozen=True)
class WebhookCopy:
    """A claimed webhook copy and where it goes: its consumer's URL, and the secrets it is
    signed with (the current one, then the previous one while a rotation's window lasts)."""

    claimed: Claimed
    url: str | None
    secrets: tuple[str, ...]


@dataclass
class WebhookRun:
    """One consumer's attempts in order: those delivered, then at most one that failed (a
    410: `gone`), and the copies claimed behind it, not attempted."""

    consumer_uuid: uuid.UUID
    delivered: list[int] = field(default_factory=list)
    failed: int | None = None
    retry_at: datetime | None = None
    error: str | None = None
    gone: bool = False
    released: list[int] = field(default_factory=list)
    tried: dict[int, Tried] = field(default_factory=dict)  # each attempt, by copy


@dataclass
class WebhookGauges:
    queue_pending: int = 0
    queue_oldest: datetime | None = None
    webhook_pending: int = 0
    webhook_oldest: datetime | None = None
    failing: int = 0  # webhook consumers whose last attempt failed (not gone)
    failing_since: datetime | None = None  # the longest-failing one's first failure


@dataclass(frozen=True)
class Replayed:
    """What `Outbox.add_replays` found and wrote."""

    in_flight: int  # copies of an earlier replay of the queue not yet published
    in_flight_since: datetime | None
    window: int  # copies the window holds (that the owner may receive)
    added: int


@dataclass(frozen=True)
class Snapshot:
    """One `user_role` event of a resync: its id, its body and its scope keys."""

    event_id: str
    payload: dict[str, Any]
    offering_uuid: uuid.UUID | None
    project_uuid: uuid.UUID | None
    subject_user_uuid: uuid.UUID


def _claimed(rows: Sequence[Sequence[Any]]) -> tuple[list[Claimed], int]:
    """A claim's (or an unpark's) rows as the relay takes them, in acceptance order, and
    how many it gave up instead (each row's last column: authorized)."""
    claimed = sorted((Claimed(*row[:-1]) for row in rows if row[-1]), key=lambda i: i.id)
    refused = len(rows) - len(claimed)
    if refused:
        COPIES_REFUSED.inc(refused)
    return claimed, refused


class _Store:
    """One group's store, step by step, inside the transaction of `unit`."""

    def __init__(
        self, unit: StoreUnit, group: Sequence[Request], now: datetime, lease: Lease | None
    ) -> None:
        self.unit = unit
        self.group = group
        self.now = now
        self.lease = lease
        self.results: list[Accepted | DomainError | None] = [None] * len(group)
        self.valid: list[tuple[int, Request]] = []
        # Every event of the group, in order: a repeated event_id (within a request or
        # across the group) is the first occurrence's duplicate, as if the requests came
        # one by one. `first_of[event_id]` = (valid request, position) of its first.
        self.first_of: dict[str, tuple[int, int]] = {}
        self.event_ids: list[list[str]] = []
        self.recipients: dict[str, Recipients] = {}
        # A fan-out event's copies, each with the offering of the queue it goes to.
        self.copy_offerings: dict[str, dict[Copy, uuid.UUID]] = {}
        self.event_rows: dict[str, dict[str, Any]] = {}
        self.inserted: set[str] = set()
        self.copies: list[tuple[str, Copy]] = []

    async def run(self) -> Stored:
        index = await self.find_recipients()
        self.refuse_unknown_offerings(index)
        self.plan_events(index)
        handed = await self.insert() if self.event_rows else []
        repeated = set(self.first_of) - self.inserted
        earlier = await self.unit.event_counts(repeated) if repeated else {}
        self.answer(earlier)
        if _DEBUG.isEnabledFor(logging.DEBUG):  # a dropped line still costs its call
            log.debug(
                "events_accepted",
                requests=len(self.group),
                events=len(self.event_rows),
                new=len(self.inserted),
                deliveries=len(self.copies),
                handed=len(handed),
            )
        results = [result for result in self.results if result is not None]
        hooks = [copy.consumer_uuid for _, copy in self.copies if copy.webhook]
        consumers = {consumer for consumer in hooks if consumer is not None}
        return Stored(results, handed, not repeated, len(self.copies), len(hooks), consumers)

    async def find_recipients(self) -> RecipientIndex:
        """Who may receive the group's events: one statement for the whole group."""
        events = [event for request in self.group for event in request.events]
        offerings = {offering for event in events for offering in event.offerings}
        object_types = {event.object_type for event in events}
        projects = {event.project_uuid for event in events if event.project_uuid is not None}
        subjects = {e.subject_user_uuid for e in events if e.subject_user_uuid is not None}
        return RecipientIndex.of(
            await self.unit.recipients(offerings, object_types, self.now, projects, subjects)
        )

    def refuse_unknown_offerings(self, index: RecipientIndex) -> None:
        """A request naming an offering the backend never pushed fails alone."""
        for slot, request in enumerate(self.group):
            error = _unknown_offering(request, index)
            if error is None:
                self.valid.append((slot, request))
            else:
                self.results[slot] = error

    def plan_events(self, index: RecipientIndex) -> None:
        """Each new event's id, recipients and row."""
        for r, (_slot, request) in enumerate(self.valid):
            ids = [event.event_id or uuid.uuid4().hex for event in request.events]
            self.event_ids.append(ids)
            for position, (event, event_id) in enumerate(zip(request.events, ids, strict=True)):
                if event_id in self.first_of:
                    continue
                self.first_of[event_id] = (r, position)
                body = request.bodies[position]
                if event.offering_uuids is None:
                    found = index.recipients(
                        event.offering_uuid,
                        event.object_type,
                        event.user_uuids,
                        event.project_uuid,
                        event.subject_user_uuid,
                        body,
                    )
                else:
                    found, self.copy_offerings[event_id] = _fan_out(index, event, body)
                self.recipients[event_id] = found
                self.event_rows[event_id] = _event_row(
                    event, event_id, request.bodies[position], found, self.now
                )

    async def insert(self) -> list[Claimed]:
        """The planned events, and one copy per recipient of each that is new (an event
        stored before keeps its first copies); with a lease, the copies are written held by
        it and returned as the relay would have claimed them."""
        planned = [
            (event_id, copy)
            for event_id in self.first_of
            for copy in self.recipients[event_id].copies
        ]
        self.inserted, returned = await self.unit.insert(
            list(self.event_rows.values()),
            [self._copy_row(event_id, copy) for event_id, copy in planned],
        )
        self.copies = [(event_id, copy) for event_id, copy in planned if event_id in self.inserted]
        to_consumers = sum(1 for _, copy in self.copies if copy.consumer_uuid is not None)
        _QUEUED_CONSUMER.inc(to_consumers)
        _QUEUED_LEGACY.inc(len(self.copies) - to_consumers)
        if self.lease is None:
            return []
        ids = {(event_id, queue or consumer): i for i, event_id, queue, consumer in returned}
        return [
            self._handed(ids[(event_id, copy.queue_uuid or copy.consumer_uuid)], event_id, copy)
            for event_id, copy in self.copies
            if not copy.webhook
        ]

    def _copy_row(self, event_id: str, copy: Copy) -> dict[str, Any]:
        # A webhook copy is never the queue relay's: written unclaimed, due now, for the
        # webhook dispatcher (docs/decisions/026-webhooks-on-the-outbox.md).
        lease = None if copy.webhook else self.lease
        return {
            "event_id": event_id,
            "queue_uuid": copy.queue_uuid,
            "consumer_uuid": copy.consumer_uuid,
            "queue_name": copy.queue_name,
            "vhost": copy.vhost,
            "offering_uuid": self.copy_offerings.get(event_id, {}).get(copy),
            "state": DeliveryState.PENDING.value,
            # Held by the lease: written as a claim would leave it (`Outbox.claim`).
            "attempts": 1 if lease else 0,
            "claimed_by": lease.relay_id if lease else None,
            "claimed_until": lease.until if lease else None,
            "next_attempt_at": lease.until if lease else self.now,
            "created": self.now,
        }

    def _handed(self, delivery_id: int, event_id: str, copy: Copy) -> Claimed:
        # Judged by the write itself (its recipients read again in its snapshot) at `now`:
        # the relay proves that judgment still holds before publishing it, or judges again.
        row = self.event_rows[event_id]
        return Claimed(
            id=delivery_id,
            event_id=event_id,
            queue_uuid=copy.queue_uuid,
            consumer_uuid=copy.consumer_uuid,
            queue_name=copy.queue_name,
            vhost=copy.vhost,
            attempts=1,
            created=self.now,
            last_error=None,
            copy_offering_uuid=self.copy_offerings.get(event_id, {}).get(copy),
            offering_uuid=row["offering_uuid"],
            object_type=row["object_type"],
            accepted=self.now,
            body=row["payload"],  # the JSON text the column is written from
            judged_epoch=self.unit.judged_epoch,
            judged_at=self.now,
        )

    def answer(self, earlier: dict[str, tuple[int, int]]) -> None:
        """Each valid request's answers: counts of new events, those stored before for
        duplicates."""
        for r, (slot, request) in enumerate(self.valid):
            answers = []
            for position, event_id in enumerate(self.event_ids[r]):
                found = self.recipients[event_id]
                new = event_id in self.inserted and self.first_of[event_id] == (r, position)
                if event_id in self.inserted:
                    queued, skipped = len(found.copies), len(found.skipped)
                else:
                    queued, skipped = earlier.get(event_id, (0, 0))
                answers.append(
                    # Built from values this store computed, not input: not validated again.
                    EventAccepted.model_construct(
                        event_id=event_id,
                        queued=queued,
                        skipped_unregistered=skipped,
                        duplicate=not new,
                        no_copy_reason=None
                        if queued
                        else (found.no_copy_reason if new else "duplicate"),
                    )
                )
                if new and found.skipped:
                    _log_skipped(request.events[position], event_id, found)
            new_count = sum(1 for answer in answers if not answer.duplicate)
            EVENTS_ACCEPTED.inc(new_count)
            EVENTS_DUPLICATE.inc(len(answers) - new_count)
            SKIPPED_UNREGISTERED.inc(
                sum(answer.skipped_unregistered for answer in answers if not answer.duplicate)
            )
            own = sum(
                len(self.recipients[e].copies)
                for e in set(self.event_ids[r])
                if e in self.inserted and self.first_of[e][0] == r
            )
            self.results[slot] = Accepted(answers, own)


def _event_row(
    event: EventIn, event_id: str, body: dict[str, Any], found: Recipients, now: datetime
) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "offering_uuid": event.offerings[0] if event.offerings else None,
        "project_uuid": event.project_uuid,
        "subject_user_uuid": event.subject_user_uuid,
        "offering_uuids": [o.hex for o in event.offering_uuids]
        if event.offering_uuids is not None
        else None,
        "object_type": event.object_type,
        # Encoded once: the column is written from this text and a handed copy sends it.
        "payload": json.dumps(body),
        "user_uuids": [u.hex for u in event.user_uuids] if event.user_uuids is not None else None,
        "queued": len(found.copies),
        "skipped_unregistered": len(found.skipped),
        "accepted": now,
    }


def _log_skipped(event: EventIn, event_id: str, found: Recipients) -> None:
    log.info(
        "queue not registered for this offering and object type; skipping",
        event_id=event_id,
        offering_uuids=[o.hex for o in event.offerings],
        object_type=event.object_type,
        subscriptions=[s.hex for s in found.skipped],
    )


def field_name(prefix: str, *parts: object) -> str:
    return ".".join([prefix, *(str(part) for part in parts)] if prefix else map(str, parts))


def _unknown_offering(request: Request, index: RecipientIndex) -> BadRequest | None:
    """The first offering, project or subject user of the request the backend never pushed."""
    for position, event in enumerate(request.events):
        for name, entity, known in (
            ("project_uuid", event.project_uuid, index.known_projects),
            ("subject_user_uuid", event.subject_user_uuid, index.known_users),
        ):
            if entity is not None and entity not in known:
                prefix = request.field_prefix
                what = "project" if name == "project_uuid" else "user"
                return BadRequest(
                    f"Unknown {what} {entity.hex}: the backend has not pushed it.",
                    field=field_name(prefix, position, name) if prefix else name,
                )
        for number, offering in enumerate(event.offerings):
            if offering not in index.known:
                prefix = request.field_prefix
                where = (
                    ("offering_uuid",)
                    if event.offering_uuids is None
                    else ("offering_uuids", number)
                )
                return BadRequest(
                    f"Unknown offering {offering.hex}: the backend has not pushed it.",
                    field=field_name(prefix, position, *where)
                    if prefix
                    else field_name("", *where),
                )
    return None


def _fan_out(
    index: RecipientIndex, event: EventIn, body: dict[str, Any]
) -> tuple[Recipients, dict[Copy, uuid.UUID]]:
    """An event sent to several offerings: each offering's recipients, as for an event of
    that offering alone, and one copy per queue (a consumer scoped to several of them gets
    one copy, carrying the first of them in the event's order)."""
    found = Recipients()
    offering_of: dict[Copy, uuid.UUID] = {}
    for offering in event.offerings:
        each = index.recipients(
            offering,
            event.object_type,
            event.user_uuids,
            event.project_uuid,
            event.subject_user_uuid,
            # Filters see the body as this offering's copy carries it (message.message_body).
            {**body, "offering_uuid": offering.hex} if index.filtered else body,
        )
        found.candidates += each.candidates
        for copy in each.copies:
            if copy not in offering_of:
                offering_of[copy] = offering
                found.copies.append(copy)
        found.skipped.extend(s for s in each.skipped if s not in found.skipped)
    return found, offering_of
