"""The in-process scheduler (APScheduler 3.11): runs the jobs of the table it is given.

Each job's first run comes one interval after start-up, never at start-up, so a
fleet restarting together does not reconcile all at once (jitter spreads the
rest). `coalesce` and `max_instances=1` keep one run per job in this process;
the advisory lock in `run_job` keeps one across replicas.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from queuekeeper.jobs.runs import Job, JobContext, JobSpec, JobTable, Trigger, run_job

log = structlog.get_logger(__name__)


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
        log.info("scheduler_started", jobs={job.value: s for job, s in self.intervals.items()})

    async def stop(self) -> None:
        """Stop firing; a run in progress is cancelled and records itself as interrupted."""
        if self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        for task in list(self._running):
            task.cancel()
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        log.info("scheduler_stopped")

    async def _run(self, spec: JobSpec) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
        try:
            await run_job(self.context, spec, Trigger.SCHEDULE)
        except asyncio.CancelledError:
            raise
        except Exception:  # the run records its own failure; never kill the scheduler
            log.exception("scheduled_job_error", job=spec.name.value)
        finally:
            if task is not None:
                self._running.discard(task)
