"""The in-process scheduler (APScheduler 3.11): runs the jobs of the table it is given.

Each job's first run comes one interval after start-up, never at start-up, so a
fleet restarting together does not reconcile all at once (jitter spreads the
rest). `coalesce` and `max_instances=1` keep one run per job in this process;
the advisory lock in `run_job` keeps one across replicas. A job with a wake source
(`JobSpec.wake`) also runs as soon as it says, one run at a time in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from queuekeeper.jobs.runs import (
    Job,
    JobContext,
    JobSpec,
    JobTable,
    RunStatus,
    Trigger,
    WakeSource,
    run_job,
)

log = structlog.get_logger(__name__)

# A woken run that found the lock held tries again after this: the run holding it may have
# read its work before the change that woke this one committed.
WAKE_RETRY_SECONDS = 1.0
# A wake source that failed (the database unreachable) starts again after this; the
# interval's runs go on meanwhile.
WAKE_RESTART_SECONDS = 5.0


@dataclass(frozen=True)
class ScheduledJob:
    name: Job
    interval_seconds: int
    next_run: datetime | None  # None before the scheduler starts or once it stopped


class JobScheduler:
    def __init__(self, context: JobContext, table: JobTable) -> None:
        self.context = context
        self.intervals = {
            job: seconds
            for job, spec in table.items()
            if (seconds := spec.interval(context.settings)) > 0
        }
        self._scheduler = AsyncIOScheduler(
            timezone=UTC,
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 600},
        )
        self._running: set[asyncio.Task[Any]] = set()
        self._woken = [spec for spec in table.values() if spec.wake is not None]
        self._stopping = asyncio.Event()
        self._wake_tasks: list[asyncio.Task[None]] = []
        for job, seconds in self.intervals.items():
            # At most a quarter of the interval: a job every 10 s must not wait a minute.
            jitter = min(context.settings.scheduler_jitter_seconds, seconds // 4) or None
            self._scheduler.add_job(
                self._run,
                IntervalTrigger(seconds=seconds, jitter=jitter, timezone=UTC),
                args=[table[job]],
                id=job.value,
                name=job.value,
                replace_existing=True,
            )

    def jobs(self) -> list[ScheduledJob]:
        """What is scheduled, and when each job runs next."""
        return [
            ScheduledJob(
                Job(entry.id), self.intervals[Job(entry.id)], getattr(entry, "next_run_time", None)
            )
            for entry in self._scheduler.get_jobs()
        ]

    def start(self) -> None:
        self._scheduler.start()
        self._stopping.clear()
        self._wake_tasks = [
            asyncio.create_task(self._run_when_woken(spec), name=f"wake-{spec.name.value}")
            for spec in self._woken
        ]
        log.info(
            "scheduler_started",
            jobs={job.value: s for job, s in self.intervals.items()},
            woken=[spec.name.value for spec in self._woken],
        )

    async def stop(self) -> None:
        """Stop firing; a run in progress is cancelled and records itself as interrupted."""
        self._stopping.set()
        if self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        for task in [*self._running, *self._wake_tasks]:
            task.cancel()
        if self._running or self._wake_tasks:
            await asyncio.gather(*self._running, *self._wake_tasks, return_exceptions=True)
        self._wake_tasks = []
        log.info("scheduler_stopped")

    async def _run_when_woken(self, spec: JobSpec) -> None:
        """Run `spec` each time its wake source calls, coalescing calls that come during a
        run into one more run after it."""
        wanted = asyncio.Event()
        assert spec.wake is not None
        listening = asyncio.create_task(self._listen(spec.wake, wanted.set))
        try:
            while not self._stopping.is_set():
                await wanted.wait()
                wanted.clear()
                try:
                    record = await run_job(self.context, spec, Trigger.WAKE)
                except asyncio.CancelledError:
                    raise
                except Exception:  # the run records its own failure; the next wake retries
                    log.exception("woken_job_error", job=spec.name.value)
                    continue
                if record.status == RunStatus.SKIPPED.value:
                    await asyncio.sleep(WAKE_RETRY_SECONDS)
                    wanted.set()
        finally:
            listening.cancel()
            await asyncio.gather(listening, return_exceptions=True)

    async def _listen(self, wake: WakeSource, woken: Callable[[], None]) -> None:
        while not self._stopping.is_set():
            try:
                await wake(self.context, woken, self._stopping)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("job_wake_source_failed", error=repr(exc)[:500])
            if self._stopping.is_set():
                return
            woken()  # what was announced while nobody listened
            with suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), WAKE_RESTART_SECONDS)

    async def _run(self, spec: JobSpec) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
        try:
            if spec.nothing_to_do is not None and await spec.nothing_to_do(self.context):
                log.debug("job_nothing_to_do", job=spec.name.value)
                return
            await run_job(self.context, spec, Trigger.SCHEDULE)
        except asyncio.CancelledError:
            raise
        except Exception:  # the run records its own failure; never kill the scheduler
            log.exception("scheduled_job_error", job=spec.name.value)
        finally:
            if task is not None:
                self._running.discard(task)
