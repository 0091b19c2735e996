"""The scheduler inside the app: it fires, it records, it can be switched off, it stops cleanly."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

import pytest
from asgi_lifespan import LifespanManager
from sqlalchemy import event, select

from queuekeeper.app import Runtime, create_app
from queuekeeper.config import Settings
from queuekeeper.db import create_engine
from queuekeeper.jobs.runs import Job, JobContext, JobSpec, Run, Trigger, run_job
from queuekeeper.jobs.scheduler import JobScheduler
from queuekeeper.models import JobRun, utcnow


def scheduled(state: Runtime) -> JobScheduler:
    assert state.scheduler is not None
    return state.scheduler


async def test_scheduler_fires_reconcile_and_records_the_run(
    settings: Settings, clean_state: None
) -> None:
    fast = settings.model_copy(
        update={"reconcile_interval_seconds": 1, "scheduler_jitter_seconds": 0}
    )
    app = create_app(fast)
    async with LifespanManager(app):
        state: Runtime = app.state.queuekeeper
        jobs = {job.name for job in scheduled(state).jobs()}
        # Redrive is on demand unless an interval is configured.
        assert jobs == {
            Job.RECONCILE,
            Job.CLEANUP_STALE,
            Job.REVOKE_EXPIRED,
            Job.RETENTION,
            Job.PRESENCE,
            Job.SWEEP_ACCESS,
        }
        deadline = time.monotonic() + 10
        while True:
            async with state.sessions() as session:
                runs = list(
                    await session.scalars(
                        select(JobRun).where(JobRun.job == "reconcile").order_by(JobRun.started)
                    )
                )
            if runs and runs[0].finished is not None:
                break
            assert time.monotonic() < deadline, "the scheduler never ran reconcile"
            await asyncio.sleep(0.2)
    [run, *_] = runs
    assert run.job == "reconcile"
    assert run.trigger == "schedule"
    assert run.status == "succeeded"


async def test_first_run_waits_one_interval(settings: Settings, clean_state: None) -> None:
    app = create_app(settings)  # the defaults: hours
    async with LifespanManager(app):
        state: Runtime = app.state.queuekeeper
        next_runs = {job.name: job.next_run for job in scheduled(state).jobs()}
    assert None not in next_runs.values()
    # The frequent checks aside (expiry, access sweep: seconds; presence: a minute), the
    # first run of each job is hours away.
    expiry_check = next_runs.pop(Job.REVOKE_EXPIRED)
    assert expiry_check is not None
    assert (expiry_check - utcnow()).total_seconds() > 3
    sweep = next_runs.pop(Job.SWEEP_ACCESS)  # every 5 s, and woken by access changes
    assert sweep is not None
    assert (sweep - utcnow()).total_seconds() > 3
    presence_check = next_runs.pop(Job.PRESENCE)
    assert presence_check is not None
    assert (presence_check - utcnow()).total_seconds() > 30
    soonest = min(run for run in next_runs.values() if run is not None)
    assert (soonest - utcnow()).total_seconds() > 5 * 3600


@pytest.mark.settings(token_expiry_interval_seconds=1, scheduler_jitter_seconds=0)
async def test_a_quiet_job_that_finds_nothing_leaves_no_run_record(
    settings: Settings, clean_state: None
) -> None:
    app = create_app(settings)
    async with LifespanManager(app):
        state: Runtime = app.state.queuekeeper
        await asyncio.sleep(3.5)  # three runs of revoke_expired, each finding nothing
        async with state.sessions() as session:
            runs = list(await session.scalars(select(JobRun)))
    assert [run.job for run in runs if run.job == "revoke_expired"] == []


async def test_scheduler_can_be_switched_off(settings: Settings, clean_state: None) -> None:
    app = create_app(settings.model_copy(update={"scheduler_enabled": False}))
    async with LifespanManager(app):
        assert app.state.queuekeeper.scheduler is None


async def test_scheduled_redrive_when_an_interval_is_set(
    settings: Settings, clean_state: None
) -> None:
    app = create_app(settings.model_copy(update={"redrive_interval_seconds": 600}))
    async with LifespanManager(app):
        jobs = {job.name: job.interval_seconds for job in scheduled(app.state.queuekeeper).jobs()}
    assert jobs[Job.REDRIVE] == 600


async def test_run_interrupted_by_shutdown_is_recorded_as_failed(
    settings: Settings, clean_state: None
) -> None:
    app = create_app(settings.model_copy(update={"scheduler_enabled": False}))
    started = asyncio.Event()

    async def endless(context: JobContext, run: Run) -> None:
        started.set()
        await asyncio.sleep(3600)

    async with LifespanManager(app):
        state: Runtime = app.state.queuekeeper
        spec = JobSpec(Job.RECONCILE, endless)
        task = asyncio.create_task(run_job(state.jobs.context, spec, Trigger.SCHEDULE))
        # The run's lock and record come first: seconds on a loaded machine.
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        async with state.sessions() as session:
            [record] = list(await session.scalars(select(JobRun)))
    assert record.status == "failed"
    assert record.finished is not None
    assert "interrupted" in record.failures[0]["reason"]


async def test_record_left_running_by_a_dead_process_is_closed_by_the_next_run(
    settings: Settings, clean_state: None
) -> None:
    app = create_app(settings.model_copy(update={"scheduler_enabled": False}))
    async with LifespanManager(app):
        state: Runtime = app.state.queuekeeper
        orphaned = JobRun(uuid=uuid.uuid4(), job="reconcile", trigger="schedule", status="running")
        async with state.sessions() as session:
            session.add(orphaned)
            await session.commit()

        async def nothing(context: JobContext, run: Run) -> None:
            return None

        await run_job(state.jobs.context, JobSpec(Job.RECONCILE, nothing), Trigger.API)
        async with state.sessions() as session:
            stored = await session.get(JobRun, orphaned.uuid)
    assert stored is not None
    assert stored.status == "failed"
    assert "interrupted" in stored.failures[0]["reason"]


async def test_three_replicas_run_each_scheduled_job_once_per_interval(
    settings: Settings, make_client: Any
) -> None:
    """Three schedulers on one database, started out of step: every one fires every
    interval, and the job still runs once per interval, not three times."""
    interval = 2
    began = time.monotonic()
    for _ in range(3):
        await make_client(reconcile_interval_seconds=interval, scheduler_jitter_seconds=0)
        await asyncio.sleep(0.5)
    engine = create_engine(settings)
    try:
        # Until the job has run four times (a loaded machine may start a run late, which the
        # rule allows): polled, not a fixed wait whose count a late run would miss.
        deadline = time.monotonic() + 60
        while True:
            async with engine.connect() as connection:
                rows = (
                    await connection.execute(
                        select(JobRun.started, JobRun.status)
                        .where(JobRun.job == "reconcile", JobRun.trigger == "schedule")
                        .order_by(JobRun.started)
                    )
                ).all()
            elapsed = time.monotonic() - began
            ran = [row.started for row in rows if row.status != "skipped"]
            if len(ran) >= 4:
                break
            assert time.monotonic() < deadline, rows
            await asyncio.sleep(0.2)
    finally:
        await engine.dispose()
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(ran)]
    # Once per interval, not three times: never two runs closer than the interval, and no
    # more runs than intervals since the first replica started.
    assert len(ran) <= int(elapsed // interval) + 1, rows
    assert min(gaps) >= 0.9 * interval, gaps


@pytest.mark.settings(scheduler_jitter_seconds=0)
async def test_a_scheduled_run_is_left_out_while_its_look_finds_nothing_to_do(
    settings: Settings, clean_state: None
) -> None:
    """A job with a look first (`nothing_to_do`) runs on schedule only when the look finds
    work: no lock, no record, no body otherwise. A run asked for runs whatever it says."""
    app = create_app(settings.model_copy(update={"scheduler_enabled": False}))
    ran: list[Trigger] = []
    idle = True

    async def body(context: JobContext, run: Run) -> None:
        ran.append(run.trigger)
        run.find("work")  # leaves a record: a quiet run that found something

    async def nothing_to_do(context: JobContext) -> bool:
        return idle

    spec = JobSpec(
        Job.SWEEP_ACCESS, body, interval=lambda _: 1, quiet=True, nothing_to_do=nothing_to_do
    )
    async with LifespanManager(app):
        state: Runtime = app.state.queuekeeper
        scheduler = JobScheduler(state.jobs.context, {Job.SWEEP_ACCESS: spec})
        scheduler.start()
        try:
            await asyncio.sleep(2.5)  # two intervals: looked, left out
            assert ran == []
            await run_job(state.jobs.context, spec, Trigger.API)
            assert ran == [Trigger.API]
            idle = False
            deadline = time.monotonic() + 10
            while Trigger.SCHEDULE not in ran:
                assert time.monotonic() < deadline, "never ran once its look found work"
                await asyncio.sleep(0.1)
        finally:
            await scheduler.stop()
        async with state.sessions() as session:
            triggers = [run.trigger for run in await session.scalars(select(JobRun))]
    assert sorted(set(triggers)) == ["api", "schedule"]


async def test_a_quiet_scheduled_run_writes_its_record_only_when_it_found_something(
    settings: Settings, clean_state: None
) -> None:
    """An idle service's frequent checks write nothing to `job_runs`; a check that finds
    work is recorded once, when it ends; a run asked for is written when it begins, so its
    caller can follow it by id, and removed if it found nothing."""
    app = create_app(settings.model_copy(update={"scheduler_enabled": False}))
    found = False

    async def body(context: JobContext, run: Run) -> None:
        if found:
            run.find("work")

    spec = JobSpec(Job.PRESENCE, body, quiet=True)
    writes: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        verb = statement.split(maxsplit=1)[0].upper()
        if verb in ("INSERT", "DELETE") and "job_runs" in statement:
            writes.append(verb)

    async with LifespanManager(app):
        state: Runtime = app.state.queuekeeper
        engine = state.jobs.context.engine.sync_engine
        event.listen(engine, "before_cursor_execute", seen)
        try:
            idle = await run_job(state.jobs.context, spec, Trigger.SCHEDULE)
            assert writes == []
            found = True
            busy = await run_job(state.jobs.context, spec, Trigger.SCHEDULE)
            assert writes == ["INSERT"]
            found = False
            await run_job(state.jobs.context, spec, Trigger.API)
            assert writes == ["INSERT", "INSERT", "DELETE"]
        finally:
            event.remove(engine, "before_cursor_execute", seen)
        async with state.sessions() as session:
            [record] = list(await session.scalars(select(JobRun)))
    assert idle.status == busy.status == "succeeded"
    assert (record.uuid, record.trigger, record.found) == (busy.uuid, "schedule", {"work": 1})
    assert record.finished is not None
