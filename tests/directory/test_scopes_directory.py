"""The directory of contract §12: customers, projects, an offering's customer and project,
users' staff and support flags, and role grants, idempotent as section 5's."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import httpx

from tests.conftest import SERVICE_TOKEN
from tests.helpers import Backend

INTERNAL = "/api/internal"
SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


async def put(client: httpx.AsyncClient, path: str, body: object) -> httpx.Response:
    return await client.put(f"{INTERNAL}{path}", json=body, headers=SERVICE)


async def delete(client: httpx.AsyncClient, path: str) -> httpx.Response:
    return await client.delete(f"{INTERNAL}{path}", headers=SERVICE)


async def test_customers_projects_and_offerings_are_idempotent(
    client: httpx.AsyncClient,
) -> None:
    customer, project, offering = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    made = await put(client, f"/customers/{customer}/", {"name": "Uni"})
    assert made.status_code == 201, made.text
    assert made.json()["uuid"] == customer.hex
    again = await put(client, f"/customers/{customer.hex}/", {"name": "University"})
    assert (again.status_code, again.json()["name"]) == (200, "University")

    body = {"name": "Climate", "customer_uuid": customer.hex}
    assert (await put(client, f"/projects/{project}/", body)).status_code == 201
    second = await put(client, f"/projects/{project}/", body)
    assert (second.status_code, second.json()["customer_uuid"]) == (200, customer.hex)

    first = await put(
        client,
        f"/offerings/{offering}/",
        {"name": "HPC", "customer_uuid": customer.hex, "project_uuid": project.hex},
    )
    assert first.status_code == 201, first.text
    assert (first.json()["customer_uuid"], first.json()["project_uuid"]) == (
        customer.hex,
        project.hex,
    )
    # Left out: kept. Null: cleared.
    kept = await put(client, f"/offerings/{offering}/", {"name": "HPC 2"})
    assert (kept.status_code, kept.json()["customer_uuid"]) == (200, customer.hex)
    cleared = await put(client, f"/offerings/{offering}/", {"name": "HPC", "project_uuid": None})
    assert cleared.json()["project_uuid"] is None

    # Deleting the customer takes its projects; its offering stays, without a customer.
    assert (await delete(client, f"/customers/{customer}/")).status_code == 204
    assert (await delete(client, f"/customers/{customer}/")).status_code == 204
    again_project = await put(client, f"/projects/{project}/", body)
    assert again_project.status_code == 400
    offering_now = await put(client, f"/offerings/{offering}/", {"name": "HPC"})
    assert offering_now.json()["customer_uuid"] is None
    assert (await delete(client, f"/projects/{project}/")).status_code == 204


async def test_unknown_references_are_400s_naming_them(client: httpx.AsyncClient) -> None:
    unknown = uuid.uuid4().hex
    user = uuid.uuid4()
    assert (await put(client, f"/users/{user}/", {"username": "u"})).status_code == 201
    customer = uuid.uuid4()
    await put(client, f"/customers/{customer}/", {"name": "C"})
    cases = [
        (f"/projects/{uuid.uuid4()}/", {"name": "P", "customer_uuid": unknown}, "customer_uuid"),
        (f"/offerings/{uuid.uuid4()}/", {"name": "O", "customer_uuid": unknown}, "customer_uuid"),
        (f"/offerings/{uuid.uuid4()}/", {"name": "O", "project_uuid": unknown}, "project_uuid"),
        (
            f"/roles/{uuid.uuid4()}/",
            {
                "user_uuid": unknown,
                "role_name": "owner",
                "scope": {"type": "customer", "uuid": customer.hex},
            },
            "user_uuid",
        ),
        (
            f"/roles/{uuid.uuid4()}/",
            {
                "user_uuid": user.hex,
                "role_name": "m",
                "scope": {"type": "project", "uuid": unknown},
            },
            "scope.uuid",
        ),
        (
            f"/roles/{uuid.uuid4()}/",
            {"user_uuid": user.hex, "role_name": "m", "scope": {"type": "team", "uuid": unknown}},
            "scope.type",
        ),
        (
            "/roles/not-a-uuid/",
            {
                "user_uuid": user.hex,
                "role_name": "m",
                "scope": {"type": "customer", "uuid": customer.hex},
            },
            "role_uuid",
        ),
        (f"/customers/{uuid.uuid4()}/", {"name": ""}, "name"),
    ]
    for path, body, field in cases:
        answer = await put(client, path, body)
        assert answer.status_code == 400, (path, answer.text)
        named = answer.json().get("errors", [{}])[0].get("field") or answer.json()["detail"]
        assert field in named, (path, answer.json())
        if field in ("customer_uuid", "project_uuid", "user_uuid", "scope.uuid"):
            assert unknown in answer.json()["detail"]  # which entity is unknown
    # Nothing was stored by the refused calls.
    assert (await put(client, f"/customers/{customer}/", {"name": "C"})).status_code == 200


async def test_roles_are_idempotent_and_delete_answers_204_when_gone(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent = await backend.put_user()
    customer = uuid.uuid4()
    await put(client, f"/customers/{customer}/", {"name": "C"})
    role = uuid.uuid4()
    expires = datetime(2030, 1, 1, tzinfo=UTC)
    body = {
        "user_uuid": agent.uuid.hex,
        "role_name": "CUSTOMER.OWNER",
        "scope": {"type": "customer", "uuid": str(customer)},
        "expires_at": expires.isoformat(),
    }
    made = await put(client, f"/roles/{role}/", body)
    assert made.status_code == 201, made.text
    assert made.json()["scope"] == {"type": "customer", "uuid": customer.hex}
    assert datetime.fromisoformat(made.json()["expires_at"]) == expires
    later = {**body, "expires_at": (expires + timedelta(days=1)).isoformat()}
    updated = await put(client, f"/roles/{role}/", later)
    assert updated.status_code == 200
    assert datetime.fromisoformat(updated.json()["expires_at"]) == expires + timedelta(days=1)
    assert (await delete(client, f"/roles/{role}/")).status_code == 204
    assert (await delete(client, f"/roles/{role}/")).status_code == 204
    assert (await put(client, f"/roles/{role}/", body)).status_code == 201


async def test_users_staff_and_support_flags(client: httpx.AsyncClient) -> None:
    user = uuid.uuid4()
    made = await put(client, f"/users/{user}/", {"username": "s", "is_staff": True})
    assert (made.json()["is_staff"], made.json()["is_support"]) == (True, False)
    support = await put(client, f"/users/{user}/", {"username": "s", "is_support": True})
    # Absent means false: the backend pushes the whole user.
    assert (support.json()["is_staff"], support.json()["is_support"]) == (False, True)
    bad = await put(client, f"/users/{user}/", {"username": "s", "is_staff": "maybe"})
    assert bad.status_code == 400
    assert "is_staff" in bad.json()["errors"][0]["field"]
