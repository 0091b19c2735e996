"""Consumer routes (contract §9, §10): the agents' `register_queue` (1.0.7 and later), and
`/api/event-consumers/` (a webhook consumer's own routes are webhooks/endpoints.py's).

waldur-site-agent accepts 200 or 201 from register_queue and nothing else. 1.0.7 does
not retry; 1.0.8's watchdog retries (a 4xx every 15 minutes, after one retry without
`service_provider_project_group` on a 400), so every refusal says exactly what to fix.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from fastapi import Body, Depends, Query, Request, Response, status

from queuekeeper.auth.dependencies import AgentOrService, CallerToken, CurrentUser
from queuekeeper.common.access import Caller, service_too
from queuekeeper.common.access import router as caller_router
from queuekeeper.common.openapi import QueueConflictBody, error_responses
from queuekeeper.common.pagination import (
    Page,
    page_params,
    set_bounded_page_headers,
    set_page_headers,
)
from queuekeeper.common.schemas import InputDateTime
from queuekeeper.consumers import service
from queuekeeper.consumers.schemas import (
    ConsumerFilters,
    ConsumerOut,
    ConsumerRegistration,
    ConsumerRegistrationOut,
    Delivery,
    DeliveryDetailOut,
    DeliveryFilters,
    DeliveryOut,
    DeliveryState,
    QueueRegistration,
    RegistrationOut,
    ResyncOut,
)
from queuekeeper.state import EngineDep, ProvisionerDep, SessionDep, SettingsDep

router = caller_router(Caller.AGENT, tags=["agents"])

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
    token: CallerToken,
    session: SessionDep,
    provisioner: ProvisionerDep,
    settings: SettingsDep,
    # No body at all reads as `{}` (keep the filter), as Waldur's serializer does.
    body: Annotated[QueueRegistration, Body(default_factory=QueueRegistration)],
) -> RegistrationOut:
    consumer, created = await service.register_queue(
        session, provisioner, settings, user, token, identity_uuid, body
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    return RegistrationOut.from_row(consumer)


@router.post(
    "/api/event-consumers/register/",
    status_code=status.HTTP_201_CREATED,
    summary="Register an event consumer (integrations that are not site agents)",
    description="A consumer for the entities in `scopes`: offerings (granted, or a role on "
    "it, its customer or its project), projects (a role on it or its customer), customers (a "
    "role on it) and yourself (`user`); another user, or `[]` (global: every event), for "
    "staff and support users only. One queue and a read-only broker user, as register_queue "
    "makes. Registering the same set again returns your existing consumer (200) with the "
    "filters updated as `object_types` and `payload_filters` say. Who may receive each "
    "event is checked again when it is delivered.",
    responses={
        200: {"description": "Your existing consumer.", "model": ConsumerRegistrationOut},
        **error_responses(
            400,
            401,
            403,
            409,
            503,
            descriptions={
                **_REGISTER_ERRORS,
                400: _REGISTER_ERRORS[400] + " Also: an unknown scope type or entity, a "
                "malformed uuid, a binding listed twice, more scopes than the limit, or "
                "`payload_filters` that is not an object of non-empty lists.",
                403: "A binding you may not hold (named), or `[]` (global) when you are not "
                "a staff or support user.",
            },
            models={409: QueueConflictBody},
        ),
    },
)
async def register_event_consumer(
    body: ConsumerRegistration,
    response: Response,
    user: CurrentUser,
    token: CallerToken,
    session: SessionDep,
    provisioner: ProvisionerDep,
    settings: SettingsDep,
) -> ConsumerRegistrationOut:
    consumer, created = await service.register(session, provisioner, settings, user, token, body)
    if not created:
        response.status_code = status.HTTP_200_OK
    facts = await service.facts_of(session, settings, [consumer])
    return ConsumerRegistrationOut.of_row(consumer, facts[consumer.uuid])


def consumer_filters(
    user_uuid: Annotated[
        uuid.UUID | None, Query(description="Only the consumers of this owner (hex or dashed).")
    ] = None,
    user_username: Annotated[
        str | None, Query(max_length=255, description="Only the consumers of this owner.")
    ] = None,
    is_global: Annotated[
        bool | None,
        Query(description="`true`: only global consumers (no scopes); `false`: only bound ones."),
    ] = None,
    o: Annotated[
        list[Literal["created", "-created"]] | None,
        Query(description="`created` (default, oldest first) or `-created`."),
    ] = None,
    delivery: Annotated[
        Delivery | None,
        Query(description="`rmq` (queue consumers) or `webhook` (webhook consumers)."),
    ] = None,
) -> ConsumerFilters:
    """The list filters of waldur-api-client 8.1.3's `event_consumers_list` / `_count`."""
    return ConsumerFilters(
        user_uuid=user_uuid,
        user_username=user_username,
        is_global=is_global,
        delivery=delivery,
        descending=o is not None and o[:1] == ["-created"],
    )


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
    settings: SettingsDep,
    page: Annotated[Page, Depends(page_params)],
    filters: Annotated[ConsumerFilters, Depends(consumer_filters)],
) -> list[ConsumerOut]:
    paged = await service.list_consumers(session, caller, filters, page)
    set_page_headers(request, response, page, paged.total)
    facts = await service.facts_of(session, settings, paged.rows)
    return [
        ConsumerOut.from_row(row, facts[row.uuid], as_staff=caller is None) for row in paged.rows
    ]


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
async def count_event_consumers(
    caller: AgentOrService,
    session: SessionDep,
    filters: Annotated[ConsumerFilters, Depends(consumer_filters)],
) -> Response:
    total = await service.count_consumers(session, caller, filters)
    return Response(status_code=status.HTTP_200_OK, headers={"X-Result-Count": str(total)})


@router.get(
    "/api/event-consumers/{consumer_uuid}/",
    summary="Get an event consumer",
    description="404 when it is another user's (a service token sees every consumer).",
    responses=error_responses(401, 404),
)
async def get_event_consumer(
    consumer_uuid: str, caller: AgentOrService, session: SessionDep, settings: SettingsDep
) -> ConsumerOut:
    consumer = await service.get_consumer(session, caller, consumer_uuid)
    facts = await service.facts_of(session, settings, [consumer])
    return ConsumerOut.from_row(consumer, facts[consumer.uuid], as_staff=caller is None)


@router.delete(
    "/api/event-consumers/{consumer_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete an event consumer",
    description="Deletes its queue (with any messages in it) and its broker user; a webhook "
    "consumer's copies not yet delivered are given up. A site agent's consumer is made again "
    "by the agent's next start.",
    responses=error_responses(401, 404),
)
async def delete_event_consumer(
    consumer_uuid: str, caller: AgentOrService, session: SessionDep, provisioner: ProvisionerDep
) -> Response:
    await service.delete_consumer(session, provisioner, caller, consumer_uuid)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/api/event-consumers/{consumer_uuid}/resync/",
    status_code=status.HTTP_202_ACCEPTED,
    summary="Send a consumer the current state (staff and support, or the service token)",
    description="Every active role grant the consumer may receive (within its bindings; every "
    "one for a global consumer; through its object types and payload filters) is sent once "
    'as a `user_role` message with `event_type: "role_snapshot"` (`user_uuid`, '
    "`user_username`, `role_name`, `scope_type`, `scope_uuid`, `expires_at`), through the "
    "consumer's own path (its queue or its webhook), to it alone. Answers 202 once they "
    "are written to the outbox.",
    responses=error_responses(
        401,
        403,
        404,
        descriptions={
            403: "You are neither a staff nor a support user.",
            404: "No such consumer, or another user's (a service token sees every one).",
        },
    ),
)
@service_too
async def resync_event_consumer(
    consumer_uuid: str,
    caller: AgentOrService,
    session: SessionDep,
    engine: EngineDep,
    settings: SettingsDep,
) -> ResyncOut:
    types, copies = await service.resync(session, engine, settings, caller, consumer_uuid)
    return ResyncOut(object_types=types, copies=copies)


def delivery_filters(
    state: Annotated[
        DeliveryState | None,
        Query(description="`pending`, `delivered`, `parked` or `given_up`."),
    ] = None,
    event_id: Annotated[
        str | None, Query(max_length=255, description="Only the copies of this event.")
    ] = None,
    object_type: Annotated[
        str | None, Query(max_length=64, description="Only the copies of this object type.")
    ] = None,
    accepted_after: Annotated[
        InputDateTime | None,
        Query(description="Only events accepted after this time (ISO 8601; no offset: UTC)."),
    ] = None,
    accepted_before: Annotated[
        InputDateTime | None,
        Query(description="Only events accepted before this time (ISO 8601; no offset: UTC)."),
    ] = None,
) -> DeliveryFilters:
    return DeliveryFilters(
        state=state,
        event_id=event_id,
        object_type=object_type,
        accepted_after=accepted_after,
        accepted_before=accepted_before,
    )


_DELIVERIES = (
    "The consumer's copies of events, newest first, from what the outbox keeps (as long as "
    "retention keeps the event): whether each is pending, delivered, parked or given up, how "
    "many attempts it took, the last one's answer and error, and why it was given up."
)


@router.get(
    "/api/event-consumers/{consumer_uuid}/deliveries/",
    summary="List what became of a consumer's copies (the owner, or the service token)",
    description=_DELIVERIES + " A bare JSON array; `X-Result-Count` and `Link` headers paginate.",
    responses=error_responses(
        400,
        401,
        404,
        descriptions={404: "No such consumer, or another user's (a service token sees every one)."},
    ),
)
@service_too
async def list_deliveries(
    consumer_uuid: str,
    request: Request,
    response: Response,
    caller: AgentOrService,
    session: SessionDep,
    page: Annotated[Page, Depends(page_params)],
    filters: Annotated[DeliveryFilters, Depends(delivery_filters)],
) -> list[DeliveryOut]:
    found, rows = await service.deliveries(session, caller, consumer_uuid, filters, page)
    set_bounded_page_headers(
        request, response, page, found.total, capped=found.capped, more=found.more
    )
    return rows


@router.get(
    "/api/event-consumers/{consumer_uuid}/deliveries/{event_id}/",
    summary="What became of a consumer's copy of one event, attempt by attempt",
    description="The consumer's copy of the event (its newest, when it was replayed) as the "
    "list shows it, with `attempt_log`: the last 20 attempts, oldest first, each `{at, "
    "duration_ms, status, error}`.",
    responses=error_responses(
        401,
        404,
        descriptions={404: "No such consumer, another user's, or no copy of that event for it."},
    ),
)
@service_too
async def get_delivery(
    consumer_uuid: str, event_id: str, caller: AgentOrService, session: SessionDep
) -> DeliveryDetailOut:
    return await service.delivery(session, caller, consumer_uuid, event_id)
