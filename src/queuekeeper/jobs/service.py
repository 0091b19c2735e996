"""Starting a job for the admin API, and reading run records."""

from __future__ import annotations

import uuid

from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.exceptions import Conflict, NotFound, Unavailable
from queuekeeper.exceptions import shown as quoted
from queuekeeper.jobs import repository
from queuekeeper.jobs.runs import Job, JobBody, JobRunner, RunStatus, Trigger
from queuekeeper.jobs.schemas import RunOut
from queuekeeper.models import JobRun


def settled(record: JobRun) -> JobRun:
    """The record of a run that did its work; a skipped run is a Conflict, one cut short
    Unavailable (the record goes with either, in `run`)."""
    body = {"run": RunOut.from_row(record).model_dump(mode="json")}
    if record.status == RunStatus.SKIPPED:
        raise Conflict(
            f"A {record.job} run is already in progress; this one did nothing. "
            "See GET /api/admin/reconcile-runs/ for its record.",
            extra=body,
        )
    if record.status == RunStatus.FAILED:
        reasons = "; ".join(failure["reason"] for failure in record.failures[-1:])
        raise Unavailable(f"The {record.job} run ended early: {reasons}", extra=body)
    return record


async def run_now(
    jobs: JobRunner,
    job: Job,
    *,
    dry_run: bool = False,
    force: bool = False,
    background: bool = False,
    body: JobBody | None = None,
) -> JobRun:
    """Run `job` for the admin API: to its end, or (`background`) until its record is stored."""
    if background:
        record = await jobs.start(job, Trigger.API, dry_run=dry_run, force=force, body=body)
    else:
        record = await jobs.run(job, Trigger.API, dry_run=dry_run, force=force, body=body)
    return settled(record)


async def list_runs(
    session: AsyncSession, *, job: Job | None, status: RunStatus | None, offset: int, limit: int
) -> tuple[int, list[JobRun]]:
    return await repository.list_runs(
        session,
        job=job.value if job else None,
        status=status.value if status else None,
        offset=offset,
        limit=limit,
    )


async def get_run(session: AsyncSession, run_uuid: uuid.UUID | None, shown: str) -> JobRun:
    record = await repository.get_run(session, run_uuid) if run_uuid else None
    if record is None:
        raise NotFound(f"Run {quoted(shown)} not found.")
    return record
