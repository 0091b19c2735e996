"""Revocation reaches the broker at once, seen by a real STOMP consumer.

Before: a consumer logged in with a token the backend had since changed kept receiving
events (observed 20 s later); a deactivated or expired user could still log in.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from structlog.testing import capture_logs

from tests.conftest import SERVICE_TOKEN
from tests.consumers.test_register_queue import new_identity, register_queue
from tests.events.support import Registered, order_event, register
from tests.helpers import Backend
from tests.stomp_client import StompConsumer

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
# How long a revocation may take to reach an open connection.
PROMPTLY = 5.0

Consume = Callable[[Registered, str], Awaitable[StompConsumer]]


@pytest.fixture
async def consume() -> AsyncIterator[Consume]:
    consumers: list[StompConsumer] = []

    async def start(registered: Registered, passcode: str) -> StompConsumer:
        consumer = StompConsumer(
            registered.vhost, registered.subscription.replace("-", ""), passcode
        )
        consumers.append(consumer)
        await asyncio.to_thread(consumer.connect)
        consumer.subscribe(f"/amq/queue/{registered.queue_name}")
        return consumer

    yield start
    for consumer in consumers:
        await asyncio.to_thread(consumer.close)


async def _receiving(
    client: httpx.AsyncClient, registered: Registered, consumer: StompConsumer
) -> None:
    """The consumer gets an event now: the connection is live before we revoke."""
    before = len(consumer.listener.messages)
    response = await client.post(
        "/api/internal/events/", json=order_event(registered.offering), headers=SERVICE
    )
    assert response.status_code == 202, response.text
    messages = await asyncio.to_thread(consumer.wait_for, before + 1)
    assert len(messages) == before + 1


async def _live(
    client: httpx.AsyncClient, backend: Backend, consume: Consume
) -> tuple[Registered, StompConsumer]:
    """A registered agent whose STOMP consumer is receiving events now."""
    registered = await register(backend)
    consumer = await consume(registered, registered.agent.token)
    await _receiving(client, registered, consumer)
    return registered, consumer


async def _cut_off(consumer: StompConsumer) -> float:
    started = time.monotonic()
    assert await asyncio.to_thread(consumer.wait_refused, PROMPTLY), "connection still open"
    return time.monotonic() - started


async def _login_refused(registered: Registered, passcode: str) -> bool:
    consumer = StompConsumer(registered.vhost, registered.subscription.replace("-", ""), passcode)
    try:
        await asyncio.to_thread(consumer.connect)
    except Exception:
        return True
    try:
        return bool(await asyncio.to_thread(consumer.wait_refused, 2.0))
    finally:
        await asyncio.to_thread(consumer.close)


async def test_changed_token_closes_the_open_connection_and_old_login_fails(
    client: httpx.AsyncClient, backend: Backend, consume: Consume
) -> None:
    registered, consumer = await _live(client, backend, consume)
    agent = registered.agent

    new_token = secrets.token_hex(20)
    await backend.put_user(agent.uuid, username=f"user-{agent.uuid.hex[:8]}", token=new_token)
    print(f"token change: connection closed after {await _cut_off(consumer):.2f} s")
    assert await _login_refused(registered, agent.token)
    # The new token works at once.
    renewed = await consume(registered, new_token)
    await _receiving(client, registered, renewed)


@pytest.mark.parametrize(
    "change",
    [
        {"token": None},
        {"is_active": False},
        {"token_expires_at": "2000-01-01T00:00:00Z"},
    ],
    ids=["token-removed", "deactivated", "expired-by-push"],
)
async def test_removed_token_deactivation_or_past_expiry_leave_no_working_login(
    client: httpx.AsyncClient, backend: Backend, consume: Consume, change: dict[str, object]
) -> None:
    registered, consumer = await _live(client, backend, consume)
    agent = registered.agent
    response = await client.put(
        f"/api/internal/users/{agent.uuid}/",
        json={"username": f"user-{agent.uuid.hex[:8]}", **change},
        headers=SERVICE,
    )
    assert response.status_code == 200, response.text
    await _cut_off(consumer)
    assert await _login_refused(registered, agent.token)
    # Reconcile does not give the login back.
    reconcile = await client.post("/api/admin/reconcile/", headers=SERVICE)
    assert reconcile.status_code == 200, reconcile.text
    assert await _login_refused(registered, agent.token)
    if "is_active" in change:
        # Reactivated: the same token logs in again.
        response = await client.put(
            f"/api/internal/users/{agent.uuid}/",
            json={"username": f"user-{agent.uuid.hex[:8]}", "is_active": True},
            headers=SERVICE,
        )
        assert response.status_code == 200, response.text
        await _receiving(client, registered, await consume(registered, agent.token))


async def test_revoked_access_and_deleted_user_close_the_connection(
    client: httpx.AsyncClient, backend: Backend, consume: Consume
) -> None:
    registered, consumer = await _live(client, backend, consume)
    agent = registered.agent
    response = await client.delete(
        f"/api/internal/offerings/{registered.offering}/users/{agent.uuid}/", headers=SERVICE
    )
    assert response.status_code == 204, response.text
    await _cut_off(consumer)

    other, consumer = await _live(client, backend, consume)
    response = await client.delete(f"/api/internal/users/{other.agent.uuid}/", headers=SERVICE)
    assert response.status_code == 204, response.text
    await _cut_off(consumer)
    assert await _login_refused(other, other.agent.token)


@pytest.mark.settings(scheduler_enabled=True, token_expiry_interval_seconds=1)
async def test_token_expiring_later_is_revoked_within_seconds(
    client: httpx.AsyncClient, backend: Backend, consume: Consume
) -> None:
    registered = await register(backend)
    agent = registered.agent
    expires = datetime.now(UTC) + timedelta(seconds=3)
    await backend.expire_token_at(agent, expires)
    consumer = await consume(registered, agent.token)
    await _receiving(client, registered, consumer)
    started = time.monotonic()
    assert await asyncio.to_thread(consumer.wait_refused, 3 + PROMPTLY + 2)
    print(f"expiry: connection closed {time.monotonic() - started:.2f} s after it was live")
    assert datetime.now(UTC) >= expires
    assert await _login_refused(registered, agent.token)


async def test_a_short_pushed_token_is_accepted_and_logged_without_the_token(
    backend: Backend,
) -> None:
    with capture_logs() as logs:
        await backend.put_user(token="short-token-123")
        await backend.put_user(token=secrets.token_hex(16))  # 32 characters: fine
    warnings = [entry for entry in logs if entry["event"] == "short_token"]
    assert len(warnings) == 1
    assert warnings[0]["length"] == 15
    assert warnings[0]["log_level"] == "warning"
    assert "short-token-123" not in str(logs)


async def test_a_consumers_connection_is_closed_by_a_token_change(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    registered = (await register_queue(agent, await new_identity(agent, offering))).json()
    consumer = StompConsumer(registered["vhost"], registered["rmq_username"], agent.token)
    try:
        await asyncio.to_thread(consumer.connect)
        consumer.subscribe(f"/amq/queue/{registered['queue_name']}")
        assert not await asyncio.to_thread(consumer.wait_refused, 0.5)
        await backend.put_user(agent.uuid, username=f"user-{agent.uuid.hex[:8]}", token=None)
        await _cut_off(consumer)
    finally:
        await asyncio.to_thread(consumer.close)
