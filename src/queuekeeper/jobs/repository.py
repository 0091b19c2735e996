"""Queries for run records. The caller commits."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.common.pagination import fetch_page
from queuekeeper.models import JobRun, utcnow


def insert_run(session: AsyncSession, record: JobRun) -> None:
    session.add(record)


async def save_run(session: AsyncSession, record: JobRun) -> None:
    await session.execute(
        update(JobRun)
        .where(JobRun.uuid == record.uuid)
        .values(
            finished=record.finished,
            status=record.status,
            found=record.found,
            changed=record.changed,
            actions=record.actions,
            failures=record.failures,
        )
    )


async def delete_run(session: AsyncSession, run_uuid: uuid.UUID) -> None:
    await session.execute(delete(JobRun).where(JobRun.uuid == run_uuid))


async def close_interrupted(session: AsyncSession, job: str) -> None:
    """Mark runs of `job` still "running" as failed; call only while holding the job's lock."""
    await session.execute(
        update(JobRun)
        .where(JobRun.job == job, JobRun.status == "running")
        .values(
            status="failed",
            finished=utcnow(),
            failures=[{"item": job, "reason": "interrupted: the process running it stopped"}],
        )
    )


async def last_started(session: AsyncSession, job: str, trigger: str) -> datetime | None:
    """When the latest run of `job` by `trigger` that did something (not skipped) began."""
    return await session.scalar(
        select(func.max(JobRun.started)).where(
            JobRun.job == job, JobRun.trigger == trigger, JobRun.status != "skipped"
        )
    )


async def list_runs(
    session: AsyncSession, *, job: str | None, status: str | None, offset: int, limit: int
) -> tuple[int, list[JobRun]]:
    """Newest first."""
    query = select(JobRun)
    if job:
        query = query.where(JobRun.job == job)
    if status:
        query = query.where(JobRun.status == status)
    return await fetch_page(
        session, query, JobRun.started.desc(), JobRun.uuid, offset=offset, limit=limit
    )


async def get_run(session: AsyncSession, run_uuid: uuid.UUID) -> JobRun | None:
    return await session.get(JobRun, run_uuid)
