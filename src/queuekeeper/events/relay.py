"""The outbox relay: claims due deliveries, publishes them, settles each on the broker's answer.

At-least-once: a delivery is marked done only after the broker confirmed it,
so a relay that dies between publish and mark leaves it to be published again
when its lease runs out (consumers deduplicate on `message_id`). Any number of
relays (threads of one process, replicas, `queuekeeper relay` processes) share
the work through the claim in `Outbox.claim` (events/outbox.py: the lease rule).

What happens to a copy, by the broker's answer:
- confirmed → `published`;
- nack of a full queue under `reject-publish-dlx` (the broker dead-lettered it) → `rejected`;
  any other nack (a full queue under `reject-publish`, as every quorum queue is, or a
  queue whose process failed: nothing was kept; broker/verdict.py tells them apart) → retried
  with backoff;
- returned as unroutable, or the vhost refused us → the queue is declared again
  through the Management API and the copy retried at once;
- broker unreachable or no confirm in time → retried after a capped, jittered
  exponential backoff;
- its queue row is gone (access revoked, queue or subscription deleted), or it is
  older than `delivery_max_age` → `given_up`, with the reason stored.

Every copy is judged against the directory as it stands when it is taken to be published
(docs/decisions/029-judged-as-it-leaves.md): a claimed or released one by the claim's own
statement; one handed over by the store of this process, which no claim takes, by the
store's own write when nothing came between that write and its publish (taken at once by
an idle relay, as a claim's copies are), else by a light statement after its wait that
proves the store's judgment still holds, or else by the rule again (`judged_now`).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper.broker.management import ManagementError
from queuekeeper.broker.provisioner import ForeignVhost, Provisioner, QueueConflict
from queuekeeper.broker.publisher import AmqpPublisher, Outgoing, json_message
from queuekeeper.broker.sieve import EVENT_HEADER, OFFERING_HEADER
from queuekeeper.broker.verdict import Outcome, Result
from queuekeeper.common.signals import OutboxSignals, Signal
from queuekeeper.config import Settings
from queuekeeper.events import repository
from queuekeeper.events.delivery_loop import HOUSEKEEPING_INTERVAL, DeliveryLoop, Listeners, Loops
from queuekeeper.events.message import message_body, new_relay_id
from queuekeeper.events.outbox import DUE_CHANNEL, Claimed, GivenUp, Retry, SharedAccess, Tried
from queuekeeper.events.retry import not_past_give_up
from queuekeeper.models import utcnow
from queuekeeper.observability.metrics import (
    CONSUMERS,
    COPIES,
    DELIVERIES,
    DELIVERY_ATTEMPTS,
    OUTBOX_OLDEST_AGE,
    OUTBOX_PENDING,
)

log = structlog.get_logger(__name__)

QUEUE_GONE = (
    "its queue is no longer registered (access revoked, or the queue, subscription, "
    "consumer, owner or offering deleted); not published"
)
# A queue re-declared after a return is retried at once this many times, then with backoff.
IMMEDIATE_RETRIES = 3
REPLAY_HEADER = "x-queuekeeper-replay"
# Bound once: a child's lookup per batch costs more than its increment.
_PUBLISHED = DELIVERIES.labels(outcome="published")
_PUBLISHED_CONSUMER = COPIES.labels(kind="consumer", stage="published")
_PUBLISHED_LEGACY = COPIES.labels(kind="legacy", stage="published")
# A queue attempt has no HTTP status (contract §14's metrics; docs/decisions/031-delivery-log.md).
_TRIED_DELIVERED = DELIVERY_ATTEMPTS.labels(kind="queue", outcome="delivered", status_class="none")
_TRIED_FAILED = DELIVERY_ATTEMPTS.labels(kind="queue", outcome="failed", status_class="none")


# (relay id, claimed copies) -> the copies to publish now; it parks the others.
HoldBack = Callable[[str, list[Claimed]], Awaitable[list[Claimed]]]


def event_message(item: Claimed) -> Outgoing:
    """contract §6: the stored body, and the properties consumers rely on."""
    offering = item.copy_offering_uuid or item.offering_uuid
    return json_message(
        item.queue_name,
        message_body(item),
        message_id=item.event_id,
        timestamp=item.accepted,
        message_type=item.object_type,
        headers={
            # An identity event without an offering has none (contract §12).
            **({OFFERING_HEADER: offering.hex} if offering is not None else {}),
            "object_type": item.object_type,
            EVENT_HEADER: item.event_id,
            # A string: RabbitMQ's STOMP adapter drops boolean AMQP headers (contract §11).
            **({REPLAY_HEADER: "true"} if item.replay else {}),
        },
    )


class _Turn:
    """Whether the running task has let the event loop run since this was made: a callback
    scheduled now runs only once the task suspends (on a lock, a statement, anything), and
    before the task resumes."""

    def __init__(self) -> None:
        self._passed = False
        self._handle = asyncio.get_running_loop().call_soon(self._pass)

    def _pass(self) -> None:
        self._passed = True

    def passed(self) -> bool:
        self._handle.cancel()
        return self._passed


def _target(item: Claimed) -> uuid.UUID | None:
    """The row a copy goes to: its subscription queue or its consumer (None: deleted)."""
    return item.queue_uuid or item.consumer_uuid


def _count_published(copies: int, to_consumers: int) -> None:
    """Move the published counters; called right after the write commits, with no await
    between, so a `?wait=true` waiter never sees rows not yet counted."""
    _PUBLISHED.inc(copies)
    _TRIED_DELIVERED.inc(copies)
    _PUBLISHED_CONSUMER.inc(to_consumers)
    _PUBLISHED_LEGACY.inc(copies - to_consumers)


@dataclass
class _Settlement:
    """What one batch decided, written back in one transaction."""

    published: list[int] = field(default_factory=list)
    published_to_consumers: int = 0
    rejected: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    given_up: list[GivenUp] = field(default_factory=list)
    retries: list[Retry] = field(default_factory=list)
    # Each published copy's attempt: how long its batch took to be answered, in ms.
    ms: dict[int, int] = field(default_factory=dict)


class Relay(DeliveryLoop):
    kind = "relay"
    id_key = "relay"
    channel = DUE_CHANNEL

    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine,
        publisher: AmqpPublisher,
        provisioner: Provisioner,
        signals: OutboxSignals | None = None,
        relay_id: str | None = None,
    ) -> None:
        self.signals = signals or OutboxSignals()
        super().__init__(settings, engine, relay_id or new_relay_id(), self.signals.accepted)
        # Housekeeping's reads stand alone too: autocommit connections, no
        # BEGIN/COMMIT round trips and no ORM session to set up per statement.
        self.engine = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.publisher = publisher
        self.provisioner = provisioner
        self._max_age = timedelta(seconds=settings.delivery_max_age)
        # Copies accepted by this process, committed already claimed for this relay.
        self._handed: list[Claimed] = []
        # Those of them whose store's write is still their last judgment with nothing
        # between: handed over while the loop waited for work (`_parked`) with nothing
        # after the write, and the loop has not waited on anything else since
        # (docs/decisions/029-judged-as-it-leaves.md).
        self._straight: set[int] = set()
        self._parked = False
        # The light statement of `judged_now`, one for the batches that ask together.
        self._access = SharedAccess(self.outbox)
        # Woken (`_wake`) by handed copies and by copies written unclaimed
        # (`signals.accepted`); only the latter, or the poll interval, make it look in the
        # database. What it holds (`_held`) counts the handed copies too.
        self._claim_wanted = True
        # Parks the copies of queues whose agent is away before they are published
        # (parking/gate.py; docs/decisions/015-parking.md); None: nothing parks.
        self.hold_back: HoldBack | None = None
        # Copies of the dispatch loop's batches confirmed and not yet written published:
        # written together every `relay_settle_interval` (docs/decisions/019-settle-interval.md).
        # (copy, when confirmed, its attempt's milliseconds)
        self._confirmed: list[tuple[int, datetime, int | None]] = []
        self._confirmed_to_consumers = 0
        self._confirmed_added = Signal()
        self._settle_now = Signal()  # a stop, or a `?wait=true` waiter: cut the interval short
        self._write_now = False

    # --- lifecycle (events/delivery_loop.py) ----------------------------------------------
    def start(self) -> None:
        super().start()
        log.info("relay_started", relay=self.id, batches=self.settings.relay_concurrency)

    def _loops(self) -> Loops:
        return [
            (self._dispatch(), "relay-dispatch"),
            (self._write_confirmed_loop(), "relay-settle"),
        ]

    async def _stopped(self, grace: float, cut_short: int) -> None:
        released = await self._release_handed()
        unwritten = await self._write_confirmed()
        log.info(
            "relay_stopped",
            relay=self.id,
            cut_short=cut_short,
            released=released,
            confirmed_unwritten=unwritten,
        )

    async def _release_handed(self) -> int:
        """Give back copies handed over but not started, so another relay publishes them
        now rather than when their lease runs out (a restart would delay them by it)."""
        handed, self._handed = self._handed, []
        self._straight.clear()
        if not handed:
            return 0
        try:
            await self.outbox.release(self.id, [item.id for item in handed], utcnow())
        except Exception as exc:  # the lease gives them back anyway
            log.warning("relay_release_failed", relay=self.id, error=repr(exc)[:500])
            return 0
        for item in handed:
            self._held.pop(item.id, None)
        return len(handed)

    def request_stop(self) -> None:
        super().request_stop()
        self._confirmed_added.notify()
        self._settle_now.notify()

    def _on_accepted(self) -> None:
        self._claim_wanted = True
        self._wake.notify()

    def _listeners(self) -> Listeners:
        """A NOTIFY on `outbox.DUE_CHANNEL` (the trigger of migration 0006): copies
        committed unclaimed by any process."""
        return self._on_accepted, None

    def _on_missed(self) -> None:
        self._on_accepted()

    # --- copies handed over by the accept path of this process ---------------------------
    def takes_handoff(self) -> bool:
        """Whether the next accepted copies are to be written claimed for this relay: not
        when stopping, nor when a batch's worth already waits (they then go to the outbox
        unclaimed, for whichever relay is free)."""
        return not self._stopping.is_set() and len(self._handed) < self.settings.relay_batch_size

    def hand_over(self, claimed: list[Claimed], *, straight: bool = False) -> None:
        """Publish these copies, committed already claimed by this relay; `straight`: the
        write that judged them was the store's last statement (`Stored.handed_straight`)."""
        lease_until = self.outbox.lease(self.id, utcnow()).until
        for item in claimed:
            self._held[item.id] = lease_until
        if straight and self._parked:  # taken on the loop's next pass, unless it waits
            self._straight.update(item.id for item in claimed)
        self._handed.extend(claimed)
        self._wake.notify()

    # --- the loop -----------------------------------------------------------------------
    async def _dispatch(self) -> None:
        """Claim a batch whenever fewer than `relay_concurrency` are in flight.

        While one batch waits for its confirms the next is already claimed and
        publishing, so the broker always has confirms outstanding.
        """
        slots = asyncio.Semaphore(self.settings.relay_concurrency)
        in_flight: set[asyncio.Task[None]] = set()

        def finished(task: asyncio.Task[None]) -> None:
            in_flight.discard(task)
            slots.release()

        try:
            await self._claim_loop(slots, in_flight, finished)
        except asyncio.CancelledError:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            raise
        # A stop: let the batches in flight finish (cancelling this wait cancels them).
        await asyncio.gather(*in_flight, return_exceptions=True)

    async def _claim_loop(
        self,
        slots: asyncio.Semaphore,
        in_flight: set[asyncio.Task[None]],
        finished: Callable[[asyncio.Task[None]], None],
    ) -> None:
        while not self._stopping.is_set():
            if slots.locked():  # copies handed over now wait for a batch in flight
                self._straight.clear()
            await slots.acquire()
            # Read before claiming: an event accepted during the claim then
            # cuts the pause short instead of waiting for the next poll.
            seen = self._wake.generation
            batch, self._handed = (
                self._handed[: self.settings.relay_batch_size],
                self._handed[self.settings.relay_batch_size :],
            )
            handed = bool(batch)
            straight = handed and all(item.id in self._straight for item in batch)
            self._straight.difference_update(item.id for item in batch)
            if not batch and self._claim_wanted and not self._stopping.is_set():
                self._claim_wanted = False
                try:
                    batch = await self.claim()
                    self._looked(bool(batch))
                except Exception as exc:  # the database is down: keep the loop alive
                    slots.release()
                    self._claim_wanted = True
                    log.error("relay_claim_failed", relay=self.id, error=repr(exc)[:500])
                    await self._pause(self.settings.relay_backoff_base, seen)
                    continue
                # A full batch: more may be due at once.
                self._claim_wanted = len(batch) >= self.settings.relay_batch_size
            if not batch:
                slots.release()
                await self._pause(self._poll_wait(), seen)
                continue
            task = asyncio.create_task(self._process_logged(batch, handed, straight))
            in_flight.add(task)
            task.add_done_callback(finished)
            if not self._handed and not self._claim_wanted:
                await self._pause(self._poll_wait(), seen)

    async def _pause(self, seconds: float, seen: int) -> None:
        if self._stopping.is_set():
            return
        self._parked = True
        try:
            await self._wake.wait(seconds, since=seen)
        finally:
            self._parked = False
        if self._wake.generation == seen:  # the poll interval passed: look for due copies
            self._claim_wanted = True

    async def _process_logged(
        self, claimed: list[Claimed], handed: bool = False, straight: bool = False
    ) -> None:
        try:
            await self.process(claimed, gather=True, judge=handed, straight=straight)
        except Exception as exc:  # claims not settled are retried when their lease ends
            log.error("relay_batch_failed", relay=self.id, error=repr(exc)[:500])

    async def run_once(self) -> int:
        """Claim one batch, publish it and settle it; returns how many deliveries it claimed."""
        claimed = await self.claim()
        if claimed:
            await self.process(claimed)
        return len(claimed)

    async def claim(self) -> list[Claimed]:
        claimed, lease = await self.outbox.claim(self.id, utcnow(), self.settings.relay_batch_size)
        for item in claimed:
            self._held[item.id] = lease.until
        return claimed

    async def unpark(self, vhost: str, queue: str, limit: int) -> tuple[list[Claimed], int]:
        """Take a returned queue's oldest parked copies, claimed for this relay (and renewed
        like its claims while they wait), to publish with `process(..., park=False)`; and
        how many of them were given up instead (their owner may no longer receive them)."""
        released, refused, lease = await self.outbox.unpark(self.id, vhost, queue, limit, utcnow())
        for item in released:
            self._held[item.id] = lease.until
        return released, refused

    async def process(
        self,
        claimed: list[Claimed],
        *,
        park: bool = True,
        gather: bool = False,
        judge: bool = False,
        straight: bool = False,
    ) -> None:
        """Publish a claimed batch and write back what became of each copy; `park=False`
        for released parked copies, which go out whatever the queue's state. With `gather`
        (the dispatch loop's batches), the confirmed copies are written published with
        those of the next `relay_settle_interval`, not before returning. With `judge` (copies
        handed over by the store, which no claim judged), those not to be published now are
        given up first (`judged_now`), unless `straight` (taken at once after the store's
        write, nothing waited on since) and parking waits on nothing either: the store's
        write is then their judgment as a claim's is its copies'."""
        try:
            to_publish = claimed
            if park and self.hold_back is not None:
                turn = _Turn()
                to_publish = await self.hold_back(self.id, claimed)
                straight = straight and not turn.passed()
            if judge and not straight:
                to_publish = await self.judged_now(to_publish)
            await self._process(to_publish, gather=gather)
        finally:
            for item in claimed:  # settled, parked, or left to its lease: no longer renewed
                self._held.pop(item.id, None)

    async def judged_now(self, items: list[Claimed]) -> list[Claimed]:
        """Of copies this relay holds, those its owner may receive as the directory stands
        now, in order: one light statement (`Outbox.access`) proves the last judgment of
        each still holds; only those it cannot prove are judged again, by the rule in one
        statement that gives up the refused (docs/decisions/029-judged-as-it-leaves.md).
        No window of trust: a handed copy may wait behind busy batches for seconds."""
        if not items:
            return items
        access = await self._access.read()
        stale = [item for item in items if not access.unchanged_since(item)]
        if not stale:
            return items
        kept, _refused = await self.outbox.judge_held(self.id, stale, utcnow())
        judged = {item.id: item for item in kept}
        stale_ids = {item.id for item in stale}
        return [
            judged.get(item.id, item)
            for item in items
            if item.id not in stale_ids or item.id in judged
        ]

    async def _process(self, claimed: list[Claimed], *, gather: bool = False) -> None:
        now = utcnow()
        settlement = _Settlement()
        by_vhost: dict[str, list[Claimed]] = defaultdict(list)
        for item in claimed:
            if _target(item) is None:
                settlement.given_up.append(GivenUp(item.id, QUEUE_GONE, "queue_gone"))
            elif now - item.created > self._max_age:
                settlement.given_up.append(
                    GivenUp(item.id, self._too_old(item.last_error), "too_old")
                )
            else:
                by_vhost[item.vhost].append(item)
        if len(by_vhost) == 1:  # the usual batch: no task per vhost to run it
            ((vhost, items),) = by_vhost.items()
            results = [await self._publish_vhost(vhost, items)]
        else:
            results = await asyncio.gather(
                *(self._publish_vhost(vhost, items) for vhost, items in by_vhost.items())
            )
        to_recreate: list[tuple[Claimed, Result, Tried]] = []
        answered = utcnow()
        for item, result, ms in (row for batch in results for row in batch):
            settlement.ms[item.id] = ms
            if result.outcome is Outcome.CONFIRMED:
                settlement.published.append(item.id)
                settlement.published_to_consumers += item.consumer_uuid is not None
            elif result.outcome is Outcome.REFUSED:
                DELIVERIES.labels(outcome="nacked").inc()
                error = result.error or "nacked by the broker"
                self._retry_later(settlement, item, error, Tried(answered, ms, "nacked"))
            elif result.outcome is Outcome.REJECTED:
                settlement.rejected[result.error or "rejected"].append(item.id)
            elif result.outcome in (Outcome.RETURNED, Outcome.VHOST_REFUSED):
                status = "returned" if result.outcome is Outcome.RETURNED else None
                to_recreate.append((item, result, Tried(answered, ms, status)))
            else:
                error = result.error or "broker unreachable"
                self._retry_later(settlement, item, error, Tried(answered, ms))
        if to_recreate:
            await self._recreate_queues(settlement, to_recreate)
        if gather and self.settings.relay_settle_interval > 0 and settlement.published:
            self._gather_confirmed(settlement)
            if not (settlement.rejected or settlement.given_up or settlement.retries):
                return  # nothing else to write; the gathered write wakes the waiters
        await self._settle(settlement)

    async def _publish_vhost(
        self, vhost: str, items: list[Claimed]
    ) -> list[tuple[Claimed, Result, int]]:
        """Each copy's answer, and how long the vhost's batch took to be answered (ms): each
        copy's attempt, as its attempt log keeps it."""
        outgoing = [event_message(item) for item in items]
        started = time.perf_counter()
        try:
            results = await self.publisher.publish(vhost, outgoing)
        except Exception as exc:
            # Whatever went wrong, the claimed copies are retried, never left to the lease.
            log.error("relay_publish_failed", vhost=vhost, error=repr(exc)[:500])
            results = [Result(Outcome.UNREACHABLE, f"publish failed: {exc!r}"[:500])] * len(items)
        ms = round((time.perf_counter() - started) * 1000)
        return [(item, result, ms) for item, result in zip(items, results, strict=True)]

    def _too_old(self, last_error: str | None) -> str:
        reason = f"not confirmed within delivery_max_age ({self.settings.delivery_max_age:g} s)"
        return f"{reason}; last error: {last_error}" if last_error else reason

    def _retry_later(
        self, settlement: _Settlement, item: Claimed, error: str, tried: Tried
    ) -> None:
        now = utcnow()
        if now - item.created > self._max_age:
            settlement.given_up.append(GivenUp(item.id, self._too_old(error), "too_old", tried))
            return
        delay = min(
            self.settings.relay_backoff_max,
            self.settings.relay_backoff_base * 2 ** max(item.attempts - 1, 0),
        )
        delay *= random.uniform(0.5, 1.0)  # noqa: S311 - jitter, not security
        when = not_past_give_up(now, delay, item.created, self._max_age)
        settlement.retries.append(Retry(item.id, when, error, tried))
        DELIVERIES.labels(outcome="retried").inc()

    async def _recreate_queues(
        self, settlement: _Settlement, returned: list[tuple[Claimed, Result, Tried]]
    ) -> None:
        """Declare the queues of returned copies again, then retry those copies."""
        async with self.engine.connect() as connection:
            alive = await repository.existing_targets(
                connection, {target for item, _, _ in returned if (target := _target(item))}
            )
        failures: dict[tuple[str, str], str | None] = {}
        for item, _result, _tried in returned:
            key = (item.vhost, item.queue_name)
            if _target(item) not in alive or key in failures:
                continue
            try:
                outcome = await self.provisioner.ensure_queue(item.vhost, item.queue_name)
            except QueueConflict as exc:
                failures[key] = f"queue could not be re-declared: {exc.reason}"
            except ForeignVhost as exc:
                failures[key] = f"vhost {exc.vhost!r} is not ours ({exc.reason}); not touched"
            except ManagementError as exc:
                failures[key] = f"queue could not be re-declared: {exc}"
            except Exception as exc:  # anything else: retried with backoff, reason kept
                failures[key] = f"queue could not be re-declared: {exc!r}"[:500]
            else:
                failures[key] = None
                log.warning(
                    "queue_redeclared_after_return",
                    vhost=item.vhost,
                    queue=item.queue_name,
                    broker=outcome.value,
                )
        now = utcnow()
        for item, result, tried in returned:
            DELIVERIES.labels(outcome="returned").inc()
            if _target(item) not in alive:
                settlement.given_up.append(GivenUp(item.id, QUEUE_GONE, "queue_gone", tried))
                continue
            failure = failures[(item.vhost, item.queue_name)]
            error = f"{result.error}; " + (failure or "queue declared again, retrying")
            if failure is None and item.attempts <= IMMEDIATE_RETRIES:
                settlement.retries.append(Retry(item.id, now, error, tried))
            else:
                self._retry_later(settlement, item, error, tried)

    def _gather_confirmed(self, settlement: _Settlement) -> None:
        """Leave the settlement's confirmed copies to `_write_confirmed_loop`; at once when a
        `?wait=true` request of this process waits for copies to settle."""
        confirmed = utcnow()
        self._confirmed.extend((i, confirmed, settlement.ms.get(i)) for i in settlement.published)
        self._confirmed_to_consumers += settlement.published_to_consumers
        settlement.published, settlement.published_to_consumers = [], 0
        self._confirmed_added.notify()
        if self.signals.waiting:
            self._write_now = True
            self._settle_now.notify()

    async def _write_confirmed_loop(self) -> None:
        """Write gathered confirmed copies published, those of one `relay_settle_interval`
        in one statement: at a backend's pace each batch holds one copy, and its own
        statement was a round trip and a wake-up per event. A copy confirmed and not yet
        written is still pending: a relay that dies before writing it leaves it to its
        lease, published again (at-least-once, as a death between confirm and write
        always was); a stop writes it (`stop`)."""
        while not self._stopping.is_set():
            seen = self._confirmed_added.generation
            if not self._confirmed:
                await self._confirmed_added.wait(HOUSEKEEPING_INTERVAL, since=seen)
                continue
            if not self._write_now:
                await self._settle_now.wait(self.settings.relay_settle_interval)
            if self._stopping.is_set():
                return  # `stop` writes what is left, once the batches in flight are done
            self._write_now = False
            if await self._write_confirmed() is None:  # the database is down: not lost
                await self._settle_now.wait(self.settings.relay_backoff_base)

    async def _write_confirmed(self) -> int | None:
        """Write the gathered confirmed copies published, each `finished` when the broker
        confirmed it; how many, None if it failed (they stay gathered, written with the
        next ones)."""
        confirmed, to_consumers = self._confirmed, self._confirmed_to_consumers
        if not confirmed:
            return 0
        self._confirmed, self._confirmed_to_consumers = [], 0
        try:
            await self.outbox.published_at(confirmed)
        except BaseException as exc:  # a stop cutting the write short included: kept
            self._confirmed[:0] = confirmed
            self._confirmed_to_consumers += to_consumers
            if not isinstance(exc, Exception):
                raise
            log.error("relay_settle_failed", relay=self.id, error=repr(exc)[:500])
            return None
        _count_published(len(confirmed), to_consumers)
        self.signals.settled.notify()
        return len(confirmed)

    async def _settle(self, settlement: _Settlement) -> None:
        now = utcnow()
        rejected = sum(len(ids) for ids in settlement.rejected.values())
        published = len(settlement.published)
        # Each counter moves right after its statement commits (each stands alone), with
        # no await between, so a `?wait=true` waiter never sees rows not yet counted.
        ms = settlement.ms
        if published:
            await self.outbox.publish(
                settlement.published, now, [ms.get(i) for i in settlement.published]
            )
            _count_published(published, settlement.published_to_consumers)
        for error, ids in settlement.rejected.items():
            await self.outbox.reject(ids, now, error, [ms.get(i) for i in ids])
            DELIVERIES.labels(outcome="rejected").inc(len(ids))
            _TRIED_FAILED.inc(len(ids))
        await self.outbox.give_up(settlement.given_up, now)
        DELIVERIES.labels(outcome="given_up").inc(len(settlement.given_up))
        _TRIED_FAILED.inc(sum(1 for reason in settlement.given_up if reason.tried is not None))
        await self.outbox.reschedule(self.id, settlement.retries)
        _TRIED_FAILED.inc(len(settlement.retries))
        if settlement.retries:  # written: an idle loop looks for them when due
            self._retry_scheduled(min(retry.next for retry in settlement.retries))
        if rejected or settlement.given_up:
            log.warning(
                "deliveries_not_published",
                rejected=rejected,
                given_up=len(settlement.given_up),
                reasons=sorted({reason.error for reason in settlement.given_up})[:5],
            )
        self.signals.settled.notify()

    # --- housekeeping (after the leases are renewed, events/delivery_loop.py) ---------------
    async def _housekeep(self, rounds: int) -> None:
        await self.refresh_gauges()
        await self.publisher.close_idle()

    async def refresh_gauges(self) -> None:
        now = utcnow()
        async with self.engine.connect() as connection:
            depth = await repository.outbox_depth(connection, now)
            consumers = await repository.consumer_count(connection)
        CONSUMERS.set(consumers)
        OUTBOX_PENDING.set(depth.pending)
        OUTBOX_OLDEST_AGE.set(depth.oldest_pending_age_seconds)
