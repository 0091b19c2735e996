"""Who may call what: agent tokens, service tokens, expiry, deactivation."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import httpx
from structlog.testing import capture_logs

from tests.conftest import SERVICE_TOKEN, SERVICE_TOKEN_OLD
from tests.helpers import Backend


async def test_agent_endpoints_need_a_valid_token(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    response = await client.get("/api/event-subscriptions/")
    assert response.status_code == 401
    assert "Authorization: Token" in response.json()["detail"]

    response = await client.get(
        "/api/event-subscriptions/", headers={"Authorization": "Token nope-nope-nope"}
    )
    assert response.status_code == 401
    assert response.json()["detail"] == "Invalid token."

    response = await client.get("/api/event-subscriptions/", headers={"Authorization": "Basic abc"})
    assert response.status_code == 401
    assert "Malformed" in response.json()["detail"]

    agent = await backend.put_user()
    for scheme in ("Token", "Bearer", "token"):
        response = await client.get(
            "/api/event-subscriptions/", headers={"Authorization": f"{scheme} {agent.token}"}
        )
        assert response.status_code == 200, scheme
        assert response.json() == []


async def test_expired_and_inactive_tokens_are_refused(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    expired = await backend.put_user(token_expires_at=past)
    response = await client.get("/api/users/me/", headers=expired.headers)
    assert response.status_code == 401
    assert response.json()["detail"] == "Token has expired."

    future = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    valid = await backend.put_user(token_expires_at=future)
    assert (await client.get("/api/users/me/", headers=valid.headers)).status_code == 200

    inactive = await backend.put_user(is_active=False)
    response = await client.get("/api/users/me/", headers=inactive.headers)
    assert response.status_code == 401
    assert response.json()["detail"] == "User is inactive."


async def test_service_tokens_and_agent_tokens_do_not_mix(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent = await backend.put_user()
    # An agent token never opens the internal API ...
    response = await client.put(
        f"/api/internal/offerings/{agent.uuid}/", json={"name": "x"}, headers=agent.headers
    )
    assert response.status_code == 403
    assert "service token" in response.json()["detail"]
    # ... and a service token never acts as an agent.
    response = await client.get(
        "/api/event-subscriptions/", headers={"Authorization": f"Bearer {SERVICE_TOKEN}"}
    )
    assert response.status_code == 403
    assert "cannot act as an agent" in response.json()["detail"]
    # Unknown tokens on the internal API are 401; every configured token works (rotation).
    response = await client.put(
        f"/api/internal/offerings/{agent.uuid}/",
        json={"name": "x"},
        headers={"Authorization": "Bearer unknown-token-123"},
    )
    assert response.status_code == 401
    response = await client.put(f"/api/internal/offerings/{agent.uuid}/", json={"name": "x"})
    assert response.status_code == 401
    response = await client.put(
        f"/api/internal/offerings/{agent.uuid}/",
        json={"name": "x"},
        headers={"Authorization": f"Bearer {SERVICE_TOKEN_OLD}"},
    )
    assert response.status_code == 201


async def test_user_record_is_only_your_own(client: httpx.AsyncClient, backend: Backend) -> None:
    agent = await backend.put_user(full_name="Agent A")
    other = await backend.put_user()
    me = await client.get("/api/users/me/", headers=agent.headers)
    assert me.status_code == 200
    assert me.json()["uuid"] == agent.uuid.hex
    assert me.json()["full_name"] == "Agent A"
    assert "token" not in me.json()
    by_uuid = await client.get(f"/api/users/{agent.uuid}/", headers=agent.headers)
    assert by_uuid.json() == me.json()
    response = await client.get(f"/api/users/{other.uuid.hex}/", headers=agent.headers)
    assert response.status_code == 404


async def test_token_expiry_with_an_offset_is_honoured_on_every_database(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    # 30 minutes from now, written in UTC+02:00: a store that dropped the offset would
    # read it as 1h30 in the past (expired) or, for a negative offset, hours too late.
    soon = datetime.now(UTC) + timedelta(minutes=30)
    plus_two = soon.astimezone(timezone(timedelta(hours=2))).isoformat()
    agent = await backend.put_user(token_expires_at=plus_two)
    assert (await client.get("/api/users/me/", headers=agent.headers)).status_code == 200
    me = await client.get("/api/users/me/", headers=agent.headers)
    stored = datetime.fromisoformat(me.json()["token_expires_at"].replace("Z", "+00:00"))
    assert abs((stored - soon).total_seconds()) < 1

    past = datetime.now(UTC) - timedelta(minutes=30)
    minus_five = past.astimezone(timezone(timedelta(hours=-5))).isoformat()
    expired = await backend.put_user(token_expires_at=minus_five)
    assert (await client.get("/api/users/me/", headers=expired.headers)).status_code == 401


async def test_internal_and_admin_routes_name_the_service_header(
    client: httpx.AsyncClient,
) -> None:
    """The backend's and operators' routes say which header they want (not the agents')."""
    for method, path in (
        ("PUT", f"/api/internal/offerings/{uuid.uuid4()}/"),
        ("POST", "/api/internal/events/"),
        ("POST", "/api/admin/reconcile/"),
        ("GET", "/api/admin/queues/"),
    ):
        response = await client.request(method, path, json={"name": "x"})
        assert response.status_code == 401, (path, response.text)
        assert "`Authorization: Bearer <service token>`" in response.json()["detail"], path
        assert response.headers["www-authenticate"] == "Bearer", path
    response = await client.get(
        "/api/admin/queues/", headers={"Authorization": "Bearer unknown-token-123"}
    )
    assert response.status_code == 401
    assert "QUEUEKEEPER_SERVICE_TOKENS" in response.json()["detail"]


async def test_without_a_service_token_the_start_up_log_and_the_401_say_so(
    make_client: Any,
) -> None:
    with capture_logs() as logs:
        client = await make_client(service_tokens=[])
    assert "no_service_token_configured" in [entry["event"] for entry in logs]
    response = await client.put(
        f"/api/internal/offerings/{uuid.uuid4()}/",
        json={"name": "x"},
        headers={"Authorization": "Bearer anything-at-all-123"},
    )
    assert response.status_code == 401
    assert "No service token is configured on this server" in response.json()["detail"]
    assert "QUEUEKEEPER_SERVICE_TOKENS" in response.json()["detail"]
