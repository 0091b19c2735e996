"""`source_ip` believes only listed proxies (point 4); registration calls are rate limited
per token (point 3)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from tests.conftest import SERVICE_TOKEN
from tests.helpers import Backend, clear_of_a_window_edge

MakeClient = Callable[..., Awaitable[httpx.AsyncClient]]


async def _source_ip(client: httpx.AsyncClient, **headers: str) -> Any:
    agent = await Backend(client, SERVICE_TOKEN).put_user()
    response = await client.post(
        "/api/event-subscriptions/", json={}, headers={**agent.headers, **headers}
    )
    assert response.status_code == 201, response.text
    return response.json()["source_ip"]


async def test_forwarded_for_is_ignored_unless_the_peer_is_a_listed_proxy(
    make_client: MakeClient,
) -> None:
    # The test transport's peer is 10.1.2.3.
    unlisted = await make_client()
    assert await _source_ip(unlisted, **{"X-Forwarded-For": "203.0.113.9"}) == "10.1.2.3"
    other_proxy = await make_client(forwarded_allow_ips=["192.0.2.1", "127.0.0.1"])
    assert await _source_ip(other_proxy, **{"X-Forwarded-For": "203.0.113.9"}) == "10.1.2.3"
    listed = await make_client(forwarded_allow_ips=["10.0.0.0/8"])
    assert await _source_ip(listed, **{"X-Forwarded-For": "203.0.113.9"}) == "203.0.113.9"
    # A client's own X-Forwarded-For entry in front of the proxy's is not believed either.
    chained = "198.51.100.7, 203.0.113.9"
    assert await _source_ip(listed, **{"X-Forwarded-For": chained}) == "203.0.113.9"
    assert await _source_ip(listed) == "10.1.2.3"


@pytest.mark.settings(registration_rate_limit="3/minute")
async def test_registration_calls_over_the_rate_are_429_with_retry_after(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    await clear_of_a_window_edge()
    agent, offering = await backend.agent_with_offering()
    other = await backend.put_user()
    subscription = await agent.create_subscription()
    assert (await agent.create_queue(subscription["uuid"], offering)).status_code == 201
    assert (await agent.create_queue(subscription["uuid"], offering)).status_code == 200
    refused = await agent.create_queue(subscription["uuid"], offering)
    assert refused.status_code == 429, refused.text
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    answer = refused.json()
    assert answer["setting"] == "registration_rate_limit"
    assert "QUEUEKEEPER_REGISTRATION_RATE_LIMIT" in answer["detail"]
    # Per token: another agent is not held back, and reading is not limited.
    await other.create_subscription()
    listing = await client.get("/api/event-subscriptions/", headers=agent.headers)
    assert listing.status_code == 200
    # Refused calls did nothing: one queue.
    queues = await client.get("/api/event-subscription-queues/", headers=agent.headers)
    assert len(queues.json()) == 1


async def test_refusals_of_the_guard_are_in_the_openapi_document(
    client: httpx.AsyncClient,
) -> None:
    paths = (await client.get("/openapi.json")).json()["paths"]
    create_queue = paths["/api/event-subscriptions/{subscription_uuid}/create_queue/"]["post"]
    assert {"409", "413", "429"} <= set(create_queue["responses"])
    assert "Retry-After" in create_queue["responses"]["429"]["headers"]
    assert "413" in paths["/api/internal/events/batch/"]["post"]["responses"]
    assert "429" not in paths["/api/internal/events/batch/"]["post"]["responses"]
