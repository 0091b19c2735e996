"""Replay routes (contract §11): an agent's own consumer, and any queue for operators."""

from __future__ import annotations

from fastapi import status

from queuekeeper.admin.routes import ADMIN_ERRORS, admin_router
from queuekeeper.auth.dependencies import AgentOrService
from queuekeeper.common.access import Caller, service_too
from queuekeeper.common.access import router as caller_router
from queuekeeper.common.openapi import error_responses
from queuekeeper.parking import service
from queuekeeper.parking.schemas import ReplayAdminWindow, ReplayOut, ReplayWindow
from queuekeeper.state import EngineDep, SessionDep, SettingsDep

agent_router = caller_router(Caller.AGENT, tags=["agents"])
queues_router = admin_router("/queues")

_WINDOW_ERRORS = {
    400: "A bad window, the field named: `since` in the future, `until` before `since`, or "
    "`since` older than retention (the answer names the oldest time available); an "
    "unknown object type; or a window holding more copies than "
    "`QUEUEKEEPER_REPLAY_MAX_COPIES` (the answer names the limit and the count).",
    409: "A replay of this queue is still being published (the answer says since when and "
    "how many copies are left): one replay of a queue runs at a time.",
}
_REPLAY_DESCRIPTION = (
    "Every event accepted in [`since`, `until`) that this queue received or would have "
    "received (whatever became of its copy: published, parked, given up, rejected), and "
    "that the queue's owner may receive now (access to the offering, the consumer's scope), "
    "is published to it again, in acceptance order, with its original `message_id` and the "
    'header `x-queuekeeper-replay: "true"` (a string: the STOMP adapter drops other types). '
    "Replayed copies go through the outbox: while the queue's agent is away they park like "
    "any other; they fall due `QUEUEKEEPER_REPLAY_COPIES_PER_SECOND` apart, all replays "
    "together, so live events never wait behind a replay. One replay of a queue at a time. "
    "Answers 202 with how many copies were written."
)


@agent_router.post(
    "/api/event-consumers/{consumer_uuid}/replay/",
    status_code=status.HTTP_202_ACCEPTED,
    summary="Replay a time window of events to your consumer's queue",
    description=_REPLAY_DESCRIPTION + " Rate limited like the other agent writes.",
    responses=error_responses(
        400,
        401,
        404,
        409,
        429,
        descriptions={
            **_WINDOW_ERRORS,
            404: "No such consumer, or it is another user's (a service token sees every one).",
        },
    ),
)
@service_too
async def replay_consumer(
    consumer_uuid: str,
    window: ReplayWindow,
    caller: AgentOrService,
    session: SessionDep,
    engine: EngineDep,
    settings: SettingsDep,
) -> ReplayOut:
    return await service.replay_consumer(session, engine, settings, caller, consumer_uuid, window)


@queues_router.post(
    "/replay/",
    status_code=status.HTTP_202_ACCEPTED,
    summary="Replay a time window of events to any registered queue",
    description=_REPLAY_DESCRIPTION + " Legacy per-type queues and consumer queues alike.",
    responses={
        **ADMIN_ERRORS,
        **error_responses(
            400,
            404,
            409,
            descriptions={
                **_WINDOW_ERRORS,
                404: "No registered queue of that name in that vhost.",
            },
        ),
    },
)
async def replay_queue(
    window: ReplayAdminWindow, session: SessionDep, engine: EngineDep, settings: SettingsDep
) -> ReplayOut:
    return await service.replay_queue(session, engine, settings, window)
