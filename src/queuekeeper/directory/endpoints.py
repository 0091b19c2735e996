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
from queuekeeper.directory.schemas import (
    AccessOut,
    CustomerOut,
    CustomerPut,
    OfferingOut,
    OfferingPut,
    ProjectOut,
    ProjectPut,
    RoleOut,
    RolePut,
    UserOut,
    UserPut,
)
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
    "/customers/{customer_uuid}/",
    summary="Create or update a customer",
    description="Idempotent. Consumers bind customers; roles are held on them (contract §12).",
    responses={**created_or_updated(CustomerOut), **SERVICE_ERRORS},
)
async def put_customer(
    customer_uuid: str, body: CustomerPut, response: Response, session: SessionDep
) -> CustomerOut:
    customer, created = await service.put_customer(
        session, _uuid(customer_uuid, "customer_uuid"), body
    )
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return CustomerOut.from_row(customer)


@internal_router.delete(
    "/customers/{customer_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a customer",
    description="Its projects and the roles on it and them go too; its offerings stay, "
    "without a customer. 204 also when gone.",
    responses=SERVICE_ERRORS,
)
async def delete_customer(customer_uuid: str, session: SessionDep) -> Response:
    await service.delete_customer(session, _uuid(customer_uuid, "customer_uuid"))
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@internal_router.put(
    "/projects/{project_uuid}/",
    summary="Create or update a project",
    description="Idempotent. `customer_uuid` must have been pushed (else a 400 naming it).",
    responses={**created_or_updated(ProjectOut), **SERVICE_ERRORS},
)
async def put_project(
    project_uuid: str, body: ProjectPut, response: Response, session: SessionDep
) -> ProjectOut:
    project, created = await service.put_project(session, _uuid(project_uuid, "project_uuid"), body)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return ProjectOut.from_row(project)


@internal_router.delete(
    "/projects/{project_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a project",
    description="The roles on it go too. 204 also when gone.",
    responses=SERVICE_ERRORS,
)
async def delete_project(project_uuid: str, session: SessionDep) -> Response:
    await service.delete_project(session, _uuid(project_uuid, "project_uuid"))
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@internal_router.put(
    "/roles/{role_uuid}/",
    summary="Create or update a role grant",
    description="A user's role on a customer, a project or an offering, until `expires_at`. "
    "It lets the user bind that entity (and what is below it) to a consumer, and is checked "
    "again for every event delivered. The user and the scope must have been pushed (else a "
    "400 naming which).",
    responses={**created_or_updated(RoleOut), **SERVICE_ERRORS},
)
async def put_role(
    role_uuid: str,
    body: RolePut,
    response: Response,
    session: SessionDep,
) -> RoleOut:
    role, created = await service.put_role(session, _uuid(role_uuid, "role_uuid"), body)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return RoleOut.from_row(role)


@internal_router.delete(
    "/roles/{role_uuid}/",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a role grant",
    description="Delivery through it stops with the next event, and the copies its user may "
    "no longer receive are taken out of its consumers' queues. 204 also when gone.",
    responses=SERVICE_ERRORS,
)
async def delete_role(role_uuid: str, session: SessionDep) -> Response:
    await service.delete_role(session, _uuid(role_uuid, "role_uuid"))
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@internal_router.put(
    "/offerings/{offering_uuid}/",
    summary="Create or update an offering",
    description="Idempotent. `customer_uuid` (the provider's) and `project_uuid`, when sent, "
    "must have been pushed (else a 400 naming which); left out, they keep their value.",
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
