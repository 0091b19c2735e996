"""Operator API for dead letters: what each vhost holds, what was given up, redrive now."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Response

from queuekeeper.admin.routes import (
    ADMIN_ERRORS,
    RUN_DESCRIPTION,
    RUN_RESPONSES,
    RespondAsync,
    admin_router,
    run_answer,
)
from queuekeeper.common.openapi import error_responses
from queuekeeper.common.pagination import Page, page_params
from queuekeeper.common.params import VhostQuery
from queuekeeper.deadletters import service
from queuekeeper.deadletters.schemas import DeadLettersOut
from queuekeeper.jobs.dependencies import JobsDep
from queuekeeper.jobs.schemas import RunOut
from queuekeeper.state import ProvisionerDep, SessionDep, SettingsDep

router = admin_router("/dead-letters")


@router.get(
    "/",
    summary="Dead letters per vhost, and those given up",
    description="Each of this installation's vhosts with the message count of its dead-letter "
    "queue (from the broker's statistics, a few seconds old), and the records of dead letters "
    "taken off without a redrive (newest first; `page`/`page_size` page through them).",
    responses={
        **ADMIN_ERRORS,
        **error_responses(
            404,
            503,
            descriptions={
                404: "`vhost` is not one of this installation's.",
                503: "The Management API is unreachable.",
            },
        ),
    },
)
async def dead_letters(
    session: SessionDep,
    provisioner: ProvisionerDep,
    settings: SettingsDep,
    page: Annotated[Page, Depends(page_params)],
    vhost: VhostQuery = None,
) -> DeadLettersOut:
    return await service.dead_letters(
        session, provisioner, settings, vhost=vhost, offset=page.offset, limit=page.page_size
    )


@router.post(
    "/redrive/",
    summary="Redrive dead letters now",
    description="Moves each dead letter back to its original queue (from `x-death`) when that "
    "queue is registered, present and has room: published persistent and confirmed, then "
    "acknowledged. Dead letters too old, redriven too often or whose queue is no longer "
    "registered are taken off and recorded as given up. Answers with the run record."
    + RUN_DESCRIPTION,
    responses={
        **RUN_RESPONSES,
        **error_responses(404, descriptions={404: "`vhost` is not one of this installation's."}),
    },
)
async def redrive_now(
    request: Request,
    response: Response,
    jobs: JobsDep,
    background: RespondAsync,
    vhost: VhostQuery = None,
) -> RunOut:
    record = await service.redrive_now(jobs, vhost, background=background)
    return run_answer(request, response, record, background)
