"""The operator surface: who may call it, the queue view, and its documentation."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from tests.helpers import Backend, Operator
from tests.reconcile.test_reconcile import SPEC_ARGUMENTS, registered_queue

ADMIN_CALLS = [
    ("POST", "/api/admin/reconcile/"),
    ("POST", "/api/admin/cleanup-stale/"),
    ("GET", "/api/admin/reconcile-runs/"),
    ("GET", "/api/admin/queues/"),
    ("GET", "/api/admin/dead-letters/"),
    ("POST", "/api/admin/dead-letters/redrive/"),
]


@pytest.mark.parametrize(("method", "path"), ADMIN_CALLS)
async def test_admin_routes_need_a_service_token(
    client: httpx.AsyncClient, backend: Backend, method: str, path: str
) -> None:
    assert (await client.request(method, path)).status_code == 401
    bad = {"Authorization": "Bearer not-a-service-token"}
    assert (await client.request(method, path, headers=bad)).status_code == 401
    agent = await backend.put_user()
    response = await client.request(method, path, headers=agent.headers)
    assert response.status_code == 403
    assert "service token" in response.json()["detail"]


async def test_queue_view_joins_rows_with_the_broker(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, subscription, ok = await registered_queue(backend)
    _, _, missing = await registered_queue(backend, "resource")
    _, _, drifted = await registered_queue(backend, "user_role")
    other = missing["vhost"]
    await management.delete_queue(other, missing["queue_name"])
    await management.delete_queue(drifted["vhost"], drifted["queue_name"])
    await management.put_queue(drifted["vhost"], drifted["queue_name"], arguments={})
    stray = topology.queue_name(uuid.UUID(subscription["uuid"]), uuid.uuid4(), "order")
    await management.put_queue(agent.vhost, stray, arguments=SPEC_ARGUMENTS)

    entries = await operator.get("/api/admin/queues/")

    by_name: dict[str, dict[str, Any]] = {entry["queue_name"]: entry for entry in entries}
    assert set(by_name) == {ok["queue_name"], missing["queue_name"], drifted["queue_name"], stray}
    assert by_name[ok["queue_name"]]["state"] == "ok"
    assert by_name[ok["queue_name"]]["registered"] is True
    assert by_name[ok["queue_name"]]["present"] is True
    assert by_name[ok["queue_name"]]["arguments_ok"] is True
    assert by_name[ok["queue_name"]]["uuid"] == ok["uuid"]
    assert by_name[ok["queue_name"]]["consumers"] in (0, None)
    assert by_name[missing["queue_name"]]["state"] == "missing"
    assert by_name[missing["queue_name"]]["present"] is False
    assert by_name[drifted["queue_name"]]["state"] == "drifted"
    assert by_name[drifted["queue_name"]]["arguments_ok"] is False
    assert any("x-max-length" in d for d in by_name[drifted["queue_name"]]["differences"])
    assert by_name[stray]["state"] == "unregistered"
    assert by_name[stray]["registered"] is False
    assert by_name[stray]["uuid"] is None

    only_unregistered = await operator.get("/api/admin/queues/", state="unregistered")
    assert [entry["queue_name"] for entry in only_unregistered] == [stray]
    in_vhost = await operator.get("/api/admin/queues/", vhost=agent.vhost)
    assert {entry["queue_name"] for entry in in_vhost} == {ok["queue_name"], stray}
    by_subscription = await operator.get(
        "/api/admin/queues/", event_subscription_uuid=subscription["uuid"]
    )
    assert [entry["queue_name"] for entry in by_subscription] == [ok["queue_name"]]


async def test_queue_view_paginates(
    client: httpx.AsyncClient, backend: Backend, operator: Operator
) -> None:
    for object_type in ("order", "resource", "user_role"):
        await registered_queue(backend, object_type)
    response = await client.get(
        "/api/admin/queues/", params={"page": 2, "page_size": 2}, headers=operator.headers
    )
    assert response.status_code == 200
    assert response.headers["X-Result-Count"] == "3"
    assert len(response.json()) == 1
    assert 'rel="prev"' in response.headers["Link"]


async def test_bad_filters_are_400_naming_the_field(
    client: httpx.AsyncClient, operator: Operator
) -> None:
    response = await client.get(
        "/api/admin/queues/", params={"offering_uuid": "nope"}, headers=operator.headers
    )
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "offering_uuid"
    response = await client.get(
        "/api/admin/queues/", params={"state": "sideways"}, headers=operator.headers
    )
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "state"
    response = await client.get(
        "/api/admin/reconcile-runs/", params={"job": "nap"}, headers=operator.headers
    )
    assert response.status_code == 400
    response = await client.get(
        f"/api/admin/reconcile-runs/{uuid.uuid4().hex}/", headers=operator.headers
    )
    assert response.status_code == 404


async def test_admin_routes_are_documented(app: FastAPI) -> None:
    schema = app.openapi()
    admin = {
        (method.upper(), path): operation
        for path, item in schema["paths"].items()
        if path.startswith("/api/admin/")
        for method, operation in item.items()
    }
    assert {(method, path) for method, path in ADMIN_CALLS} <= set(admin)
    for (method, path), operation in admin.items():
        where = f"{method} {path}"
        assert operation["tags"] == ["admin"], where
        assert operation.get("summary"), where
        assert operation.get("description"), where
        assert {"401", "403"} <= set(operation["responses"]), where
        if "requestBody" in operation:  # the replay's window (contract §11)
            assert operation["requestBody"]["required"], where
    run_schema = schema["components"]["schemas"]["RunOut"]
    assert run_schema.get("examples"), "RunOut has an example"
