"""Consumer routes (contract §9): the 1.0.7 agent's `register_queue`, and `/api/event-consumers/`.

waldur-site-agent 1.0.7 accepts 200 or 201 from register_queue and nothing else; it
does not retry, so every refusal says exactly what to fix.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Request, Response, status

from queuekeeper.auth.dependencies import AgentOrService, CurrentUser
from queuekeeper.common.openapi import QueueConflictBody, error_responses
from queuekeeper.common.pagination import Page, page_params, set_page_headers
from queuekeeper.consumers import service
from queuekeeper.consumers.schemas import (
    ConsumerOut,
    ConsumerRegistration,
    QueueRegistration,
    RegistrationOut,
)
from queuekeeper.state import ProvisionerDep, SessionDep, SettingsDep

router = APIRouter(tags=["agents"])

_REGISTER_ERRORS = {
    400: "Bad body: not an object, `object_types` not a list, or holding an unknown or "
    "repeated type (the field is named).",
    403: "You have no access to the offering.",
    409: "The identity belongs to another user (named), the owner's vhost is not this "
    "installation's, or the consumer's queue exists with other arguments and holds messages.",
    503: "Broker or Management API unreachable; nothing was made. Retry after `Retry-After` "
    "seconds.",
}


@router.post(
    "/api/marketplace-site-agent-identities/{identity_uuid}/register_queue/",
    status_code=status.HTTP_201_CREATED,
    summary="Register the identity's one queue for every object type (agent 1.0.7)",
    description="The identity's consumer: one queue (`consumer_<hex>`) in your vhost for its "
    "offering's events of the requested types, and a broker user (`rmq_username`, password "
    "= your API token, set again on every call) that may read that queue and nothing else. "
    "Answers only once the queue exists with the right arguments. 201 when it was made, 200 "
    "with the same names on every later call (an agent restart).",
    responses={
        200: {"description": "The identity's existing consumer.", "model": RegistrationOut},
        **error_responses(
            400,
            401,
            403,
            404,
            409,
            503,
            descriptions={
                **_REGISTER_ERRORS,
                404: "No such identity (or its offering was deleted), or not a uuid.",
            },
            models={409: QueueConflictBody},
        ),
    },
)
async def register_queue(
    identity_uuid: str,
    response: Response,
    user: CurrentUser,
    session: SessionDep,
    provisioner: ProvisionerDep,
    settings: SettingsDep,
    # No body at all reads as `{}` (keep the filter), as Waldur's serializer does.
    body: Annotated[QueueRegistration, Body(default_factory=QueueRegistration)],
) -> RegistrationOut:
    consumer, created = await service.register_queue(
        session, provisioner, settings, user, identity_uuid, body
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    return RegistrationOut.from_row(consumer)


@router.post(
    "/api/event-consumers/register/",
    status_code=status.HTTP_201_CREATED,
    summary="Register an event consumer (integrations that are not site agents)",
    description="A consumer for the offerings in `scopes` (you need access to each): one queue "
    "and a read-only broker user, as register_queue makes. Registering the same set of "
    "offerings again returns your existing consumer (200) with the filter updated as "
    "`object_types` says.",
    responses={
        200: {"description": "Your existing consumer.", "model": RegistrationOut},
        **error_responses(
            400,
            401,
            403,
            409,
            503,
            descriptions={
                **_REGISTER_ERRORS,
                400: _REGISTER_ERRORS[400] + " Also: no scopes, an unknown offering, or a "
                "scope type other than `offering`.",
            },
            models={409: QueueConflictBody},
        ),
    },
)
async def register_event_consumer(
    body: ConsumerRegistration,
    response: Response,
    user: CurrentUser,
    session: SessionDep,
    provisioner: ProvisionerDep,
    settings: SettingsDep,
) -> RegistrationOut:
    consumer, created = await service.register(session, provisioner, settings, user, body)
    if not created:
        response.status_code = status.HTTP_200_OK
    return RegistrationOut.from_row(consumer)


@router.get(
    "/api/event-consumers/",
    summary="List event consumers",
    description="Your consumers (a service token sees every consumer), oldest first, as a bare "
    "JSON array; `X-Result-Count` and `Link` headers paginate.",
    responses=error_responses(400, 401),
)
async def list_event_consumers(
    request: Request,
    response: Response,
    caller: AgentOrService,
    session: SessionDep,
    page: Annotated[Page, Depends(page_params)],
) -> list[ConsumerOut]:
    paged = await service.list_consumers(session, caller, page)
    set_page_headers(request, response, page, paged.total)
    return [ConsumerOut.from_row(row) for row in paged.rows]


@router.head(
    "/api/event-consumers/",
    summary="Count event consumers",
    description="`X-Result-Count`: how many `GET /api/event-consumers/` would list (what "
    "waldur-api-client's `event_consumers_count` reads).",
    response_class=Response,
    responses={
        200: {
            "description": "No body; the count is in `X-Result-Count`.",
            "headers": {"X-Result-Count": {"schema": {"type": "integer"}}},
            "content": None,
        },
        **error_responses(401),
    },
)
async def count_event_consumers(caller: AgentOrService, session: SessionDep) -> Response:
    total = await service.count_consumers(session, caller)
    return Response(status_code=status.HTTP_200_OK, headers={"X-Result-Count": str(total)})


@router.get(
    "/api/event-consumers/{consumer_uuid}/",
    summary="Get an event consumer",
    description="404 when it is another user's (a service token sees every consumer).",
    responses=error_responses(401, 404),
)
async def get_event_consumer(
    consumer_uuid: str, caller: AgentOrService, session: SessionDep
) -> ConsumerOut:
    return ConsumerOut.from_row(await service.get_consumer(session, caller, consumer_uuid))


@router.delete(
    "/api/event-consumers/{consumer_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete an event consumer",
    description="Deletes its queue (with any messages in it) and its broker user. A site "
    "agent's consumer is made again by the agent's next start.",
    responses=error_responses(401, 404),
)
async def delete_event_consumer(
    consumer_uuid: str, caller: AgentOrService, session: SessionDep, provisioner: ProvisionerDep
) -> Response:
    await service.delete_consumer(session, provisioner, caller, consumer_uuid)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
