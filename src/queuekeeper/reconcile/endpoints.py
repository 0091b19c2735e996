"""Operator API: run reconcile or stale cleanup now, read run records, see every queue."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response

from queuekeeper.auth.dependencies import ServiceCaller
from queuekeeper.common.openapi import error_responses
from queuekeeper.common.pagination import Page, page_params, set_page_headers
from queuekeeper.common.schemas import parse_path_uuid
from queuekeeper.exceptions import BadRequest, Conflict, NotFound, Unavailable
from queuekeeper.jobs import repository as runs_repository
from queuekeeper.jobs.runs import Job, RunStatus, Trigger
from queuekeeper.jobs.schemas import RunOut, run_out
from queuekeeper.models import JobRun
from queuekeeper.reconcile.schemas import QueueStateOut
from queuekeeper.reconcile.service import run_reconcile
from queuekeeper.reconcile.stale import run_cleanup_stale
from queuekeeper.reconcile.view import QueueFilter, QueueState, queue_page
from queuekeeper.state import SessionDep, StateDep

router = APIRouter(prefix="/api/admin", tags=["admin"], dependencies=[ServiceCaller])

ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    **error_responses(401, descriptions={401: "No or unknown service token."}),
    **error_responses(
        403, descriptions={403: "An agent token was sent; this needs a service token."}
    ),
}
RUN_ERRORS: dict[int | str, dict[str, Any]] = {
    **ADMIN_ERRORS,
    **error_responses(
        409,
        descriptions={
            409: "Another run of the same job is in progress (here or on another "
            "replica); nothing was done. `run` holds the skipped run's record."
        },
    ),
    **error_responses(
        503,
        descriptions={
            503: "The run ended early: RabbitMQ or the database is unreachable. "
            "`run` holds its record; retry after `Retry-After` seconds."
        },
    ),
}
DRY_RUN = Query(description="Report what would change, change nothing.")


def answer_run(record: JobRun) -> RunOut:
    """200 with the record; a skipped run is a 409, a run cut short a 503 (record in `run`)."""
    out = run_out(record)
    body = {"run": out.model_dump(mode="json")}
    if record.status == RunStatus.SKIPPED:
        raise Conflict(
            f"A {record.job} run is already in progress; this one did nothing. "
            "See GET /api/admin/reconcile-runs/ for its record.",
            extra=body,
        )
    if record.status == RunStatus.FAILED:
        reasons = "; ".join(failure["reason"] for failure in record.failures[-1:])
        raise Unavailable(
            f"The {record.job} run ended early: {reasons}",
            extra=body,
        )
    return out


@router.post(
    "/reconcile/",
    summary="Run a reconcile now",
    description="Deletes orphan `subscription_*` queues, re-creates missing ones, repairs "
    "drifted ones when empty and unconsumed (reports them otherwise), restores broker users "
    "and permissions, ensures each vhost's set-up, removes vhosts and broker users nothing "
    "uses. Answers with the run record once the run is over. With `dry_run=true` nothing "
    "changes and `actions` lists what would have.",
    responses=RUN_ERRORS,
)
async def reconcile_now(state: StateDep, dry_run: Annotated[bool, DRY_RUN] = False) -> RunOut:
    record = await run_reconcile(state, Trigger.API, dry_run=dry_run)
    return answer_run(record)


@router.post(
    "/cleanup-stale/",
    summary="Remove stale subscriptions now",
    description="Removes the subscriptions of users who are inactive or whose token expired, "
    "with their queues, broker users and (when it was their last) vhost; also removes what "
    "deleted users left on the broker. Answers with the run record.",
    responses=RUN_ERRORS,
)
async def cleanup_stale_now(state: StateDep, dry_run: Annotated[bool, DRY_RUN] = False) -> RunOut:
    record = await run_cleanup_stale(state, Trigger.API, dry_run=dry_run)
    return answer_run(record)


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
    total, rows = await runs_repository.list_runs(
        session,
        job=job.value if job else None,
        status=status.value if status else None,
        offset=page.offset,
        limit=page.page_size,
    )
    set_page_headers(request, response, page, total)
    return [run_out(row) for row in rows]


@router.get(
    "/reconcile-runs/{run_uuid}/",
    summary="Get one run record",
    description="A run record by its uuid (hex or dashed).",
    responses={**ADMIN_ERRORS, **error_responses(404, descriptions={404: "No such run."})},
)
async def get_run(run_uuid: str, session: SessionDep) -> RunOut:
    parsed = parse_path_uuid(run_uuid)
    record = await runs_repository.get_run(session, parsed) if parsed else None
    if record is None:
        raise NotFound(f"Run {run_uuid!r} not found.")
    return run_out(record)


def _hex_filter(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    parsed = parse_path_uuid(value)
    if parsed is None:
        raise BadRequest(f"{name} {value!r} is not a uuid (hex or dashed form).", field=name)
    return parsed.hex


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
            400, descriptions={400: "A malformed uuid filter, or an unknown `state`."}
        ),
        **error_responses(503, descriptions={503: "The Management API is unreachable."}),
    },
)
async def list_queue_states(
    request: Request,
    response: Response,
    state: StateDep,
    page: Annotated[Page, Depends(page_params)],
    vhost: Annotated[str | None, Query(description="One vhost (the owner's uuid hex).")] = None,
    queue_state: Annotated[
        QueueState | None, Query(alias="state", description="Only queues in this state.")
    ] = None,
    event_subscription_uuid: Annotated[str | None, Query()] = None,
    offering_uuid: Annotated[str | None, Query()] = None,
    object_type: Annotated[str | None, Query()] = None,
) -> list[QueueStateOut]:
    wanted = QueueFilter(
        vhost=_hex_filter(vhost, "vhost") if vhost else None,
        state=queue_state,
        subscription_uuid=_hex_filter(event_subscription_uuid, "event_subscription_uuid"),
        offering_uuid=_hex_filter(offering_uuid, "offering_uuid"),
        object_type=object_type,
    )
    total, entries = await queue_page(state, wanted, page.offset, page.page_size)
    set_page_headers(request, response, page, total)
    return entries
