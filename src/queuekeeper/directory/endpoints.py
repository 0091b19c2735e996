"""Internal directory API (service token) and the agent's own user record."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Response, status
from pydantic import BaseModel

from queuekeeper.auth.dependencies import CurrentUser, service_router
from queuekeeper.common.access import Caller
from queuekeeper.common.access import router as caller_router
from queuekeeper.common.openapi import error_responses
from queuekeeper.common.schemas import parse_path_uuid
from queuekeeper.directory import service
from queuekeeper.directory.schemas import AccessOut, OfferingOut, OfferingPut, UserOut, UserPut
from queuekeeper.exceptions import BadRequest, shown
from queuekeeper.state import ProvisionerDep, SessionDep, SettingsDep

internal_router = service_router(prefix="/api/internal", tags=["internal"])
agent_router = caller_router(Caller.AGENT, tags=["agents"])

SERVICE_DESCRIPTIONS = {
    400: "Bad body or a malformed uuid in the path (the field is named).",
    401: "No or unknown service token.",
    403: "An agent token was sent where a service token is needed.",
}
SERVICE_ERRORS = error_responses(400, 401, 403, descriptions=SERVICE_DESCRIPTIONS)


def created_or_updated(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {
        201: {"description": "Created.", "model": model},
        200: {"description": "Updated (or unchanged).", "model": model},
    }


def _uuid(value: str, what: str) -> uuid.UUID:
    parsed = parse_path_uuid(value)
    if parsed is None:
        raise BadRequest(f"{what} {shown(value)} is not a uuid (hex or dashed form).", field=what)
    return parsed


@internal_router.put(
    "/users/{user_uuid}/",
    summary="Create or update a user",
    description="Idempotent. Fields left out keep their value; `token: null` removes the token. "
    "A changed token becomes the broker password of all the user's subscriptions.",
    responses={
        **created_or_updated(UserOut),
        **error_responses(
            400,
            401,
            403,
            503,
            descriptions={
                **SERVICE_DESCRIPTIONS,
                503: "The user was saved but RabbitMQ could not be given the new password; "
                "repeat the same PUT.",
            },
        ),
    },
)
async def put_user(
    user_uuid: str,
    body: UserPut,
    response: Response,
    session: SessionDep,
    provisioner: ProvisionerDep,
    settings: SettingsDep,
) -> UserOut:
    user, created = await service.put_user(
        session, provisioner, _uuid(user_uuid, "user_uuid"), body
    )
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return UserOut.from_row(user, settings)


@internal_router.delete(
    "/users/{user_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a user",
    description="Deletes its subscriptions, queues, broker users and vhost. 204 also when gone.",
    responses=SERVICE_ERRORS,
)
async def delete_user(user_uuid: str, session: SessionDep, provisioner: ProvisionerDep) -> Response:
    await service.delete_user(session, provisioner, _uuid(user_uuid, "user_uuid"))
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@internal_router.put(
    "/offerings/{offering_uuid}/",
    summary="Create or update an offering",
    description="Idempotent.",
    responses={**created_or_updated(OfferingOut), **SERVICE_ERRORS},
)
async def put_offering(
    offering_uuid: str, body: OfferingPut, response: Response, session: SessionDep
) -> OfferingOut:
    offering, created = await service.put_offering(
        session, _uuid(offering_uuid, "offering_uuid"), body
    )
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return OfferingOut.from_row(offering)


@internal_router.delete(
    "/offerings/{offering_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete an offering",
    description="Deletes its access grants and every queue registered for it. 204 also when gone.",
    responses=SERVICE_ERRORS,
)
async def delete_offering(
    offering_uuid: str, session: SessionDep, provisioner: ProvisionerDep
) -> Response:
    await service.delete_offering(session, provisioner, _uuid(offering_uuid, "offering_uuid"))
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@internal_router.put(
    "/offerings/{offering_uuid}/users/{user_uuid}/",
    summary="Grant a user access to an offering",
    description="Idempotent; no body.",
    responses={
        **created_or_updated(AccessOut),
        **error_responses(
            400,
            401,
            403,
            404,
            descriptions={**SERVICE_DESCRIPTIONS, 404: "User or offering not pushed yet."},
        ),
    },
)
async def grant_access(
    offering_uuid: str, user_uuid: str, response: Response, session: SessionDep
) -> AccessOut:
    grant, created = await service.grant_access(
        session, _uuid(user_uuid, "user_uuid"), _uuid(offering_uuid, "offering_uuid")
    )
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return AccessOut.from_row(grant)


@internal_router.delete(
    "/offerings/{offering_uuid}/users/{user_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Revoke a user's access to an offering",
    description="Delivery stops at once: the user's queues for the offering are deleted.",
    responses=SERVICE_ERRORS,
)
async def revoke_access(
    offering_uuid: str, user_uuid: str, session: SessionDep, provisioner: ProvisionerDep
) -> Response:
    await service.revoke_access(
        session,
        provisioner,
        _uuid(user_uuid, "user_uuid"),
        _uuid(offering_uuid, "offering_uuid"),
    )
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@agent_router.get(
    "/api/users/me/",
    summary="Your own user record",
    description="The record behind your token.",
    responses=error_responses(401),
)
async def get_me(user: CurrentUser, settings: SettingsDep) -> UserOut:
    return UserOut.from_row(user, settings)


@agent_router.get(
    "/api/users/{user_uuid}/",
    summary="A user record (only your own)",
    description="The `user` field of a subscription points here. 404 for anyone else's.",
    responses=error_responses(401, 404, descriptions={404: "Not you, or not a uuid."}),
)
async def get_user(user_uuid: str, user: CurrentUser, settings: SettingsDep) -> UserOut:
    return UserOut.from_row(service.own_record(user, user_uuid), settings)
