"""RabbitMQ's own limits on what queuekeeper creates (point 3), and no caller's value reaching
another Management API path (point 5)."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from queuekeeper.app import Runtime
from queuekeeper.broker.management import ManagementClient, UnsafeName
from queuekeeper.config import Settings
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Backend

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


@pytest.mark.settings(
    broker_vhost_max_connections=321,
    broker_vhost_max_queues=432,
    broker_user_max_connections=7,
    broker_user_max_channels=9,
)
async def test_vhost_and_agent_user_carry_the_configured_broker_limits(
    backend: Backend, management: ManagementClient
) -> None:
    agent = await backend.put_user()
    subscription = await agent.create_subscription()
    assert await management.get_vhost_limits(agent.vhost) == {
        "max-connections": 321,
        "max-queues": 432,
    }
    assert await management.get_user_limits(subscription["uuid"].replace("-", "")) == {
        "max-connections": 7,
        "max-channels": 9,
    }


async def test_reconcile_restores_drifted_broker_limits(
    backend: Backend, management: ManagementClient, client: httpx.AsyncClient
) -> None:
    agent = await backend.put_user()
    user = (await agent.create_subscription())["uuid"].replace("-", "")
    await management.put_vhost_limit(agent.vhost, "max-connections", 100_000)
    await management.put_user_limit(user, "max-channels", 5)
    dry = await client.post("/api/admin/reconcile/?dry_run=true", headers=SERVICE)
    assert dry.json()["found"]["limits_drifted"] == 2
    assert await management.get_user_limits(user) == {"max-connections": 64, "max-channels": 5}
    run = await client.post("/api/admin/reconcile/", headers=SERVICE)
    assert run.status_code == 200, run.text
    assert run.json()["changed"]["limits_restored"] == 2
    assert await management.get_vhost_limits(agent.vhost) == {
        "max-connections": 1000,
        "max-queues": 1100,
    }
    assert await management.get_user_limits(user) == {"max-connections": 64, "max-channels": 256}
    again = await client.post("/api/admin/reconcile/", headers=SERVICE)
    assert "limits_drifted" not in again.json()["found"]


async def test_dot_segments_never_reach_the_management_api(settings: Settings) -> None:
    calls: list[str] = []
    client = ManagementClient(settings, observer=lambda kind, status, seconds: calls.append(kind))
    try:
        for name in ("..", ".", ""):
            with pytest.raises(UnsafeName):
                await client.get_vhost(name)
            with pytest.raises(UnsafeName):
                await client.close_user_connections(name)
        assert calls == []
        # Everything else is one encoded segment: `/` and `%` cannot climb out of it.
        assert await client.get_vhost("../api/users") is None
        assert await client.get_vhost("%2E%2E") is None
        assert calls == ["vhost", "vhost"]
    finally:
        await client.aclose()


async def test_a_vhost_parameter_that_is_not_ours_never_reaches_the_broker(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    calls: list[str] = []
    state: Runtime = app.state.queuekeeper
    if state.survey_task is not None:  # the start-up look at the broker, not these requests
        await state.survey_task
    state.management._observer = lambda kind, status, seconds: calls.append(kind)
    for vhost in ("..", ".", "../api/users", "%2E%2E", "ABC", "/"):
        for method, path in (
            ("POST", "/api/admin/dead-letters/redrive/"),
            ("GET", "/api/admin/dead-letters/"),
        ):
            response = await client.request(method, path, params={"vhost": vhost}, headers=SERVICE)
            # Malformed (400, the query validator) or not ours (404): never asked of the broker.
            assert response.status_code in (400, 404), (vhost, path, response.text)
            assert response.json()["errors"][0]["field"] == "vhost"
    assert calls == []
