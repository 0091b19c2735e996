"""Helpers for contract §12's tests: the directory's customers, projects and roles."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from tests.conftest import SERVICE_TOKEN
from tests.helpers import Agent, Backend

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


@dataclass
class Tree:
    """A customer with a project, and an offering of the customer in that project."""

    customer: uuid.UUID
    project: uuid.UUID
    offering: uuid.UUID
    extra: dict[str, Any] = field(default_factory=dict)


async def put(client: httpx.AsyncClient, path: str, body: object) -> httpx.Response:
    response = await client.put(f"/api/internal{path}", json=body, headers=SERVICE)
    assert response.status_code in (200, 201), response.text
    return response


async def customer(client: httpx.AsyncClient) -> uuid.UUID:
    found = uuid.uuid4()
    await put(client, f"/customers/{found}/", {"name": f"customer-{found.hex[:6]}"})
    return found


async def project(client: httpx.AsyncClient, customer_uuid: uuid.UUID) -> uuid.UUID:
    found = uuid.uuid4()
    await put(
        client, f"/projects/{found}/", {"name": "project", "customer_uuid": customer_uuid.hex}
    )
    return found


async def tree(client: httpx.AsyncClient) -> Tree:
    owner = await customer(client)
    inside = await project(client, owner)
    offering = uuid.uuid4()
    await put(
        client,
        f"/offerings/{offering}/",
        {"name": "HPC", "customer_uuid": owner.hex, "project_uuid": inside.hex},
    )
    return Tree(owner, inside, offering)


async def role(
    client: httpx.AsyncClient,
    agent: Agent,
    kind: str,
    entity: uuid.UUID,
    *,
    expires_at: datetime | None = None,
) -> uuid.UUID:
    found = uuid.uuid4()
    await put(
        client,
        f"/roles/{found}/",
        {
            "user_uuid": agent.uuid.hex,
            "role_name": f"{kind}.member",
            "scope": {"type": kind, "uuid": entity.hex},
            "expires_at": expires_at.isoformat() if expires_at else None,
        },
    )
    return found


async def unrole(client: httpx.AsyncClient, role_uuid: uuid.UUID) -> None:
    response = await client.delete(f"/api/internal/roles/{role_uuid}/", headers=SERVICE)
    assert response.status_code == 204


async def staff(backend: Backend, **flags: bool) -> Agent:
    return await backend.put_user(**(flags or {"is_staff": True}))


def scopes(*pairs: tuple[str, uuid.UUID]) -> list[dict[str, str]]:
    return [{"type": kind, "uuid": entity.hex} for kind, entity in pairs]
