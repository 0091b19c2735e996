"""The in-process scheduler (APScheduler 3.11): reconcile, stale cleanup, and optionally redrive.

Each job's first run comes one interval after start-up, never at start-up, so a
fleet restarting together does not reconcile all at once (jitter spreads the
rest). `coalesce` and `max_instances=1` keep one run per job in this process;
the advisory lock in `run_job` keeps one at a time across replicas, and the last run's
start time (read under that lock) keeps one per interval.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC
from typing import Any

import structlog
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from queuekeeper.jobs.runs import SCHEDULED_EVERY, Job, Trigger
from queuekeeper.models import JobRun
from queuekeeper.state import AppState

log = structlog.get_logger(__name__)

JobStarter = Callable[[AppState, Trigger], Awaitable[JobRun]]


def _starters() -> dict[Job, JobStarter]:
    # Imported here: the job modules import this package's run helpers.
    from queuekeeper.deadletters.service import run_redrive
    from queuekeeper.reconcile.service import run_reconcile
    from queuekeeper.reconcile.stale import run_cleanup_stale

    return {
        Job.RECONCILE: lambda state, trigger: run_reconcile(state, trigger),
        Job.CLEANUP_STALE: lambda state, trigger: run_cleanup_stale(state, trigger),
        Job.REDRIVE: lambda state, trigger: run_redrive(state, trigger),
    }


def intervals(state: AppState) -> dict[Job, int]:
    settings = state.settings
    configured = {
        Job.RECONCILE: settings.reconcile_interval_seconds,
        Job.CLEANUP_STALE: settings.stale_cleanup_interval_seconds,
        Job.REDRIVE: settings.redrive_interval_seconds,
    }
    return {job: seconds for job, seconds in configured.items() if seconds > 0}


class JobScheduler:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.scheduler = AsyncIOScheduler(
            timezone=UTC,
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 600},
        )
        self._starters = _starters()
        self._running: set[asyncio.Task[Any]] = set()
        jitter = state.settings.scheduler_jitter_seconds or None
        for job, seconds in intervals(state).items():
            self.scheduler.add_job(
                self._run,
                IntervalTrigger(seconds=seconds, jitter=jitter, timezone=UTC),
                args=[job],
                id=job.value,
                name=job.value,
                replace_existing=True,
            )

    def start(self) -> None:
        self.scheduler.start()
        log.info(
            "scheduler_started",
            jobs={job.value: seconds for job, seconds in intervals(self.state).items()},
        )

    async def stop(self) -> None:
        """Stop firing; a run in progress is cancelled and records itself as interrupted."""
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        for task in list(self._running):
            task.cancel()
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        log.info("scheduler_stopped")

    async def _run(self, job: Job) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
        token = SCHEDULED_EVERY.set(intervals(self.state)[job])
        try:
            await self._starters[job](self.state, Trigger.SCHEDULE)
        except asyncio.CancelledError:
            raise
        except Exception:  # the run records its own failure; never kill the scheduler
            log.exception("scheduled_job_error", job=job.value)
        finally:
            SCHEDULED_EVERY.reset(token)
            if task is not None:
                self._running.discard(task)
