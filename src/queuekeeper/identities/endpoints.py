"""`/api/marketplace-site-agent-identities/`: the requests waldur-site-agent makes at start-up.

Status codes are the ones the agent's client accepts (agent-protocols 1.0.5 §2):
POST answers 201 only, PUT 200 only, register_event_subscription 201 or 200.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Depends, Query, Request, Response, status

from queuekeeper.admin.routes import admin_router as make_admin_router
from queuekeeper.auth.dependencies import CurrentUser
from queuekeeper.common.access import Caller
from queuekeeper.common.access import router as caller_router
from queuekeeper.common.openapi import error_responses
from queuekeeper.common.pagination import Page, page_params, set_page_headers
from queuekeeper.identities import service
from queuekeeper.identities.schemas import (
    COLLECTION,
    AdminIdentityOut,
    IdentityOut,
    IdentityWrite,
    RegisterEventSubscription,
)
from queuekeeper.state import ProvisionerDep, SessionDep, SettingsDep
from queuekeeper.subscriptions.schemas import SubscriptionOut

router = caller_router(Caller.AGENT, prefix=f"/api/{COLLECTION}", tags=["agents"])
admin_router = make_admin_router("/agent-identities")

NOT_YOURS = "Not one of your identities, or not a uuid."
ERRORS = error_responses(401, 404, descriptions={404: NOT_YOURS})
WRITE_DESCRIPTIONS = {
    400: "Bad body: malformed or unknown offering, missing name (the field is named).",
    403: "You have no access to the offering.",
    404: NOT_YOURS,
    409: "You already have an identity with this name (the answer names it).",
}


@router.get(
    "/",
    summary="List your agent identities",
    description="A bare JSON array (the agent reads element 0 of `?name=`), oldest first, "
    "only identities you registered. `X-Result-Count` and `Link` headers paginate.",
    responses=error_responses(400, 401),
)
async def list_identities(
    request: Request,
    response: Response,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
    page: Annotated[Page, Depends(page_params)],
    name: Annotated[str | None, Query(description="Exact name.")] = None,
    offering_uuid: Annotated[uuid.UUID | None, Query(description="Hex or dashed.")] = None,
) -> list[IdentityOut]:
    found = await service.list_identities(
        session, user, name=name, offering_uuid=offering_uuid, page=page
    )
    set_page_headers(request, response, page, found.total)
    return [IdentityOut.from_row(row, settings) for row in found.rows]


@router.post(
    "/",
    status_code=status.HTTP_201_CREATED,
    summary="Register an agent identity",
    description="201 only (the agent accepts nothing else). The offering may be sent hex or "
    "dashed, in any case; an offering uuid that is not lowercase is accepted but logged as a "
    "warning, because the agent would compute queue names that do not exist.",
    responses=error_responses(400, 401, 403, 409, descriptions=WRITE_DESCRIPTIONS),
)
async def create_identity(
    body: IdentityWrite, user: CurrentUser, session: SessionDep, settings: SettingsDep
) -> IdentityOut:
    identity = await service.create_identity(session, settings, user, body)
    return IdentityOut.from_row(identity, settings)


@router.get(
    "/{identity_uuid}/",
    summary="Get one of your agent identities",
    description="404 when it is not yours.",
    responses=ERRORS,
)
async def get_identity(
    identity_uuid: str, user: CurrentUser, session: SessionDep, settings: SettingsDep
) -> IdentityOut:
    identity = await service.get_identity(session, user, identity_uuid)
    return IdentityOut.from_row(identity, settings)


@router.put(
    "/{identity_uuid}/",
    summary="Update an agent identity (the agent does this on every restart)",
    description="200 only. `offering` and `name` are required; optional fields left out keep "
    "their value. `last_restarted` without an offset is taken as UTC.",
    responses=error_responses(400, 401, 403, 404, 409, descriptions=WRITE_DESCRIPTIONS),
)
async def update_identity(
    identity_uuid: str,
    body: IdentityWrite,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
) -> IdentityOut:
    identity = await service.update_identity(session, settings, user, identity_uuid, body)
    return IdentityOut.from_row(identity, settings)


@router.delete(
    "/{identity_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete an agent identity",
    description="Also deletes the subscriptions registered through it, with their queues and "
    "broker users. Allowed after your access to the offering was revoked.",
    responses=ERRORS,
)
async def delete_identity(
    identity_uuid: str, user: CurrentUser, session: SessionDep, provisioner: ProvisionerDep
) -> Response:
    await service.delete_identity(session, provisioner, user, identity_uuid)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/{identity_uuid}/register_event_subscription/",
    status_code=status.HTTP_201_CREATED,
    summary="Get or make the subscription for one object type",
    description="200 with your existing subscription for this identity and object type when "
    "its broker user is intact (its password is reset to the token you called with); 201 with "
    "a new one otherwise, and the broken one is deleted with its queues and broker user. "
    "Restarting agents therefore never pile up subscriptions, broker users or queues.",
    responses={
        200: {"description": "The existing subscription.", "model": SubscriptionOut},
        **error_responses(
            400,
            401,
            403,
            404,
            409,
            503,
            descriptions={
                400: "Unknown object type (the field is named).",
                403: "You have no access to the identity's offering.",
                404: NOT_YOURS,
                409: "The owner's vhost exists on the broker but is not this installation's.",
                503: "Broker or Management API unreachable; nothing was changed. Retry after "
                "`Retry-After` seconds.",
            },
        ),
    },
)
async def register_event_subscription(
    identity_uuid: str,
    body: RegisterEventSubscription,
    request: Request,
    response: Response,
    user: CurrentUser,
    session: SessionDep,
    provisioner: ProvisionerDep,
    settings: SettingsDep,
) -> SubscriptionOut:
    subscription, created = await service.register_event_subscription(
        session,
        provisioner,
        settings,
        user,
        identity_uuid,
        body,
        source_ip=request.client.host if request.client else None,
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    return SubscriptionOut.from_row(subscription, user, settings)


@admin_router.get(
    "/",
    summary="Site agents as queuekeeper sees them",
    description="Every agent identity with its owner, version and last restart, the "
    "subscription per object type it registered (agents 1.0.5) or its consumer (agents 1.0.7: "
    "one queue, with `arguments_ok` and `differences`), and each queue with the broker's view: "
    "`present`, `consumers` (0 means the agent is not consuming: a wrong STOMP setting, a "
    "reconnect loop, or an agent that is down) and `messages` (waiting for it). Oldest first; "
    "`broker=false` skips the broker.",
    responses=error_responses(
        400,
        401,
        403,
        503,
        descriptions={
            401: "No or unknown service token.",
            403: "An agent token was sent.",
            503: "Management API unreachable: retry after `Retry-After` seconds, or ask with "
            "`broker=false`.",
        },
    ),
)
async def admin_list_identities(
    request: Request,
    response: Response,
    session: SessionDep,
    provisioner: ProvisionerDep,
    page: Annotated[Page, Depends(page_params)],
    offering_uuid: Annotated[uuid.UUID | None, Query(description="Hex or dashed.")] = None,
    user_uuid: Annotated[uuid.UUID | None, Query(description="The owner, hex or dashed.")] = None,
    broker: Annotated[bool, Query(description="Ask the broker for each queue.")] = True,
) -> list[AdminIdentityOut]:
    found = await service.admin_overview(
        session,
        provisioner,
        offering_uuid=offering_uuid,
        user_uuid=user_uuid,
        page=page,
        with_broker=broker,
    )
    set_page_headers(request, response, page, found.total)
    return found.rows
