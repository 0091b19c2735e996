"""Agent-facing REST: Waldur-compatible paths, trailing slashes, hex uuids."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Depends, Query, Request, Response, status

from queuekeeper.auth.dependencies import CurrentAgent, CurrentUser
from queuekeeper.common.access import Caller
from queuekeeper.common.access import router as caller_router
from queuekeeper.common.openapi import QueueConflictBody, error_responses
from queuekeeper.common.pagination import Page, page_params, set_page_headers
from queuekeeper.state import EngineDep, ProvisionerDep, SessionDep, SettingsDep
from queuekeeper.subscriptions import service
from queuekeeper.subscriptions.schemas import (
    QueueCreate,
    QueueFilter,
    QueueOut,
    SubscriptionCreate,
    SubscriptionOut,
)

router = caller_router(Caller.AGENT, tags=["agents"])

NOT_YOURS = "Not yours, or not a uuid."
ERRORS = error_responses(401, 404, descriptions={404: NOT_YOURS})


@router.post(
    "/api/event-subscriptions/",
    status_code=status.HTTP_201_CREATED,
    summary="Create an event subscription",
    description="Creates the subscription, the owner's vhost (if new), the subscription's "
    "broker user (login = subscription uuid hex, password = your API token) and its "
    "read-only permissions on its own queues.",
    responses=error_responses(
        400,
        401,
        503,
        descriptions={400: "Bad body: an unknown object type, naming the field."},
    ),
)
async def create_subscription(
    body: SubscriptionCreate,
    request: Request,
    user: CurrentUser,
    session: SessionDep,
    provisioner: ProvisionerDep,
    settings: SettingsDep,
) -> SubscriptionOut:
    subscription = await service.create_subscription(
        session,
        provisioner,
        settings,
        user,
        body,
        source_ip=request.client.host if request.client else None,
    )
    return SubscriptionOut.from_row(subscription, user, settings)


@router.get(
    "/api/event-subscriptions/",
    summary="List your event subscriptions",
    description="A bare JSON array (Waldur style); `X-Result-Count` and `Link` headers paginate.",
    responses=error_responses(401),
)
async def list_subscriptions(
    request: Request,
    response: Response,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
    page: Annotated[Page, Depends(page_params)],
) -> list[SubscriptionOut]:
    found = await service.list_subscriptions(session, user, page)
    set_page_headers(request, response, page, found.total)
    return [SubscriptionOut.from_row(row, user, settings) for row in found.rows]


@router.get(
    "/api/event-subscriptions/{subscription_uuid}/",
    summary="Get one of your event subscriptions",
    description="404 when it is another user's.",
    responses=ERRORS,
)
async def get_subscription(
    subscription_uuid: str, user: CurrentUser, session: SessionDep, settings: SettingsDep
) -> SubscriptionOut:
    subscription = await service.get_subscription(session, user, subscription_uuid)
    return SubscriptionOut.from_row(subscription, user, settings)


@router.delete(
    "/api/event-subscriptions/{subscription_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete an event subscription",
    description="Deletes its queues from the broker, its broker user, and the vhost if it was "
    "your last subscription. Broker failures are logged; the next reconcile removes leftovers.",
    responses=ERRORS,
)
async def delete_subscription(
    subscription_uuid: str, user: CurrentUser, session: SessionDep, provisioner: ProvisionerDep
) -> Response:
    await service.delete_subscription(session, provisioner, user, subscription_uuid)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/api/event-subscriptions/{subscription_uuid}/create_queue/",
    status_code=status.HTTP_201_CREATED,
    summary="Register a queue for (offering, object type)",
    description="201 when new, 200 with the same body when it exists (the broker queue is "
    "ensured again either way). Answers only once the broker queue exists with the right "
    "arguments, so the agent may subscribe to `/amq/queue/<queue_name>` at once.",
    responses={
        200: {"description": "Already registered.", "model": QueueOut},
        **error_responses(
            400,
            401,
            403,
            404,
            409,
            503,
            descriptions={
                400: "Bad body: unknown object type or offering, malformed uuid.",
                403: "No access to the offering.",
                404: NOT_YOURS,
                409: "A queue with other arguments holds messages or has consumers; the body "
                "says what the operator should do.",
                503: "Broker or Management API unreachable; nothing was stored. Retry after "
                "`Retry-After` seconds.",
            },
            models={409: QueueConflictBody},
        ),
    },
)
async def create_queue(
    subscription_uuid: str,
    body: QueueCreate,
    response: Response,
    user: CurrentAgent,
    engine: EngineDep,
    provisioner: ProvisionerDep,
    settings: SettingsDep,
) -> QueueOut:
    queue, created = await service.create_queue(
        engine, provisioner, settings, user, subscription_uuid, body
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    return QueueOut.from_row(queue, settings)


@router.get(
    "/api/event-subscription-queues/",
    summary="List your queues",
    description="Filter by `offering_uuid`, `object_type`, `event_subscription_uuid`. A bare "
    "JSON array; `X-Result-Count` and `Link` headers paginate.",
    responses=error_responses(401),
)
async def list_queues(
    request: Request,
    response: Response,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
    page: Annotated[Page, Depends(page_params)],
    offering_uuid: Annotated[uuid.UUID | None, Query()] = None,
    object_type: Annotated[str | None, Query()] = None,
    event_subscription_uuid: Annotated[uuid.UUID | None, Query()] = None,
) -> list[QueueOut]:
    where = QueueFilter(offering_uuid, object_type, event_subscription_uuid)
    found = await service.list_queues(session, user, where, page)
    set_page_headers(request, response, page, found.total)
    return [QueueOut.from_row(row, settings) for row in found.rows]


@router.get(
    "/api/event-subscription-queues/{queue_uuid}/",
    summary="Get one of your queues",
    description="404 when it is another user's.",
    responses=ERRORS,
)
async def get_queue(
    queue_uuid: str, user: CurrentUser, session: SessionDep, settings: SettingsDep
) -> QueueOut:
    return QueueOut.from_row(await service.get_queue(session, user, queue_uuid), settings)


@router.delete(
    "/api/event-subscription-queues/{queue_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete one of your queues",
    description="Deletes the row and the broker queue (a broker failure is logged, not raised).",
    responses=ERRORS,
)
async def delete_queue(
    queue_uuid: str, user: CurrentUser, session: SessionDep, provisioner: ProvisionerDep
) -> Response:
    await service.delete_queue(session, provisioner, user, queue_uuid)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
