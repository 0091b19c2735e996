"""The admin API's routers, and what every "run a job now" route shares."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response

from queuekeeper.auth.dependencies import service_router
from queuekeeper.common.openapi import error_responses
from queuekeeper.jobs.schemas import RunOut
from queuekeeper.models import JobRun

ADMIN_PREFIX = "/api/admin"


def admin_router(prefix: str = "", **kwargs: Any) -> APIRouter:
    """A router of the admin API: service routes under `/api/admin` + `prefix`, tagged
    `admin`. Being service routes is the router's declaration, not the path's."""
    return service_router(prefix=ADMIN_PREFIX + prefix, tags=["admin"], **kwargs)


RESPOND_ASYNC = "respond-async"
ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    **error_responses(401, descriptions={401: "No or unknown service token."}),
    **error_responses(
        403, descriptions={403: "An agent token was sent; this needs a service token."}
    ),
}
RUN_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ADMIN_ERRORS,
    202: {
        "model": RunOut,
        "description": "With `Prefer: respond-async`: the run started and goes on in the "
        "background. The body is its record (`status` `running`); poll `Location` "
        "(`GET /api/admin/reconcile-runs/{uuid}/`) until `finished` is set.",
        "headers": {
            "Location": {
                "description": "The run record to poll.",
                "schema": {"type": "string"},
            },
            "Preference-Applied": {
                "description": "`respond-async`.",
                "schema": {"type": "string"},
            },
        },
    },
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
RUN_DESCRIPTION = (
    " Send `Prefer: respond-async` to get `202 Accepted` as soon as the run has started, "
    "with its record and a `Location` to poll, instead of holding the request open."
)
DRY_RUN = Query(description="Report what would change, change nothing.")
FORCE = Query(
    description="Delete even when the run would delete more than the deletion guard allows "
    "(`QUEUEKEEPER_RECONCILE_MAX_DELETIONS` objects or `QUEUEKEEPER_RECONCILE_MAX_DELETE_SHARE` "
    "of what this installation owns). Without it such a run deletes nothing and says why "
    "in `failures` (item `deletion guard`)."
)


def respond_async(
    prefer: Annotated[
        str | None,
        Header(
            alias="Prefer",
            description="`respond-async` (RFC 7240): answer 202 once the run has started.",
        ),
    ] = None,
) -> bool:
    return prefer is not None and RESPOND_ASYNC in {
        part.strip().lower() for part in prefer.split(",")
    }


RespondAsync = Annotated[bool, Depends(respond_async)]


def run_answer(request: Request, response: Response, record: JobRun, background: bool) -> RunOut:
    """The run's record; started in the background, as 202 with the record's address."""
    if background:
        response.status_code = 202
        response.headers["Location"] = str(
            request.url_for("get_run", run_uuid=record.uuid.hex).path
        )
        response.headers["Preference-Applied"] = RESPOND_ASYNC
    return RunOut.from_row(record)
