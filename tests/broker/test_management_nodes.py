"""The Management API client with several node URLs: a node that refuses, hangs or answers
5xx is skipped for the next, and used again once its rest is over and it answers."""

from __future__ import annotations

import time
from typing import Any

import pytest
import respx
from structlog.testing import capture_logs

from queuekeeper.broker.management import BrokerUnavailable, ManagementClient
from queuekeeper.config import Settings
from tests.brokers import BROKER
from tests.helpers import Backend
from tests.proxy import TcpProxy, closed_port, free_port


def _client(settings: Settings, *urls: str, **changes: object) -> ManagementClient:
    return ManagementClient(
        settings.model_copy(update={"management_url": ",".join(urls), **changes})
    )


async def test_a_closed_node_is_skipped_and_used_again_when_it_comes_back(
    settings: Settings,
) -> None:
    first = TcpProxy(BROKER.host, BROKER.management_port, port=free_port())
    second = TcpProxy(BROKER.host, BROKER.management_port)
    second.start()
    client = _client(
        settings,
        f"http://127.0.0.1:{first.port}",
        f"http://127.0.0.1:{second.port}",
        broker_node_retry_seconds=0.3,
    )
    try:
        with capture_logs() as logs:
            assert await client.list_vhosts()
            assert await client.list_vhosts()  # the first node rests: not tried again
            assert (first.accepted, second.accepted) == (0, 1)
            first.start()
            time.sleep(0.4)
            assert await client.list_vhosts()
            assert first.accepted == 1
        events = [entry["event"] for entry in logs if entry["event"].startswith("broker_node")]
        assert events == ["broker_node_down", "broker_node_back"]
    finally:
        await client.aclose()
        first.close()
        second.close()


async def test_a_node_answering_5xx_is_skipped(settings: Settings) -> None:
    sick = f"http://127.0.0.1:{closed_port()}"
    client = _client(settings, sick, BROKER.management_url)
    try:
        with respx.mock(assert_all_called=False) as mock:
            booting = mock.route(url__startswith=sick).respond(
                503, json={"error": "not_ready", "reason": "node is booting"}
            )
            mock.route().pass_through()
            assert await client.list_vhosts()
            assert await client.list_vhosts()
        assert booting.call_count == 1
    finally:
        await client.aclose()


async def test_a_node_that_hangs_costs_one_timeout_then_is_skipped(settings: Settings) -> None:
    hang = TcpProxy(BROKER.host, BROKER.management_port, blackhole=True)
    hang.start()
    client = _client(
        settings, f"http://127.0.0.1:{hang.port}", BROKER.management_url, management_timeout=0.5
    )
    try:
        started = time.perf_counter()
        assert await client.list_vhosts()
        assert time.perf_counter() - started < 3
        started = time.perf_counter()
        for _ in range(3):
            assert await client.list_vhosts()
        assert time.perf_counter() - started < 1.0
    finally:
        await client.aclose()
        hang.close()


async def test_every_node_down_is_unavailable(settings: Settings) -> None:
    client = _client(
        settings, f"http://127.0.0.1:{closed_port()}", f"http://127.0.0.1:{closed_port()}"
    )
    try:
        with pytest.raises(BrokerUnavailable, match="unreachable"):
            await client.list_vhosts()
    finally:
        await client.aclose()


async def test_registration_with_every_node_down_is_a_503_and_events_wait(
    settings: Settings, make_client: Any
) -> None:
    """All Management and AMQP nodes down: registration answers 503 with Retry-After and
    stores nothing; events are still accepted and wait in the outbox."""
    dead_mgmt = f"http://127.0.0.1:{closed_port()},http://127.0.0.1:{closed_port()}"
    dead_amqp = ",".join(f"amqp://guest:guest@127.0.0.1:{closed_port()}/" for _ in range(2))
    http = await make_client(management_url=dead_mgmt, amqp_url=dead_amqp)
    backend = Backend(http, settings.service_tokens[0])
    agent, offering = await backend.agent_with_offering()
    response = await http.post(
        "/api/event-subscriptions/", json={"observable_objects": []}, headers=agent.headers
    )
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == str(settings.retry_after_seconds)
    assert (await http.get("/api/event-subscriptions/", headers=agent.headers)).json() == []
    accepted = await http.post(
        "/api/internal/events/",
        json={
            "offering_uuid": offering.hex,
            "object_type": "order",
            "payload": {"order_uuid": offering.hex},
        },
        headers=backend.headers,
    )
    assert accepted.status_code == 202, accepted.text
