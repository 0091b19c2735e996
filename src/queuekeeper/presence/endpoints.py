"""Why a consumer's queue is silent (contract §11): its status, for its owner's agent or the
backend. The admin queue view (`GET /api/admin/queues/`) carries the same fields per row."""

from __future__ import annotations

from queuekeeper.auth.dependencies import AgentOrService
from queuekeeper.common import access
from queuekeeper.common.access import Caller
from queuekeeper.common.access import router as caller_router
from queuekeeper.common.openapi import error_responses
from queuekeeper.presence import service
from queuekeeper.presence.schemas import QueueStatusOut
from queuekeeper.state import ProvisionerDep, SessionDep, SettingsDep

router = caller_router(Caller.AGENT, tags=["agents"])


@router.get(
    "/api/event-consumers/{consumer_uuid}/status/",
    summary="Why a consumer's queue is silent",
    description="Whether an agent reads the queue now (and since when none has), who is "
    "connected, what waits in the queue, in the outbox (parked while the agent is away) and "
    "in the dead-letter queue, and `delivery_blocked_reason` with a sentence saying what to "
    "do. Your own consumers only (a service token sees every consumer). Counted against the "
    "per-token rate limit like the registration calls.",
    responses=error_responses(
        401,
        404,
        429,
        503,
        descriptions={
            404: "No such consumer of yours, or not a uuid.",
            429: "Too many calls with this token; retry after `Retry-After` seconds.",
            503: "The broker or its Management API is unreachable; retry after `Retry-After`.",
        },
    ),
)
@access.rate_limited
@access.service_too
async def consumer_status(
    consumer_uuid: str,
    caller: AgentOrService,
    session: SessionDep,
    provisioner: ProvisionerDep,
    settings: SettingsDep,
) -> QueueStatusOut:
    return await service.consumer_status(session, provisioner, settings, caller, consumer_uuid)
