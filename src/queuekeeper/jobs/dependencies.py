"""The job runner as FastAPI dependencies, for the admin endpoints that start or read runs."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from queuekeeper.jobs.runs import JobContext, JobRunner


async def get_jobs(request: Request) -> JobRunner:
    # The composition root's `Runtime` holds the runner (app.py builds it from the job table).
    jobs: JobRunner = request.app.state.queuekeeper.jobs
    return jobs


JobsDep = Annotated[JobRunner, Depends(get_jobs)]


async def get_job_context(jobs: JobsDep) -> JobContext:
    return jobs.context


JobContextDep = Annotated[JobContext, Depends(get_job_context)]
