"""The whole agent flow on a real broker: register, then consume over STOMP/WebSocket."""

from __future__ import annotations

import asyncio
import json
import uuid

import aio_pika
import httpx

from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from tests.brokers import BROKER
from tests.helpers import Backend
from tests.stomp_client import StompConsumer


async def _publish(vhost: str, queue: str, body: dict[str, object]) -> None:
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.default_exchange.publish(
            aio_pika.Message(json.dumps(body).encode(), message_id="m-1"), routing_key=queue
        )


async def test_agent_registers_and_receives_over_web_stomp(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription(
        description="agent A", observable_objects=[{"object_type": "order"}]
    )
    assert subscription["user_uuid"] == agent.uuid.hex
    assert subscription["source_ip"] == "10.1.2.3"
    assert subscription["user"] == f"http://testserver/api/users/{agent.uuid.hex}/"

    response = await agent.create_queue(subscription["uuid"], str(offering))  # dashed form
    assert response.status_code == 201, response.text
    queue = response.json()
    expected_name = f"subscription_{subscription['uuid']}_offering_{offering.hex}_order"
    assert queue["queue_name"] == expected_name
    assert queue["vhost"] == agent.uuid.hex
    assert queue["event_subscription_uuid"] == subscription["uuid"]

    # The broker holds exactly the contract §3 arguments, durable, in a vhost tagged as ours.
    info = await management.get_queue(agent.vhost, expected_name)
    assert info is not None
    assert info.arguments == {
        "x-message-ttl": 3_600_000,
        "x-max-length": 10_000,
        "x-overflow": "reject-publish-dlx",
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": "waldur.dlq.messages",
    }
    assert info.durable is True
    vhost = await management.get_vhost(agent.vhost)
    assert vhost is not None
    assert settings.instance_tag in vhost.tags
    dlq = await management.get_queue(agent.vhost, "waldur.dlq.messages")
    assert dlq is not None
    assert dlq.arguments == {
        "x-max-length": 100_000,
        "x-message-ttl": 7 * 24 * 3_600_000,
        "x-overflow": "drop-head",
    }
    permissions = await management.get_permissions(agent.vhost, subscription["uuid"])
    assert permissions is not None
    assert (permissions.configure, permissions.write) == ("^$", "^$")
    assert permissions.read == f"^subscription_{subscription['uuid']}_.*$"

    consumer = StompConsumer(agent.vhost, subscription["uuid"], agent.token)
    await asyncio.to_thread(consumer.connect)
    try:
        consumer.subscribe(f"/amq/queue/{expected_name}", sub_id=expected_name)
        await _publish(agent.vhost, expected_name, {"order_uuid": uuid.uuid4().hex})
        received = await asyncio.to_thread(consumer.wait_for, 1)
        assert len(received) == 1
        assert "order_uuid" in json.loads(received[0].body)
        assert received[0].headers["amqp-message-id"] == "m-1"
    finally:
        consumer.close()


async def test_stomp_refused_for_other_subscriptions_queue_and_unregistered_names(
    backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    mine = await agent.create_subscription()
    theirs = await agent.create_subscription()
    response = await agent.create_queue(theirs["uuid"], offering)
    assert response.status_code == 201
    their_queue = response.json()["queue_name"]

    # Reading another subscription's queue (same owner, same vhost) is refused.
    consumer = StompConsumer(agent.vhost, mine["uuid"], agent.token)
    await asyncio.to_thread(consumer.connect)
    try:
        consumer.subscribe(f"/amq/queue/{their_queue}")
        assert await asyncio.to_thread(consumer.wait_refused)
    finally:
        consumer.close()

    # /queue/<name> would declare the queue; with no configure permission nothing appears.
    unregistered = topology.queue_name(uuid.UUID(mine["uuid"]), offering, "resource")
    consumer = StompConsumer(agent.vhost, mine["uuid"], agent.token)
    await asyncio.to_thread(consumer.connect)
    try:
        consumer.subscribe(f"/queue/{unregistered}")
        assert await asyncio.to_thread(consumer.wait_refused)
    finally:
        consumer.close()
    assert await management.get_queue(agent.vhost, unregistered) is None

    # Control: the same login on its own registered queue stays connected.
    response = await agent.create_queue(mine["uuid"], offering)
    consumer = StompConsumer(agent.vhost, mine["uuid"], agent.token)
    await asyncio.to_thread(consumer.connect)
    try:
        consumer.subscribe(f"/amq/queue/{response.json()['queue_name']}")
        assert not await asyncio.to_thread(consumer.wait_refused, 2.0)
    finally:
        consumer.close()


async def test_wrong_passcode_cannot_log_in(backend: Backend) -> None:
    agent, _offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    consumer = StompConsumer(agent.vhost, subscription["uuid"], "not-the-token")
    try:
        await asyncio.to_thread(consumer.connect)
        refused = await asyncio.to_thread(consumer.wait_refused)
    except Exception:
        refused = True
    finally:
        consumer.close()
    assert refused
    good = StompConsumer(agent.vhost, subscription["uuid"], agent.token)
    await asyncio.to_thread(good.connect)
    try:
        assert good.connection.is_connected()
    finally:
        good.close()
