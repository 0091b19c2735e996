"""Agent-facing REST: Waldur-compatible paths, trailing slashes, hex uuids."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response, status

from queuekeeper.auth.dependencies import CurrentUser
from queuekeeper.broker.management import ManagementError
from queuekeeper.broker.provisioner import QueueConflict, QueueOutcome
from queuekeeper.common.openapi import QueueConflictBody, error_responses
from queuekeeper.common.pagination import Page, fetch_page, page_params, set_page_headers
from queuekeeper.common.schemas import parse_path_uuid
from queuekeeper.common.urls import api_url
from queuekeeper.config import Settings
from queuekeeper.exceptions import NotFound
from queuekeeper.models import EventSubscription, EventSubscriptionQueue, User
from queuekeeper.observability.metrics import CREATE_QUEUE
from queuekeeper.state import SessionDep, StateDep
from queuekeeper.subscriptions import repository, service
from queuekeeper.subscriptions.schemas import (
    QueueCreate,
    QueueOut,
    SubscriptionCreate,
    SubscriptionOut,
)

router = APIRouter(tags=["agents"])

NOT_YOURS = "Not yours, or not a uuid."
ERRORS = error_responses(401, 404, descriptions={404: NOT_YOURS})


def subscription_out(
    settings: Settings, subscription: EventSubscription, owner: User
) -> SubscriptionOut:
    return SubscriptionOut(
        uuid=subscription.uuid,
        url=api_url(settings, "event-subscriptions", subscription.uuid),
        user=api_url(settings, "users", owner.uuid),
        user_uuid=owner.uuid,
        user_username=owner.username,
        user_full_name=owner.full_name,
        created=subscription.created,
        modified=subscription.modified,
        source_ip=subscription.source_ip,
        description=subscription.description,
        observable_objects=list(subscription.observable_objects or []),
    )


def queue_out(settings: Settings, queue: EventSubscriptionQueue) -> QueueOut:
    return QueueOut(
        uuid=queue.uuid,
        url=api_url(settings, "event-subscription-queues", queue.uuid),
        event_subscription=api_url(settings, "event-subscriptions", queue.subscription_uuid),
        event_subscription_uuid=queue.subscription_uuid,
        offering_uuid=queue.offering_uuid,
        object_type=queue.object_type,
        queue_name=queue.queue_name,
        vhost=queue.vhost,
        created=queue.created,
    )


async def owned_subscription(
    subscription_uuid: str, user: CurrentUser, session: SessionDep
) -> EventSubscription:
    parsed = parse_path_uuid(subscription_uuid)
    subscription = (
        await repository.get_owned_subscription(session, user.uuid, parsed) if parsed else None
    )
    if subscription is None:
        raise NotFound(f"Event subscription {subscription_uuid!r} not found.")
    return subscription


OwnedSubscription = Annotated[EventSubscription, Depends(owned_subscription)]


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
    state: StateDep,
) -> SubscriptionOut:
    subscription = await service.create_subscription(
        session,
        state.provisioner,
        user,
        body,
        source_ip=request.client.host if request.client else None,
    )
    return subscription_out(state.settings, subscription, user)


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
    state: StateDep,
    page: Annotated[Page, Depends(page_params)],
) -> list[SubscriptionOut]:
    query = repository.owned_subscriptions(user.uuid)
    total, rows = await fetch_page(
        session,
        query,
        EventSubscription.created,
        EventSubscription.uuid,
        offset=page.offset,
        limit=page.page_size,
    )
    set_page_headers(request, response, page, total)
    return [subscription_out(state.settings, row, user) for row in rows]


@router.get(
    "/api/event-subscriptions/{subscription_uuid}/",
    summary="Get one of your event subscriptions",
    description="404 when it is another user's.",
    responses=ERRORS,
)
async def get_subscription(
    subscription: OwnedSubscription, user: CurrentUser, state: StateDep
) -> SubscriptionOut:
    return subscription_out(state.settings, subscription, user)


@router.delete(
    "/api/event-subscriptions/{subscription_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete an event subscription",
    description="Deletes its queues from the broker, its broker user, and the vhost if it was "
    "your last subscription. Broker failures are logged; the next reconcile removes leftovers.",
    responses=ERRORS,
)
async def delete_subscription(
    subscription: OwnedSubscription, session: SessionDep, state: StateDep
) -> Response:
    await service.delete_subscriptions(session, state.provisioner, [subscription])
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
    body: QueueCreate,
    response: Response,
    subscription: OwnedSubscription,
    user: CurrentUser,
    session: SessionDep,
    state: StateDep,
) -> QueueOut:
    try:
        queue, created, outcome = await service.create_queue(
            session, state.provisioner, user, subscription, body
        )
    except QueueConflict:
        CREATE_QUEUE.labels(outcome="conflict").inc()
        raise
    except ManagementError:
        CREATE_QUEUE.labels(outcome="broker_unavailable").inc()
        raise
    if outcome is QueueOutcome.REPAIRED:
        CREATE_QUEUE.labels(outcome="repaired").inc()
    else:
        CREATE_QUEUE.labels(outcome="created" if created else "existing").inc()
    if not created:
        response.status_code = status.HTTP_200_OK
    return queue_out(state.settings, queue)


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
    state: StateDep,
    page: Annotated[Page, Depends(page_params)],
    offering_uuid: Annotated[uuid.UUID | None, Query()] = None,
    object_type: Annotated[str | None, Query()] = None,
    event_subscription_uuid: Annotated[uuid.UUID | None, Query()] = None,
) -> list[QueueOut]:
    query = repository.owned_queues(user.uuid)
    if offering_uuid is not None:
        query = query.where(EventSubscriptionQueue.offering_uuid == offering_uuid)
    if object_type is not None:
        query = query.where(EventSubscriptionQueue.object_type == object_type)
    if event_subscription_uuid is not None:
        query = query.where(EventSubscriptionQueue.subscription_uuid == event_subscription_uuid)
    total, rows = await fetch_page(
        session,
        query,
        EventSubscriptionQueue.created,
        EventSubscriptionQueue.uuid,
        offset=page.offset,
        limit=page.page_size,
    )
    set_page_headers(request, response, page, total)
    return [queue_out(state.settings, row) for row in rows]


async def owned_queue(
    queue_uuid: str, user: CurrentUser, session: SessionDep
) -> EventSubscriptionQueue:
    parsed = parse_path_uuid(queue_uuid)
    queue = (
        await session.scalar(
            repository.owned_queues(user.uuid).where(EventSubscriptionQueue.uuid == parsed)
        )
        if parsed
        else None
    )
    if queue is None:
        raise NotFound(f"Event subscription queue {queue_uuid!r} not found.")
    return queue


OwnedQueue = Annotated[EventSubscriptionQueue, Depends(owned_queue)]


@router.get(
    "/api/event-subscription-queues/{queue_uuid}/",
    summary="Get one of your queues",
    description="404 when it is another user's.",
    responses=ERRORS,
)
async def get_queue(queue: OwnedQueue, state: StateDep) -> QueueOut:
    return queue_out(state.settings, queue)


@router.delete(
    "/api/event-subscription-queues/{queue_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete one of your queues",
    description="Deletes the row and the broker queue (a broker failure is logged, not raised).",
    responses=ERRORS,
)
async def delete_queue(queue: OwnedQueue, session: SessionDep, state: StateDep) -> Response:
    await service.delete_queue(session, state.provisioner, queue)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
