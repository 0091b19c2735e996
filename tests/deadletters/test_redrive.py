"""Dead-letter redrive on the real broker: back to the queue and to the agent, or given up."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
from aio_pika.exceptions import DeliveryError

from queuekeeper.broker.deadletters import DeadLetter
from queuekeeper.config import Settings
from queuekeeper.deadletters.service import Verdict, VhostRedrive
from tests.brokers import BROKER
from tests.helpers import Agent, Backend, Operator
from tests.stomp_client import StompConsumer

DLQ = "waldur.dlq.messages"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    # Queues of two messages fill up at once; that is how messages get dead-lettered here.
    return settings.model_copy(update={"queue_max_length": 2})


async def publish(vhost: str, queue: str, message: aio_pika.Message) -> bool:
    """True when the broker confirmed it, False when it refused it (queue full)."""
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        try:
            await channel.default_exchange.publish(message, routing_key=queue)
        except DeliveryError:
            return False
        return True


async def depth(vhost: str, queue: str) -> int:
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return declared.declaration_result.message_count or 0


async def wait_for_depth(vhost: str, queue: str, expected: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while (current := await depth(vhost, queue)) != expected:
        assert time.monotonic() < deadline, f"{queue} holds {current}, expected {expected}"
        await asyncio.sleep(0.05)


async def dead_lettered(vhost: str, queues: list[str], message_id: str) -> None:
    """Each of `queues` filled (x-max-length 2) and a message `message_id` refused by each,
    dead-lettered; then each emptied, so a redrive finds room."""
    for queue in queues:
        assert await publish(vhost, queue, event("m-1"))
        assert await publish(vhost, queue, event("m-2"))
        assert not await publish(vhost, queue, event(message_id))
    await wait_for_depth(vhost, DLQ, len(queues))
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel()
        for queue in queues:
            await (await channel.get_queue(queue, ensure=False)).purge()


def event(message_id: str, **properties: Any) -> aio_pika.Message:
    body = json.dumps({"order_uuid": message_id}).encode()
    return aio_pika.Message(
        body,
        message_id=message_id,
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        **properties,
    )


async def agent_with_queue(
    backend: Backend, object_types: tuple[str, ...] = ("order",)
) -> tuple[Agent, dict[str, Any], dict[str, str]]:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    queues = {}
    for object_type in object_types:
        response = await agent.create_queue(subscription["uuid"], offering, object_type)
        assert response.status_code == 201, response.text
        queues[object_type] = response.json()["queue_name"]
    return agent, subscription, queues


async def test_dead_letter_goes_back_and_the_agent_receives_it(
    backend: Backend, operator: Operator
) -> None:
    agent, subscription, queues = await agent_with_queue(backend)
    queue = queues["order"]
    assert await publish(agent.vhost, queue, event("m-1"))
    assert await publish(agent.vhost, queue, event("m-2"))
    # Full (x-max-length 2, reject-publish-dlx): refused, and dead-lettered.
    assert not await publish(agent.vhost, queue, event("m-3"))
    await wait_for_depth(agent.vhost, DLQ, 1)

    consumer = StompConsumer(agent.vhost, subscription["uuid"], agent.token)
    await asyncio.to_thread(consumer.connect)
    try:
        consumer.subscribe(f"/amq/queue/{queue}", sub_id=queue)
        assert len(await asyncio.to_thread(consumer.wait_for, 2)) == 2  # the queue drains

        run = await operator.redrive()

        assert run["job"] == "redrive_dead_letters"
        assert run["status"] == "succeeded", run
        assert run["changed"] == {"redriven": 1}
        assert run["found"]["dead_letters"] == 1
        received = await asyncio.to_thread(consumer.wait_for, 3)
        assert [message.headers["amqp-message-id"] for message in received] == [
            "m-1",
            "m-2",
            "m-3",
        ]
        redriven = received[2]
        assert json.loads(redriven.body) == {"order_uuid": "m-3"}
        assert redriven.headers["x-queuekeeper-redrives"] == "1"
        assert redriven.headers["persistent"] == "true"
    finally:
        consumer.close()
    assert await depth(agent.vhost, DLQ) == 0
    dead_letters = await operator.get("/api/admin/dead-letters/")
    assert dead_letters["given_up_total"] == 0


async def test_too_old_too_often_and_orphaned_dead_letters_are_given_up_and_recorded(
    backend: Backend, operator: Operator
) -> None:
    agent, _, queues = await agent_with_queue(backend, ("order", "resource"))
    order, resource = queues["order"], queues["resource"]
    two_days_ago = datetime.now(UTC) - timedelta(days=2)
    # Expire at once, so each is dead-lettered (reason "expired").
    assert await publish(
        agent.vhost, order, event("old-1", expiration=0.001, timestamp=two_days_ago)
    )
    assert await publish(
        agent.vhost,
        order,
        event("tired-1", expiration=0.001, headers={"x-queuekeeper-redrives": 5}),
    )
    assert await publish(agent.vhost, resource, event("orphaned-1", expiration=0.001))
    await wait_for_depth(agent.vhost, DLQ, 3)
    # The queue the third one came from is no longer registered.
    listed = await agent.client.get(
        "/api/event-subscription-queues/", params={"object_type": "resource"}, headers=agent.headers
    )
    [resource_row] = listed.json()
    deleted = await agent.client.delete(
        f"/api/event-subscription-queues/{resource_row['uuid']}/", headers=agent.headers
    )
    assert deleted.status_code == 204

    run = await operator.redrive()

    assert run["status"] == "succeeded", run
    assert run["changed"] == {"given_up": 3}
    assert await depth(agent.vhost, DLQ) == 0
    assert await depth(agent.vhost, order) == 0  # nothing went back
    dead_letters = await operator.get("/api/admin/dead-letters/", vhost=agent.vhost)
    assert dead_letters["given_up_total"] == 3
    records = {record["message_id"]: record for record in dead_letters["given_up"]}
    assert records["old-1"]["reason"].startswith("too_old:")
    assert records["old-1"]["original_queue"] == order
    assert records["tired-1"]["reason"].startswith("too_many_redrives:")
    assert records["orphaned-1"]["reason"].startswith("queue_gone:")
    assert records["orphaned-1"]["original_queue"] == resource
    for record in records.values():
        assert record["vhost"] == agent.vhost
        assert record["death_count"] == 1
        assert record["first_death_at"] is not None
        assert record["body_size"] > 0


async def test_queue_without_room_keeps_its_dead_letters(
    backend: Backend, operator: Operator
) -> None:
    agent, _, queues = await agent_with_queue(backend)
    queue = queues["order"]
    assert await publish(agent.vhost, queue, event("m-1"))
    assert await publish(agent.vhost, queue, event("m-2"))
    assert not await publish(agent.vhost, queue, event("m-3"))
    assert not await publish(agent.vhost, queue, event("m-4"))
    await wait_for_depth(agent.vhost, DLQ, 2)

    run = await operator.redrive()

    assert run["status"] == "succeeded", run
    assert run["changed"] == {}
    assert run["found"]["left_no_room"] == 2
    # Both wait in the dead-letter queue, in their order, for the next redrive.
    assert await depth(agent.vhost, DLQ) == 2
    assert await depth(agent.vhost, queue) == 2
    connection = await aio_pika.connect(BROKER.amqp_url(agent.vhost))
    async with connection:
        channel = await connection.channel()
        dlq = await channel.get_queue(DLQ, ensure=False)
        first = await dlq.get(no_ack=False)
        assert first is not None
        assert first.message_id == "m-3"
        await first.nack(requeue=True)
    # Operators see the fill level per vhost (the broker's statistics lag a few seconds).
    deadline = time.monotonic() + 15
    while True:
        dead_letters = await operator.get("/api/admin/dead-letters/")
        [entry] = [item for item in dead_letters["vhosts"] if item["vhost"] == agent.vhost]
        if entry["messages"] == 2:
            break
        assert time.monotonic() < deadline, entry
        await asyncio.sleep(0.5)
    assert entry["present"] is True
    assert dead_letters["total_messages"] == 2


async def test_redrive_of_a_vhost_not_ours_is_404(backend: Backend, operator: Operator) -> None:
    # Well-formed but not ours: 404 (a malformed one, such as "/", is a 400).
    response = await operator.client.post(
        "/api/admin/dead-letters/redrive/",
        params={"vhost": uuid.uuid4().hex},
        headers=operator.headers,
    )
    assert response.status_code == 404
    assert response.json()["errors"][0]["field"] == "vhost"
    agent, _, _ = await agent_with_queue(backend)
    run = await operator.redrive(agent.vhost)  # one of ours: fine
    assert run["status"] == "succeeded"
    assert run["found"] == {}  # its dead-letter queue is empty


async def test_a_queue_deleted_before_the_copy_goes_back_is_reported_gone_not_full(
    backend: Backend, operator: Operator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy is published mandatory: with its queue deleted after the run looked at it,
    the broker returns it unrouted. The dead letter stays, and the run says the queue
    vanished (a return is a kind of refusal in aio-pika: it was once reported as full)."""
    agent, _, queues = await agent_with_queue(backend)
    queue = queues["order"]
    await dead_lettered(agent.vhost, [queue], "m-3")

    judge = VhostRedrive.judge

    async def judged_then_deleted(self: VhostRedrive, message: DeadLetter) -> Verdict:
        verdict = await judge(self, message)
        assert verdict.kind == "redrive", verdict
        deleting = await aio_pika.connect(BROKER.amqp_url(agent.vhost))
        async with deleting:
            await (await deleting.channel()).queue_delete(queue)  # gone before the publish
        return verdict

    monkeypatch.setattr(VhostRedrive, "judge", judged_then_deleted)
    run = await operator.redrive()

    assert run["changed"] == {}, run
    assert [failure["reason"] for failure in run["failures"]] == [
        "unroutable: the queue vanished; it stays in the dead-letter queue"
    ]
    assert await depth(agent.vhost, DLQ) == 1


async def test_two_dead_letters_of_one_id_are_told_apart_when_one_comes_back_unrouted(
    backend: Backend, operator: Operator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies of one event in two queues die with one message_id. Redriven in one batch, the
    copy for a queue deleted meanwhile is returned unrouted; aiormq books a return by the
    id, so the two are never in flight together: the other goes back and is acknowledged,
    the returned one stays."""
    agent, _, queues = await agent_with_queue(backend, ("order", "resource"))
    await dead_lettered(agent.vhost, list(queues.values()), "same")

    judge = VhostRedrive.judge
    judged: list[str] = []

    async def judged_then_deleted(self: VhostRedrive, message: DeadLetter) -> Verdict:
        verdict = await judge(self, message)
        assert verdict.kind == "redrive", verdict
        judged.append(message.message_id)
        if len(judged) == 2:  # both in the batch: the order queue goes before the publish
            deleting = await aio_pika.connect(BROKER.amqp_url(agent.vhost))
            async with deleting:
                await (await deleting.channel()).queue_delete(queues["order"])
        return verdict

    monkeypatch.setattr(VhostRedrive, "judge", judged_then_deleted)
    run = await operator.redrive()

    assert judged == ["same", "same"]
    assert run["changed"] == {"redriven": 1}, run
    [failure] = run["failures"]
    assert failure["item"] == f"{agent.vhost}/{queues['order']}"
    assert failure["reason"].startswith("unroutable")
    assert await depth(agent.vhost, queues["resource"]) == 1
    assert await depth(agent.vhost, DLQ) == 1
