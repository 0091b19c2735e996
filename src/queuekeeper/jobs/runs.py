"""Running a job once: its lock, its run record, its metrics, and the item-by-item bookkeeping.

A job is a `JobSpec`: a name, a body (a coroutine that takes a `JobContext` and a
`Run` and reports into the run), the setting that schedules it and its metric
hook. This package knows none of them: the composition root (`app.py`) holds the
table. `run_job` wraps a body the same way whether the scheduler, the admin API
or the CLI started it; `JobRunner` starts runs for the API and the CLI, in the
foreground or in a tracked background task.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

import structlog
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from queuekeeper.broker.amqp import connection_lost
from queuekeeper.broker.management import BrokerUnavailable, ManagementClient, ManagementError
from queuekeeper.broker.provisioner import ForeignVhost, Provisioner, QueueConflict
from queuekeeper.common.locks import job_lock
from queuekeeper.config import Settings
from queuekeeper.exceptions import NotFound
from queuekeeper.jobs import repository
from queuekeeper.models import JobRun, utcnow
from queuekeeper.observability.metrics import JOB_DURATION, JOB_LAST_SUCCESS, JOB_RUNS

log = structlog.get_logger(__name__)

# A run record keeps at most this many actions and failures; the logs have them all.
MAX_RECORDED = 1000
# Consecutive "cannot reach the broker or the database" failures that end a run early:
# with a dependency down, going on only multiplies timeouts.
MAX_UNREACHABLE_IN_A_ROW = 3

Progress = Callable[[str, int, int], None]  # (what, done, total)
T = TypeVar("T")


def chunked(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# The names run records are filed under; the bodies are in the job table (`app.py`).
class Job(enum.StrEnum):
    RECONCILE = "reconcile"
    CLEANUP_STALE = "cleanup_stale"
    REDRIVE = "redrive_dead_letters"
    REVOKE_EXPIRED = "revoke_expired"
    RETENTION = "retention"
    PRESENCE = "presence"
    SWEEP_ACCESS = "sweep_access"


class Trigger(enum.StrEnum):
    SCHEDULE = "schedule"
    API = "api"
    CLI = "cli"
    # A returning agent's release redrives its queue's dead letters first (contract §11):
    # never "not due", whatever the scheduled redrive did this interval.
    RELEASE = "release"
    # The job's wake source announced a change (`JobSpec.wake`): never "not due" either.
    WAKE = "wake"


class RunStatus(enum.StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    PARTIAL = "partial"  # finished, but some items failed (see `failures`)
    FAILED = "failed"  # ended early: a dependency was down, or it was interrupted
    SKIPPED = "skipped"  # another run of the same job held the lock


class RunAborted(Exception):
    """Raised by a job to end its run early (recorded as failed)."""


def describe(exc: BaseException) -> str:
    """The reason to record: the broker's own words when there are any."""
    if isinstance(exc, QueueConflict):
        return exc.reason
    if isinstance(exc, ForeignVhost):
        return f"vhost {exc.vhost!r} left alone: {exc.reason}"
    if isinstance(exc, ManagementError):
        return str(exc) if not exc.reason or exc.reason in str(exc) else f"{exc}: {exc.reason}"
    text = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _unreachable(exc: BaseException) -> bool:
    if isinstance(exc, BrokerUnavailable):
        return exc.status is None or exc.status in (401, 403)
    return (
        connection_lost(exc)
        or isinstance(exc, OperationalError | ConnectionError)
        or (isinstance(exc, DBAPIError) and exc.connection_invalidated)
    )


@dataclass
class Run:
    """What one run found, did (or, dry, would do), and failed at."""

    job: Job
    trigger: Trigger
    dry_run: bool = False
    # Past the deletion guard (reconcile/guard.py): asked for explicitly, never scheduled.
    force: bool = False
    progress: Progress | None = None
    on_change: Callable[[str], None] | None = None  # metric hook, called per real change
    found: Counter[str] = field(default_factory=Counter)
    changed: Counter[str] = field(default_factory=Counter)
    actions: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, str]] = field(default_factory=list)
    dropped_actions: int = 0
    dropped_failures: int = 0
    _unreachable_in_a_row: int = 0

    def find(self, what: str, count: int = 1) -> None:
        if count:
            self.found[what] += count

    def _record_action(self, entry: dict[str, Any]) -> None:
        if len(self.actions) < MAX_RECORDED:
            self.actions.append(entry)
        else:
            self.dropped_actions += 1

    def done(self, counter: str, action: str, item: str, detail: str = "") -> None:
        self.changed[counter] += 1
        self._record_action({"action": action, "item": item, "detail": detail, "planned": False})
        if self.on_change is not None:
            self.on_change(counter)
        log.info("job_change", job=self.job.value, action=action, item=item, detail=detail)

    def planned(self, action: str, item: str, detail: str = "") -> None:
        self._record_action({"action": action, "item": item, "detail": detail, "planned": True})

    async def apply(
        self,
        counter: str,
        action: str,
        item: str,
        operation: Callable[[], Awaitable[object]],
        detail: str = "",
    ) -> None:
        """Carry out `operation` and record it, or in a dry run only record the plan."""
        if self.dry_run:
            self.planned(action, item, detail)
            return
        await operation()
        self.done(counter, action, item, detail)

    def fail(self, item: str, reason: str) -> None:
        if len(self.failures) < MAX_RECORDED:
            self.failures.append({"item": item, "reason": reason})
        else:
            self.dropped_failures += 1
        if self.on_change is not None:
            self.on_change("failures")
        log.warning("job_item_failed", job=self.job.value, item=item, reason=reason)

    @asynccontextmanager
    async def item(self, item: str) -> AsyncIterator[None]:
        """One item's work: a failure is recorded and the run goes on with the next item."""
        try:
            yield
        except (RunAborted, asyncio.CancelledError):
            raise
        except Exception as exc:
            if not isinstance(exc, ManagementError | QueueConflict | ForeignVhost):
                log.exception("job_item_error", job=self.job.value, item=item)
            self.fail(item, describe(exc))
            if _unreachable(exc):
                self._unreachable_in_a_row += 1
                if self._unreachable_in_a_row >= MAX_UNREACHABLE_IN_A_ROW:
                    raise RunAborted(
                        f"stopped after {self._unreachable_in_a_row} failures in a row "
                        f"reaching a dependency; last: {describe(exc)}"
                    ) from exc
        else:
            self._unreachable_in_a_row = 0

    def report(self, what: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(what, done, total)

    def outcome(self) -> tuple[dict[str, int], dict[str, int], list[Any], list[Any]]:
        failures = list(self.failures)
        if self.dropped_failures:
            failures.append(
                {"item": "…", "reason": f"{self.dropped_failures} more failures; see the logs"}
            )
        actions = list(self.actions)
        if self.dropped_actions:
            actions.append(
                {"action": "…", "item": "…", "detail": f"{self.dropped_actions} more; see the logs"}
            )
        return dict(self.found), dict(self.changed), actions, failures


@dataclass(frozen=True)
class JobContext:
    """What job bodies use; the composition root builds it."""

    settings: Settings
    engine: AsyncEngine  # the job locks, and the autocommit reader of long runs
    sessions: async_sessionmaker[AsyncSession]
    management: ManagementClient
    provisioner: Provisioner


JobBody = Callable[[JobContext, Run], Awaitable[None]]
# Calls its second argument whenever the job should run now, until its third is set;
# returns when it can no longer tell (a lost connection), and the scheduler starts it again.
WakeSource = Callable[[JobContext, Callable[[], None], asyncio.Event], Awaitable[None]]


def _never(settings: Settings) -> int:
    return 0


@dataclass(frozen=True)
class JobSpec:
    """One job: its body, how often the scheduler runs it, and its metric hook."""

    name: Job
    body: JobBody
    # Seconds between scheduled runs, read from the settings; 0 or less: on demand only.
    interval: Callable[[Settings], int] = _never
    on_change: Callable[[str], None] | None = None  # called per real change (metrics)
    # A frequent check (every few seconds): a run that finds and changes nothing, or is
    # skipped, leaves no run record and logs at debug, so records and logs show only work;
    # a scheduled or woken run is written only when it ends having found something.
    # With no record of its last run it is never "not due": each replica runs it every
    # interval, one at a time under the lock (it must be cheap when there is nothing to do).
    quiet: bool = False
    # Besides every interval, the scheduler runs the job as soon as this says (a NOTIFY).
    wake: WakeSource | None = None
    # A quiet job's cheaper look before each scheduled run: True leaves the run out (no
    # lock, no record). Runs asked for (API, CLI) or woken always run.
    nothing_to_do: Callable[[JobContext], Awaitable[bool]] | None = None


JobTable = Mapping[Job, JobSpec]
Started = Callable[[JobRun], None]


async def _ran_this_interval(context: JobContext, job: JobSpec, now: datetime) -> bool:
    """A scheduled run of `job` began less than 90 % of its interval ago (read under the
    job's lock, so two replicas cannot both miss each other's run)."""
    every = job.interval(context.settings)
    if every <= 0:
        return False
    async with context.sessions() as session:
        last = await repository.last_started(session, job.name.value, Trigger.SCHEDULE.value)
    return last is not None and now - last < timedelta(seconds=every * 0.9)


async def run_job(
    context: JobContext,
    job: JobSpec,
    trigger: Trigger,
    *,
    dry_run: bool = False,
    force: bool = False,
    progress: Progress | None = None,
    started: Started | None = None,
) -> JobRun:
    """Run the job's body under its lock and record the run; returns the stored record.

    `started` is called with the record once it is stored: running, or skipped.
    """
    name = job.name
    run = Run(
        job=name,
        trigger=trigger,
        dry_run=dry_run,
        force=force,
        progress=progress,
        on_change=job.on_change,
    )
    began = utcnow()
    clock = time.perf_counter()
    async with job_lock(context.engine, name.value) as acquired:
        # Every replica's scheduler fires each interval: the first to get the lock runs, the
        # others find its start and do nothing ("not due"). Not recorded (the normal case
        # with replicas, twice per interval with three); counted and logged.
        not_due = (
            acquired
            and trigger is Trigger.SCHEDULE
            and await _ran_this_interval(context, job, began)
        )
        if not acquired or not_due:
            held = {
                "item": name.value,
                "reason": "another run of this job is in progress (on this or another "
                "replica); this one did nothing",
            }
            record = JobRun(
                uuid=uuid.uuid4(),
                job=name.value,
                trigger=trigger.value,
                dry_run=dry_run,
                started=began,
                finished=utcnow(),
                status=RunStatus.SKIPPED.value,
                found={},
                changed={},
                actions=[],
                failures=[] if not_due else [held],
            )
            if not_due:
                JOB_RUNS.labels(job=name.value, status="not_due").inc()
                log.info("job_not_due", job=name.value)
            else:
                if not job.quiet:
                    async with context.sessions() as session:
                        repository.insert_run(session, record)
                        await session.commit()
                JOB_RUNS.labels(job=name.value, status=RunStatus.SKIPPED.value).inc()
                (log.debug if job.quiet else log.info)(
                    "job_skipped", job=name.value, trigger=trigger.value
                )
            if started is not None:
                started(record)
            return record

        async with context.sessions() as session:
            # We hold the job's lock, so a record still "running" belongs to a run that died.
            await repository.close_interrupted(session, name.value)
            record = JobRun(
                uuid=uuid.uuid4(),
                job=name.value,
                trigger=trigger.value,
                dry_run=dry_run,
                started=began,
                status=RunStatus.RUNNING.value,
                found={},
                changed={},
                actions=[],
                failures=[],
            )
            # A quiet job's scheduled or woken run is written only once it found something:
            # nobody asks for it by id meanwhile, and an idle service then writes nothing.
            written = not (job.quiet and trigger in (Trigger.SCHEDULE, Trigger.WAKE))
            if written:
                repository.insert_run(session, record)
            await session.commit()
        (log.debug if job.quiet else log.info)(
            "job_started", job=name.value, trigger=trigger.value, dry_run=dry_run
        )
        if started is not None:
            started(record)

        status = RunStatus.FAILED
        try:
            await job.body(context, run)
            status = RunStatus.PARTIAL if run.failures else RunStatus.SUCCEEDED
        except RunAborted as exc:
            run.fail(name.value, str(exc))
        except asyncio.CancelledError:
            run.fail(name.value, "interrupted: the service stopped during the run")
            await asyncio.shield(
                _finish(
                    context, record, run, RunStatus.FAILED, clock, quiet=job.quiet, written=written
                )
            )
            raise
        except Exception as exc:
            log.exception("job_failed", job=name.value)
            run.fail(name.value, describe(exc))
        return await _finish(context, record, run, status, clock, quiet=job.quiet, written=written)


async def _finish(
    context: JobContext,
    record: JobRun,
    run: Run,
    status: RunStatus,
    clock: float,
    *,
    quiet: bool = False,
    written: bool = True,
) -> JobRun:
    """Record how the run ended: its record updated (`written`: it was stored when the run
    began) or stored now; a quiet run that found nothing is not kept."""
    found, changed, actions, failures = run.outcome()
    idle = quiet and status is RunStatus.SUCCEEDED and not (found or changed or actions)
    record.finished = utcnow()
    record.status = status.value
    record.found, record.changed, record.actions, record.failures = (
        found,
        changed,
        actions,
        failures,
    )
    try:
        if written or not idle:  # an idle run never written leaves nothing to do
            async with context.sessions() as session:
                if idle:
                    await repository.delete_run(session, record.uuid)
                elif written:
                    await repository.save_run(session, record)
                else:
                    repository.insert_run(session, record)
                await session.commit()
    except Exception:
        log.exception("job_record_not_saved", job=run.job.value, run=record.uuid.hex)
    seconds = time.perf_counter() - clock
    JOB_RUNS.labels(job=run.job.value, status=status.value).inc()
    JOB_DURATION.labels(job=run.job.value).observe(seconds)
    if status is RunStatus.SUCCEEDED and not run.dry_run:
        JOB_LAST_SUCCESS.labels(job=run.job.value).set(time.time())
    (log.debug if idle else log.info)(
        "job_finished",
        job=run.job.value,
        trigger=run.trigger.value,
        status=status.value,
        dry_run=run.dry_run,
        seconds=round(seconds, 3),
        found=found,
        changed=changed,
        failures=len(run.failures) + run.dropped_failures,
    )
    return record


class JobRunner:
    """Starts the table's jobs for the admin API and the CLI.

    `run` answers once the run is over; `start` once its record is stored, the run
    going on in a background task that `stop` cancels (the record then says
    interrupted), so a long run does not hold a request open.
    """

    def __init__(self, context: JobContext, table: JobTable) -> None:
        self.context = context
        self.table = table
        self._background: set[asyncio.Task[JobRun]] = set()

    def spec(self, job: Job, body: JobBody | None = None) -> JobSpec:
        try:
            spec = self.table[job]
        except KeyError:
            raise NotFound(f"No job {job.value!r} in this installation.") from None
        return spec if body is None else replace(spec, body=body)

    async def run(
        self,
        job: Job,
        trigger: Trigger,
        *,
        dry_run: bool = False,
        force: bool = False,
        progress: Progress | None = None,
        body: JobBody | None = None,
    ) -> JobRun:
        """Run now and answer with the finished (or skipped) record."""
        spec = self.spec(job, body)
        return await run_job(
            self.context, spec, trigger, dry_run=dry_run, force=force, progress=progress
        )

    async def start(
        self,
        job: Job,
        trigger: Trigger,
        *,
        dry_run: bool = False,
        force: bool = False,
        body: JobBody | None = None,
    ) -> JobRun:
        """Start a run in the background; answer with its record once stored (or skipped)."""
        spec = self.spec(job, body)
        loop = asyncio.get_running_loop()
        stored: asyncio.Future[JobRun] = loop.create_future()

        def on_started(record: JobRun) -> None:
            if not stored.done():
                stored.set_result(record)

        task = asyncio.create_task(
            run_job(self.context, spec, trigger, dry_run=dry_run, force=force, started=on_started),
            name=f"job-{job.value}",
        )
        self._background.add(task)
        task.add_done_callback(self._finished)
        # The task can end before storing a record (the database is down): its error then.
        await asyncio.wait({task, stored}, return_when=asyncio.FIRST_COMPLETED)
        if stored.done():
            return stored.result()
        return task.result()

    def _finished(self, task: asyncio.Task[JobRun]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_job_error", task=task.get_name(), error=repr(task.exception()))

    async def stop(self) -> None:
        """Cancel the runs still going on in the background; each records itself interrupted."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
