"""Dead-letter redrive: move dead letters back to their queue, or give them up with a record.

Per vhost of ours: take messages off the dead-letter queue one at a time, held
unacknowledged (the AMQP side is `broker/deadletters.py`), and for each decide:

- its original queue (the `x-death` header) is registered, present and has
  room: publish a copy there (persistent, mandatory, confirmed) and only then
  acknowledge the dead letter. A crash in between leaves both copies, never
  none: consumers deduplicate on `message_id`.
- it is older than `redrive_max_age_seconds`, was redriven
  `redrive_max_attempts` times already, has no `x-death`, or its queue is no
  longer registered: write a given-up record, commit, then acknowledge it.
- otherwise (its queue is full, or registered but missing on the broker until
  the next reconcile) it is held unacknowledged and returned to the dead-letter
  queue, in order, when the vhost is done.

A run handles the messages that were in the queue when it reached the vhost
(at most `redrive_max_messages`); what arrives meanwhile waits for the next.

A dead letter goes back only to whom may receive it as the directory stands when it is
published (docs/decisions/029-judged-as-it-leaves.md): each queue's owner is judged once
when the run meets it, under the access epoch read first, and every batch is published
only after one statement proves nothing the rule reads changed since (else its queues are
judged again, and the refused given up as `not_authorized`).
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, Literal

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.broker import census, topology
from queuekeeper.broker.deadletters import DeadLetter, DeadLetterQueue, QueueFull, Unroutable
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.broker.sieve import EVENT_HEADER, OFFERING_HEADER
from queuekeeper.config import Settings
from queuekeeper.deadletters import repository
from queuekeeper.deadletters.schemas import DeadLetterQueueOut, DeadLettersOut, GivenUpOut
from queuekeeper.exceptions import NotFound, shown
from queuekeeper.jobs.runs import Job, JobBody, JobContext, JobRunner, Run, describe
from queuekeeper.jobs.service import run_now
from queuekeeper.models import GivenUpDeadLetter, JobRun, utcnow
from queuekeeper.observability.metrics import DEAD_LETTERS

log = structlog.get_logger(__name__)

REDRIVE_HEADER = "x-queuekeeper-redrives"
BATCH = 100  # confirms awaited together, given-up records committed together

Kind = Literal["redrive", "give_up", "leave"]


@dataclass
class Verdict:
    kind: Kind
    origin: str | None
    code: str = ""
    reason: str = ""


@dataclass
class Target:
    """An original queue, as far as this run knows it."""

    registered: bool
    present: bool
    away: bool = False  # no consumer (queue_presence): its copies park meanwhile
    offerings: frozenset[str] = frozenset()  # hex: those its owner may receive now
    every_offering: bool = False  # a global consumer's: its owner may receive them all
    depth: int = 0
    sent: int = 0
    full: bool = False
    reported: bool = False
    # The access epoch read before the owner was judged, and the time judged at: what a
    # batch's check proves unchanged (docs/decisions/029-judged-as-it-leaves.md).
    epoch: int | None = None
    judged_at: datetime | None = None


def count_change(counter: str) -> None:
    if counter in ("redriven", "given_up"):
        DEAD_LETTERS.labels(outcome=counter).inc()


def redrive_body(vhost: str | None) -> JobBody | None:
    """The body of a redrive of one vhost; None (the table's) for every vhost."""
    return partial(redrive, only=vhost) if vhost is not None else None


def checked_vhost(vhost: str | None) -> None:
    """A `vhost` parameter that cannot name one of our vhosts is not found, before any
    broker call: no caller's value reaches a Management API path unchecked."""
    if vhost is not None and not topology.is_vhost_name(vhost):
        raise NotFound(
            f"vhost {shown(vhost)} is not one of this installation's vhosts (named by their "
            "owner's uuid as 32 lowercase hex digits).",
            field="vhost",
        )


async def redrive_now(jobs: JobRunner, vhost: str | None, *, background: bool) -> JobRun:
    """The admin API's redrive; NotFound for a vhost that is not this installation's."""
    checked_vhost(vhost)
    if vhost is not None and not await jobs.context.provisioner.owns_vhost(vhost):
        raise NotFound(
            f"vhost {shown(vhost)} is not one of this installation's vhosts "
            f"(tagged {jobs.context.settings.instance_tag!r}).",
            field="vhost",
        )
    return await run_now(jobs, Job.REDRIVE, background=background, body=redrive_body(vhost))


async def redrive(
    context: JobContext, run: Run, only: str | None = None, queue: str | None = None
) -> None:
    """Every vhost's dead letters; `only` one vhost's; with `queue`, only that queue's, as
    the release of a returning agent's parked copies does first (contract §11)."""
    vhosts = await context.provisioner.owned_vhosts()
    if only is not None:
        if only not in vhosts:
            run.fail(only, "no such vhost of this installation")
            return
        vhosts = [only]
    for done, vhost in enumerate(vhosts, 1):
        async with run.item(vhost), DeadLetterQueue.open(context.settings, vhost) as dlq:
            await VhostRedrive(context, run, vhost, dlq, queue).execute()
        run.report("vhosts", done, len(vhosts))


class VhostRedrive:
    def __init__(
        self,
        context: JobContext,
        run: Run,
        vhost: str,
        dlq: DeadLetterQueue,
        queue: str | None = None,
    ) -> None:
        self.context, self.settings, self.run = context, context.settings, run
        self.vhost, self.dlq = vhost, dlq
        self.queue = queue
        self.targets: dict[str, Target] = {}
        self.held: list[DeadLetter] = []
        self.now = utcnow()

    async def execute(self) -> None:
        settings = self.settings
        depth = await self.dlq.depth()
        if depth is None:
            self.run.find("dead_letter_queues_missing")
            return
        self.run.find("dead_letters", depth)
        if not depth:
            return
        redrives: list[tuple[DeadLetter, str]] = []
        give_ups: list[tuple[DeadLetter, GivenUpDeadLetter]] = []
        try:
            wanted = min(depth, settings.redrive_max_messages)
            for taken in range(wanted):
                message = await self.dlq.take()
                if message is None:
                    # Fewer than declared: another reader (a dead-letter census, another redrive)
                    # holds the rest unacknowledged for now; a release must try again.
                    self.run.find("held_elsewhere", wanted - taken)
                    break
                self.run.find("examined")
                verdict = await self.judge(message)
                if verdict.kind == "redrive" and verdict.origin:
                    redrives.append((message, verdict.origin))
                elif verdict.kind == "give_up":
                    give_ups.append((message, self._record(message, verdict)))
                else:
                    self.run.find(f"left_{verdict.code}")
                    self.held.append(message)
                if len(redrives) >= BATCH:
                    await self.flush_redrives(redrives)
                if len(give_ups) >= BATCH:
                    await self.flush_give_ups(give_ups)
            await self.flush_redrives(redrives)
            await self.flush_give_ups(give_ups)
        finally:
            # Back to the dead-letter queue, in order (a closed channel would do it too).
            for message in self.held:
                with suppress(Exception):
                    await message.give_back()

    async def judge(self, message: DeadLetter) -> Verdict:
        settings = self.settings
        headers = message.headers
        deaths = census.deaths(headers)
        origin = census.origin(headers, deaths)
        redriven = _int(headers.get(REDRIVE_HEADER))
        born = message.timestamp or _first_death(deaths)
        if not origin:
            if self.queue is not None:
                return Verdict("leave", None, "other_queue")
            return Verdict("give_up", None, "no_origin", "no x-death header: its queue is unknown")
        if self.queue is not None and origin != self.queue:
            return Verdict("leave", origin, "other_queue")
        if redriven >= settings.redrive_max_attempts:
            return Verdict(
                "give_up",
                origin,
                "too_many_redrives",
                f"redriven {redriven} times already (limit {settings.redrive_max_attempts})",
            )
        if self.queue is None and (await self.target(origin)).away:
            # Its agent is away: sent back now it would only expire again. The release on
            # its return redrives it first, whatever its age (docs/decisions/015-parking.md).
            return Verdict("leave", origin, "agent_away")
        max_age = timedelta(seconds=settings.redrive_max_age_seconds)
        if self.queue is not None:  # a returning agent's: kept as long as its events are
            max_age = settings.event_retention
        if born is not None and self.now - born > max_age:
            return Verdict(
                "give_up",
                origin,
                "too_old",
                f"published {born.isoformat()}, older than {settings.redrive_max_age_seconds} s",
            )
        target = await self.target(origin)
        if not target.registered:
            return Verdict("give_up", origin, "queue_gone", f"queue {origin!r} is not registered")
        if not await self.authorized(origin, target, headers):
            # Published only to whom may receive it now, as every copy is
            # (docs/decisions/021-authorized-when-published.md).
            return _not_authorized(origin, headers)
        if not target.present:
            if not target.reported:
                target.reported = True
                self.run.fail(
                    f"{self.vhost}/{origin}",
                    "registered but missing on the broker: its dead letters stay until a "
                    "reconcile re-creates it",
                )
            return Verdict("leave", origin, "queue_missing")
        if target.full or target.depth + target.sent >= settings.queue_max_length:
            return Verdict("leave", origin, "no_room")
        target.sent += 1
        return Verdict("redrive", origin)

    async def authorized(self, origin: str, target: Target, headers: dict[str, Any]) -> bool:
        """Whether the owner of the queue may receive this dead letter, as judged at
        `target.judged_at`."""
        offering = str(headers.get(OFFERING_HEADER) or "")
        if target.every_offering or (offering and offering in target.offerings):
            return True
        return await self.receivable(origin, headers, offering, target.judged_at or self.now)

    async def receivable(
        self, name: str, headers: dict[str, Any], offering: str, now: datetime
    ) -> bool:
        """For a dead letter its queue's offerings do not cover (or that names none): may the
        owner of a consumer queue receive its event now, judged with the event's own keys
        (an order matched through its project, an identity event)? One statement for such a
        dead letter; a legacy queue's offerings say all. An event no longer stored: a copy
        naming an offering stays refused, one naming none goes back, as before the rule."""
        event_id = str(headers.get(EVENT_HEADER) or "")
        if not event_id or topology.consumer_of(name) is None:
            return not offering
        try:
            offering_uuid = uuid.UUID(offering) if offering else None
        except ValueError:
            return False
        async with self.context.sessions() as session:
            verdict = await repository.event_receivable(
                session, self.vhost, name, event_id, offering_uuid, now
            )
        return verdict if verdict is not None else not offering

    async def target(self, name: str) -> Target:
        known = self.targets.get(name)
        if known is not None:
            return known
        async with self.context.sessions() as session:
            registered = await repository.is_registered(session, self.vhost, name)
            away = registered and await repository.is_away(session, self.vhost, name)
        target = Target(registered=registered, present=False, away=away)
        if registered:
            await self.judge_owner(name, target, self.now)
            depth = await self.dlq.depth(name)
            target.present, target.depth = depth is not None, depth or 0
        self.targets[name] = target
        return target

    async def judge_owner(self, name: str, target: Target, now: datetime) -> None:
        """What the queue's owner may receive at `now` (its offerings, or all), under the
        access epoch read just before: the judgment is at least as new as the epoch."""
        async with self.context.sessions() as session:
            epoch, _expired = await repository.access(session, now)
            offerings, every = await repository.receivable_offerings(session, self.vhost, name, now)
        target.offerings, target.every_offering = frozenset(offerings), every
        target.epoch, target.judged_at = epoch, now

    async def judged_now(self, batch: list[tuple[DeadLetter, str]]) -> list[tuple[DeadLetter, str]]:
        """The batch's dead letters whose owner may receive them as the directory stands
        now: one statement proves each queue's judgment still holds (the access epoch
        unchanged, no role or token expired since); the queues it cannot prove are judged
        again, and their refused dead letters given up (docs/decisions/029-...)."""
        now = utcnow()
        async with self.context.sessions() as session:
            epoch, expired = await repository.access(session, now)
        kept: list[tuple[DeadLetter, str]] = []
        refused: list[tuple[DeadLetter, GivenUpDeadLetter]] = []
        judged: set[str] = set()
        for message, origin in batch:
            target = self.targets[origin]
            proven = target.epoch == epoch and (
                expired is None or (target.judged_at is not None and expired <= target.judged_at)
            )
            if not proven and origin not in judged:
                await self.judge_owner(origin, target, now)
                judged.add(origin)
            headers = message.headers
            if origin not in judged or await self.authorized(origin, target, headers):
                kept.append((message, origin))
            else:
                target.sent -= 1
                refused.append((message, self._record(message, _not_authorized(origin, headers))))
        await self.flush_give_ups(refused)
        return kept

    async def flush_redrives(self, batch: list[tuple[DeadLetter, str]]) -> None:
        if not batch:
            return
        batch[:] = await self.judged_now(batch)
        results = await self.dlq.publish(
            [(message, origin, _redriven_headers(message)) for message, origin in batch]
        )
        for (message, origin), result in zip(batch, results, strict=True):
            item = f"{self.vhost}/{origin}"
            if result is not None:
                self.held.append(message)
                target = self.targets[origin]
                target.sent -= 1
                if isinstance(result, QueueFull):
                    target.full = True
                    reason = (
                        "the queue refused it (full); it stays in the dead-letter queue, "
                        "and the broker may have dead-lettered a second copy"
                    )
                elif isinstance(result, Unroutable):
                    target.present = False
                    reason = "unroutable: the queue vanished; it stays in the dead-letter queue"
                else:
                    reason = describe(result)
                self.run.fail(item, reason)
                continue
            await message.ack()  # only now: the copy is confirmed in its queue
            self.run.done("redriven", "redrive", item, f"message {message.message_id or '-'}")
        batch.clear()

    def _record(self, message: DeadLetter, verdict: Verdict) -> GivenUpDeadLetter:
        deaths = census.deaths(message.headers)
        return GivenUpDeadLetter(
            vhost=self.vhost,
            original_queue=verdict.origin,
            reason=f"{verdict.code}: {verdict.reason}",
            death_count=sum(_int(death.get("count")) for death in deaths),
            first_death_at=_first_death(deaths),
            message_id=(message.message_id or None),
            body_size=message.size,
            recorded=utcnow(),
        )

    async def flush_give_ups(self, batch: list[tuple[DeadLetter, GivenUpDeadLetter]]) -> None:
        if not batch:
            return
        # The record is committed before the message is acknowledged: a crash between
        # the two records it twice, never zero times.
        async with self.context.sessions() as session:
            repository.record_given_up(session, [record for _, record in batch])
            await session.commit()
        for message, record in batch:
            await message.ack()
            self.run.done(
                "given_up",
                "give_up",
                f"{self.vhost}/{record.original_queue or '?'}",
                record.reason,
            )
        batch.clear()


def _redriven_headers(message: DeadLetter) -> dict[str, Any]:
    headers = dict(message.headers)
    # A string: RabbitMQ's STOMP adapter passes string headers on to agents, not numbers.
    headers[REDRIVE_HEADER] = str(_int(headers.get(REDRIVE_HEADER)) + 1)
    return headers


def _not_authorized(origin: str, headers: dict[str, Any]) -> Verdict:
    offering = str(headers.get(OFFERING_HEADER) or "")
    return Verdict(
        "give_up",
        origin,
        "not_authorized",
        f"the queue's owner may no longer receive events of offering {offering}"
        if offering
        else "the queue's owner may no longer receive this event",
    )


def _first_death(deaths: list[dict[str, Any]]) -> datetime | None:
    times = [_aware(death.get("time")) for death in deaths]
    known = [time for time in times if time is not None]
    return min(known) if known else None


def _aware(value: Any) -> datetime | None:
    if not isinstance(value, datetime):
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


async def dead_letters(
    session: AsyncSession,
    provisioner: Provisioner,
    settings: Settings,
    *,
    vhost: str | None,
    offset: int,
    limit: int,
) -> DeadLettersOut:
    """Each vhost's dead-letter count, and a page of the dead letters given up."""
    checked_vhost(vhost)
    queues = await dead_letter_counts(provisioner, settings, vhost)
    total, given_up = await repository.list_given_up(
        session, vhost=vhost, offset=offset, limit=limit
    )
    return DeadLettersOut(
        total_messages=sum(queue.messages or 0 for queue in queues),
        vhosts=queues,
        given_up_total=total,
        given_up=[GivenUpOut.from_row(record) for record in given_up],
    )


async def dead_letter_counts(
    provisioner: Provisioner, settings: Settings, only: str | None = None
) -> list[DeadLetterQueueOut]:
    """Each vhost's dead-letter queue as the Management API sees it (stats lag a few seconds)."""
    vhosts = await provisioner.owned_vhosts()
    if only is not None:
        vhosts = [vhost for vhost in vhosts if vhost == only]
    limit = asyncio.Semaphore(8)
    columns = "name,messages,messages_ready,messages_unacknowledged,consumers"

    async def one(vhost: str) -> DeadLetterQueueOut:
        async with limit:
            info = await provisioner.management.get_queue(vhost, settings.dlq_name, columns=columns)
        return DeadLetterQueueOut.from_info(vhost, settings.dlq_name, info)

    return list(await asyncio.gather(*(one(vhost) for vhost in vhosts)))
