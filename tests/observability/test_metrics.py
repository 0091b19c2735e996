"""/metrics moves when the matching thing happens: HTTP traffic, create_queue outcomes,
Management API calls. Read through the endpoint itself, as Prometheus would."""

from __future__ import annotations

import uuid

import aio_pika
import httpx
from asgi_lifespan import LifespanManager
from prometheus_client.parser import text_string_to_metric_families

from queuekeeper.app import create_app
from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from tests.brokers import BROKER
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Backend
from tests.proxy import TcpProxy

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def routes_seen(samples: Samples) -> set[str]:
    return {
        dict(labels)["route"]
        for name, labels in samples
        if name == "queuekeeper_http_requests_total"
    }


async def test_http_requests_are_counted_by_route_template(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, _offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription(description="metrics")
    template = "/api/event-subscriptions/{subscription_uuid}/"
    before = await scrape(client)

    ok = await client.get(
        f"/api/event-subscriptions/{subscription['uuid']}/", headers=agent.headers
    )
    assert ok.status_code == 200
    missing = await client.get(
        f"/api/event-subscriptions/{uuid.uuid4().hex}/", headers=agent.headers
    )
    assert missing.status_code == 404
    for path in ("/no/such/path", f"/wp-admin/{uuid.uuid4().hex}.php"):
        assert (await client.get(path)).status_code == 404
    for probe in ("/healthz", "/readyz", "/metrics"):
        await client.get(probe)

    after = await scrape(client)
    counter = "queuekeeper_http_requests_total"
    for status, expected in (("200", 1), ("404", 1)):
        labels = {"method": "GET", "route": template, "status": status}
        assert value(after, counter, **labels) - value(before, counter, **labels) == expected
    unmatched = {"method": "GET", "route": "unmatched", "status": "404"}
    assert value(after, counter, **unmatched) - value(before, counter, **unmatched) == 2
    latency = "queuekeeper_http_request_duration_seconds_count"
    assert (
        value(after, latency, method="GET", route=template)
        - value(before, latency, method="GET", route=template)
        == 2
    )
    # Raw paths never become labels, and probes and scrapes are not traffic.
    seen = routes_seen(after)
    assert not any(subscription["uuid"] in route for route in seen)
    assert not seen & {"/healthz", "/readyz", "/metrics"}


async def test_requests_the_guard_refuses_are_counted_by_their_route(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    """The guard answers a missing token (401) or an oversized body (413) before the router
    runs; an alert on the backend's refused pushes still needs the route's name."""
    user = "/api/internal/users/{user_uuid}/"
    events = "/api/internal/events/"
    before = await scrape(client)
    refused = [
        await client.put(f"/api/internal/users/{uuid.uuid4().hex}/", json={"username": "x"}),
        await client.post(events, json={}, headers={"Authorization": "Bearer wrong"}),
        await client.post(
            events,
            content=b"x" * (settings.event_payload_max_bytes + 4097),
            headers={"Authorization": f"Bearer {SERVICE_TOKEN}"},
        ),
    ]
    assert [r.status_code for r in refused] == [401, 401, 413]
    after = await scrape(client)
    counter = "queuekeeper_http_requests_total"
    for method, route, status in (
        ("PUT", user, "401"),
        ("POST", events, "401"),
        ("POST", events, "413"),
    ):
        labels = {"method": method, "route": route, "status": status}
        assert value(after, counter, **labels) - value(before, counter, **labels) == 1, labels
    for status in ("401", "413"):
        for method in ("PUT", "POST"):
            unmatched = {"method": method, "route": "unmatched", "status": status}
            assert value(after, counter, **unmatched) == value(before, counter, **unmatched)


async def test_create_queue_outcomes_are_counted(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription(description="outcomes")
    name = "queuekeeper_create_queue_total"

    async def outcome_of(object_type: str, expected_status: int) -> str:
        before = await scrape(client)
        response = await agent.create_queue(subscription["uuid"], offering, object_type)
        assert response.status_code == expected_status, response.text
        after = await scrape(client)
        moved = {
            dict(labels)["outcome"]
            for (metric, labels), count in after.items()
            if metric == name and count != before.get((metric, labels), 0.0)
        }
        assert len(moved) == 1, moved
        return moved.pop()

    assert await outcome_of("order", 201) == "created"
    assert await outcome_of("order", 200) == "existing"

    # The race: a queue auto-created without arguments. Empty and unconsumed: repaired.
    repairable = f"subscription_{subscription['uuid']}_offering_{offering.hex}_resource"
    await management.put_queue(agent.vhost, repairable, arguments={})
    assert await outcome_of("resource", 201) == "repaired"

    # The same race with a message in the queue: not repairable without losing it.
    stuck = f"subscription_{subscription['uuid']}_offering_{offering.hex}_user_role"
    await management.put_queue(agent.vhost, stuck, arguments={})
    connection = await aio_pika.connect(BROKER.amqp_url(agent.vhost))
    async with connection:
        channel = await connection.channel()
        await channel.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=stuck)
    assert await outcome_of("user_role", 409) == "conflict"


async def test_broker_unavailable_and_management_calls_are_counted(
    settings: Settings, clean_state: None
) -> None:
    proxy = TcpProxy("127.0.0.1", 15672)
    proxy.start()
    proxied = settings.model_copy(update={"management_url": f"http://127.0.0.1:{proxy.port}"})
    app = create_app(proxied)
    try:
        async with LifespanManager(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                backend = Backend(client, SERVICE_TOKEN)
                agent, offering = await backend.agent_with_offering()
                subscription = await agent.create_subscription(description="calls")
                calls = "queuekeeper_management_api_calls_total"
                latency = "queuekeeper_management_api_call_seconds_count"
                before = await scrape(client)
                response = await agent.create_queue(subscription["uuid"], offering)
                assert response.status_code == 201
                # A repeat call reads the queue back.
                response = await agent.create_queue(subscription["uuid"], offering)
                assert response.status_code == 200
                after = await scrape(client)
                # The queue was declared (201 from the broker) and read (200).
                for status in ("201", "200"):
                    delta = value(after, calls, kind="queue", status=status) - value(
                        before, calls, kind="queue", status=status
                    )
                    assert delta >= 1, status
                assert value(after, latency, kind="queue") > value(before, latency, kind="queue")

                proxy.stop()
                response = await agent.create_queue(subscription["uuid"], offering, "resource")
                assert response.status_code == 503
                assert response.headers["Retry-After"] == str(settings.retry_after_seconds)
                down = await scrape(client)
                assert value(down, calls, kind="queue", status="error") > value(
                    after, calls, kind="queue", status="error"
                )
                outcome = {"outcome": "broker_unavailable"}
                assert (
                    value(down, "queuekeeper_create_queue_total", **outcome)
                    == value(after, "queuekeeper_create_queue_total", **outcome) + 1
                )
                proxy.start()  # let the clean-up reach the broker
    finally:
        proxy.close()


async def test_every_metric_of_the_operations_guide_is_exported(client: httpx.AsyncClient) -> None:
    text = (await client.get("/metrics")).text
    names = {family.name for family in text_string_to_metric_families(text)}
    expected = {
        "queuekeeper_http_requests",
        "queuekeeper_create_queue",
        "queuekeeper_events_accepted",
        "queuekeeper_deliveries",
        "queuekeeper_deliveries_skipped_unregistered",
        "queuekeeper_outbox_pending",
        "queuekeeper_outbox_oldest_pending_age_seconds",
        "queuekeeper_publish_confirm_seconds",
        "queuekeeper_amqp_pool_connections",
        "queuekeeper_amqp_reconnects",
        "queuekeeper_management_api_calls",
        "queuekeeper_management_api_call_seconds",
        "queuekeeper_job_runs",
        "queuekeeper_job_run_duration_seconds",
        "queuekeeper_reconcile_items",
        "queuekeeper_dead_letters",
        "queuekeeper_job_last_success_timestamp_seconds",
    }
    assert expected <= names, expected - names
