"""Running a job once: its lock, its run record, its metrics, and the item-by-item bookkeeping.

Every job (reconcile, stale cleanup, dead-letter redrive) is a coroutine that
takes a `Run` and reports into it; `run_job` wraps it the same way whether the
scheduler, the admin API or the CLI started it.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import structlog
from aiormq.exceptions import AMQPConnectionError
from sqlalchemy.exc import DBAPIError, OperationalError

from queuekeeper.broker.management import BrokerUnavailable, ManagementError
from queuekeeper.broker.provisioner import ForeignVhost, QueueConflict
from queuekeeper.common.locks import job_lock
from queuekeeper.jobs import repository
from queuekeeper.models import JobRun, utcnow
from queuekeeper.observability.metrics import JOB_DURATION, JOB_LAST_SUCCESS, JOB_RUNS
from queuekeeper.state import AppState

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


class Job(enum.StrEnum):
    RECONCILE = "reconcile"
    CLEANUP_STALE = "cleanup_stale"
    REDRIVE = "redrive_dead_letters"


class Trigger(enum.StrEnum):
    SCHEDULE = "schedule"
    API = "api"
    CLI = "cli"


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
        return f"vhost {exc.vhost!r} is not tagged as this installation's (tags: {exc.tags})"
    if isinstance(exc, ManagementError):
        return str(exc) if not exc.reason or exc.reason in str(exc) else f"{exc}: {exc.reason}"
    text = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _unreachable(exc: BaseException) -> bool:
    if isinstance(exc, BrokerUnavailable):
        return exc.status is None or exc.status in (401, 403)
    return isinstance(exc, AMQPConnectionError | OperationalError | ConnectionError) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    )


@dataclass
class Run:
    """What one run found, did (or, dry, would do), and failed at."""

    job: Job
    trigger: Trigger
    dry_run: bool = False
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


JobBody = Callable[[Run], Awaitable[None]]

# Set by the scheduler around a scheduled run: the job's interval in seconds. Every replica's
# scheduler fires each interval; under the job's lock, a scheduled run that finds one begun
# less than 90 % of an interval ago does nothing, so the job runs once per interval overall.
SCHEDULED_EVERY: ContextVar[float | None] = ContextVar("scheduled_every", default=None)


async def run_job(
    state: AppState,
    job: Job,
    trigger: Trigger,
    body: JobBody,
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
    on_change: Callable[[str], None] | None = None,
) -> JobRun:
    """Run `body` under the job's lock and record the run; returns the stored record."""
    run = Run(job=job, trigger=trigger, dry_run=dry_run, progress=progress, on_change=on_change)
    started = utcnow()
    clock = time.perf_counter()
    async with job_lock(state.engine, job.value) as acquired:
        if acquired and trigger is Trigger.SCHEDULE:
            every = SCHEDULED_EVERY.get()
            async with state.sessions() as session:
                last = await repository.last_started(session, job.value, trigger.value)
            if every and last is not None and started - last < timedelta(seconds=every * 0.9):
                # Another replica's scheduler ran it within this interval: one run per
                # interval across replicas, not one per replica. Not recorded (it is the
                # normal case with replicas); counted and logged.
                JOB_RUNS.labels(job=job.value, status="not_due").inc()
                log.info("job_not_due", job=job.value, last_started=last.isoformat())
                return JobRun(
                    uuid=uuid.uuid4(),
                    job=job.value,
                    trigger=trigger.value,
                    dry_run=dry_run,
                    started=started,
                    finished=utcnow(),
                    status=RunStatus.SKIPPED.value,
                    found={},
                    changed={},
                    actions=[],
                    failures=[],
                )
        if not acquired:
            record = JobRun(
                uuid=uuid.uuid4(),
                job=job.value,
                trigger=trigger.value,
                dry_run=dry_run,
                started=started,
                finished=utcnow(),
                status=RunStatus.SKIPPED.value,
                found={},
                changed={},
                actions=[],
                failures=[
                    {
                        "item": job.value,
                        "reason": "another run of this job is in progress (on this or another "
                        "replica); this one did nothing",
                    }
                ],
            )
            async with state.sessions() as session:
                await repository.insert_run(session, record)
            JOB_RUNS.labels(job=job.value, status=RunStatus.SKIPPED.value).inc()
            log.info("job_skipped", job=job.value, trigger=trigger.value)
            return record

        async with state.sessions() as session:
            # We hold the job's lock, so a record still "running" belongs to a run that died.
            await repository.close_interrupted(session, job.value)
            record = JobRun(
                uuid=uuid.uuid4(),
                job=job.value,
                trigger=trigger.value,
                dry_run=dry_run,
                started=started,
                status=RunStatus.RUNNING.value,
                found={},
                changed={},
                actions=[],
                failures=[],
            )
            await repository.insert_run(session, record)
        log.info("job_started", job=job.value, trigger=trigger.value, dry_run=dry_run)

        status = RunStatus.FAILED
        try:
            await body(run)
            status = RunStatus.PARTIAL if run.failures else RunStatus.SUCCEEDED
        except RunAborted as exc:
            run.fail(job.value, str(exc))
        except asyncio.CancelledError:
            run.fail(job.value, "interrupted: the service stopped during the run")
            await asyncio.shield(_finish(state, record, run, RunStatus.FAILED, clock))
            raise
        except Exception as exc:
            log.exception("job_failed", job=job.value)
            run.fail(job.value, describe(exc))
        return await _finish(state, record, run, status, clock)


async def _finish(
    state: AppState, record: JobRun, run: Run, status: RunStatus, clock: float
) -> JobRun:
    found, changed, actions, failures = run.outcome()
    record.finished = utcnow()
    record.status = status.value
    record.found, record.changed, record.actions, record.failures = (
        found,
        changed,
        actions,
        failures,
    )
    try:
        async with state.sessions() as session:
            await repository.save_run(session, record)
    except Exception:
        log.exception("job_record_not_saved", job=run.job.value, run=record.uuid.hex)
    seconds = time.perf_counter() - clock
    JOB_RUNS.labels(job=run.job.value, status=status.value).inc()
    JOB_DURATION.labels(job=run.job.value).observe(seconds)
    if status is RunStatus.SUCCEEDED and not run.dry_run:
        JOB_LAST_SUCCESS.labels(job=run.job.value).set(time.time())
    log.info(
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
