"""Operator API: run reconcile or stale cleanup now, see every queue."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query, Request, Response

from queuekeeper.admin.routes import (
    ADMIN_ERRORS,
    DRY_RUN,
    FORCE,
    RUN_DESCRIPTION,
    RUN_RESPONSES,
    RespondAsync,
    admin_router,
    run_answer,
)
from queuekeeper.common.openapi import error_responses
from queuekeeper.common.pagination import Page, page_params, set_page_headers
from queuekeeper.common.params import VhostQuery
from queuekeeper.jobs.dependencies import JobContextDep, JobsDep
from queuekeeper.jobs.runs import Job
from queuekeeper.jobs.schemas import RunOut
from queuekeeper.jobs.service import run_now
from queuekeeper.reconcile.schemas import QueueState, QueueStateOut
from queuekeeper.reconcile.view import queue_page

router = admin_router()


@router.post(
    "/reconcile/",
    summary="Run a reconcile now",
    description="Deletes orphan `subscription_*` queues, re-creates missing ones, repairs "
    "drifted ones when empty and unconsumed (reports them otherwise), restores broker users "
    "and permissions, ensures each vhost's set-up, removes vhosts and broker users nothing "
    "uses. Answers with the run record once the run is over. With `dry_run=true` nothing "
    "changes and `actions` lists what would have. A run that would delete more than the "
    "deletion guard allows deletes nothing unless `force=true` (docs/reconcile.md)."
    + RUN_DESCRIPTION,
    responses=RUN_RESPONSES,
)
async def reconcile_now(
    request: Request,
    response: Response,
    jobs: JobsDep,
    background: RespondAsync,
    dry_run: Annotated[bool, DRY_RUN] = False,
    force: Annotated[bool, FORCE] = False,
) -> RunOut:
    record = await run_now(jobs, Job.RECONCILE, dry_run=dry_run, force=force, background=background)
    return run_answer(request, response, record, background)


@router.post(
    "/cleanup-stale/",
    summary="Remove stale subscriptions now",
    description="Removes the subscriptions of users who are inactive or whose token expired, "
    "with their queues, broker users and (when it was their last) vhost; also removes what "
    "deleted users left on the broker. Answers with the run record." + RUN_DESCRIPTION,
    responses=RUN_RESPONSES,
)
async def cleanup_stale_now(
    request: Request,
    response: Response,
    jobs: JobsDep,
    background: RespondAsync,
    dry_run: Annotated[bool, DRY_RUN] = False,
    force: Annotated[bool, FORCE] = False,
) -> RunOut:
    record = await run_now(
        jobs, Job.CLEANUP_STALE, dry_run=dry_run, force=force, background=background
    )
    return run_answer(request, response, record, background)


@router.get(
    "/queues/",
    summary="Every queue: registered, present, arguments right, depth, consumers",
    description="Each registered queue joined with the broker's view of it, plus the "
    "`subscription_*` queues in this installation's vhosts that nothing registered "
    "(`state=unregistered`). Ordered by vhost, then name. A bare JSON array; "
    "`X-Result-Count` and `Link` paginate. Message and consumer counts are the broker's "
    "statistics, a few seconds old.",
    responses={
        **ADMIN_ERRORS,
        **error_responses(
            400,
            descriptions={
                400: "An empty or malformed `vhost` or uuid filter, or an unknown `state`."
            },
        ),
        **error_responses(503, descriptions={503: "The Management API is unreachable."}),
    },
)
async def list_queue_states(
    request: Request,
    response: Response,
    context: JobContextDep,
    page: Annotated[Page, Depends(page_params)],
    vhost: VhostQuery = None,
    queue_state: Annotated[
        QueueState | None, Query(alias="state", description="Only queues in this state.")
    ] = None,
    event_subscription_uuid: Annotated[str | None, Query()] = None,
    offering_uuid: Annotated[str | None, Query()] = None,
    object_type: Annotated[str | None, Query()] = None,
) -> list[QueueStateOut]:
    total, entries = await queue_page(
        context,
        page.offset,
        page.page_size,
        vhost=vhost,
        state=queue_state,
        event_subscription_uuid=event_subscription_uuid,
        offering_uuid=offering_uuid,
        object_type=object_type,
    )
    set_page_headers(request, response, page, total)
    return entries
