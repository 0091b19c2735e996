"""Operator API for dead letters: what each vhost holds, what was given up, redrive now."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from queuekeeper.auth.dependencies import ServiceCaller
from queuekeeper.common.openapi import error_responses
from queuekeeper.common.pagination import Page, page_params
from queuekeeper.common.params import VhostQuery
from queuekeeper.deadletters import repository
from queuekeeper.deadletters.schemas import DeadLetterQueueOut, DeadLettersOut, GivenUpOut
from queuekeeper.deadletters.service import dead_letter_counts, run_redrive
from queuekeeper.errors import NotFound
from queuekeeper.jobs.runs import Trigger
from queuekeeper.jobs.schemas import RunOut
from queuekeeper.reconcile.endpoints import ADMIN_ERRORS, RUN_ERRORS, answer_run
from queuekeeper.state import SessionDep, StateDep

router = APIRouter(prefix="/api/admin/dead-letters", tags=["admin"], dependencies=[ServiceCaller])


@router.get(
    "/",
    summary="Dead letters per vhost, and those given up",
    description="Each of this installation's vhosts with the message count of its dead-letter "
    "queue (from the broker's statistics, a few seconds old), and the records of dead letters "
    "taken off without a redrive (newest first; `page`/`page_size` page through them).",
    responses={
        **ADMIN_ERRORS,
        **error_responses(503, descriptions={503: "The Management API is unreachable."}),
    },
)
async def dead_letters(
    state: StateDep,
    session: SessionDep,
    page: Annotated[Page, Depends(page_params)],
    vhost: VhostQuery = None,
) -> DeadLettersOut:
    queues = [DeadLetterQueueOut(**entry) for entry in await dead_letter_counts(state, vhost)]
    total, given_up = await repository.list_given_up(
        session, vhost=vhost, offset=page.offset, limit=page.page_size
    )
    return DeadLettersOut(
        total_messages=sum(queue.messages or 0 for queue in queues),
        vhosts=queues,
        given_up_total=total,
        given_up=[GivenUpOut.model_validate(record) for record in given_up],
    )


@router.post(
    "/redrive/",
    summary="Redrive dead letters now",
    description="Moves each dead letter back to its original queue (from `x-death`) when that "
    "queue is registered, present and has room: published persistent and confirmed, then "
    "acknowledged. Dead letters too old, redriven too often or whose queue is no longer "
    "registered are taken off and recorded as given up. Answers with the run record.",
    responses={
        **RUN_ERRORS,
        **error_responses(404, descriptions={404: "`vhost` is not one of this installation's."}),
    },
)
async def redrive_now(state: StateDep, vhost: VhostQuery = None) -> RunOut:
    if vhost is not None:
        info = await state.management.get_vhost(vhost)
        if info is None or not state.provisioner.owns(info):
            raise NotFound(
                f"vhost {vhost!r} is not one of this installation's vhosts "
                f"(tagged {state.settings.instance_tag!r}).",
                field="vhost",
            )
    record = await run_redrive(state, Trigger.API, vhost=vhost)
    return answer_run(record, state.settings.retry_after_seconds)
