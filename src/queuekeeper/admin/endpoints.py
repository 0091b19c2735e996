"""Operator API for the records of job runs."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query, Request, Response

from queuekeeper.admin.routes import ADMIN_ERRORS, admin_router
from queuekeeper.common.openapi import error_responses
from queuekeeper.common.pagination import Page, page_params, set_page_headers
from queuekeeper.common.schemas import parse_path_uuid
from queuekeeper.jobs import service
from queuekeeper.jobs.runs import Job, RunStatus
from queuekeeper.jobs.schemas import RunOut
from queuekeeper.state import SessionDep

router = admin_router()


@router.get(
    "/reconcile-runs/",
    summary="List job run records",
    description="Every run of every job (reconcile, stale cleanup, dead-letter redrive), "
    "scheduled or on demand, newest first. A bare JSON array; `X-Result-Count` and `Link` "
    "paginate.",
    responses={
        **ADMIN_ERRORS,
        **error_responses(400, descriptions={400: "Unknown `job` or `status`."}),
    },
)
async def list_runs(
    request: Request,
    response: Response,
    session: SessionDep,
    page: Annotated[Page, Depends(page_params)],
    job: Annotated[Job | None, Query(description="Only this job.")] = None,
    status: Annotated[RunStatus | None, Query(description="Only runs in this status.")] = None,
) -> list[RunOut]:
    total, rows = await service.list_runs(
        session, job=job, status=status, offset=page.offset, limit=page.page_size
    )
    set_page_headers(request, response, page, total)
    return [RunOut.from_row(row) for row in rows]


@router.get(
    "/reconcile-runs/{run_uuid}/",
    summary="Get one run record",
    description="A run record by its uuid (hex or dashed).",
    responses={**ADMIN_ERRORS, **error_responses(404, descriptions={404: "No such run."})},
)
async def get_run(run_uuid: str, session: SessionDep) -> RunOut:
    return RunOut.from_row(await service.get_run(session, parse_path_uuid(run_uuid), run_uuid))
