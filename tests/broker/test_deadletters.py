"""A vhost's dead-letter queue as a redrive uses it (broker/deadletters.py), on the real
broker: what it holds, what a copy sent back met, and copies of one message id."""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pytest

from queuekeeper.broker.deadletters import DeadLetter, DeadLetterQueue, QueueFull, Unroutable
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.config import Settings
from tests.brokers import BROKER


@pytest.fixture
def small(settings: Settings) -> Settings:
    return settings.model_copy(update={"queue_max_length": 1})


@pytest.fixture
def provisioner(small: Settings, clean_state: None, management: ManagementClient) -> Provisioner:
    """Vhosts made with it carry the test's tag, so clean_state removes them afterwards."""
    return Provisioner(management, small, uuid.uuid4())


async def _dead_letters(vhost: str, dlq: str, *message_ids: str) -> None:
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        for message_id in message_ids:
            await channel.default_exchange.publish(
                aio_pika.Message(b"{}", message_id=message_id), routing_key=dlq
            )


async def _taken(dlq: DeadLetterQueue, count: int) -> list[DeadLetter]:
    letters = []
    for _ in range(count):
        letter = await dlq.take()
        assert letter is not None
        letters.append(letter)
    return letters


async def test_a_full_queue_and_a_missing_one_are_told_apart(
    small: Settings, provisioner: Provisioner
) -> None:
    """aio-pika raises a return as a kind of nack: the copy to a deleted queue is
    `Unroutable`, the one a full queue refused `QueueFull`. Given back, both stay in the
    dead-letter queue, beside the second copy the full queue dead-lettered itself
    (`reject-publish-dlx`)."""
    vhost = uuid.uuid4().hex
    await provisioner.ensure_vhost(vhost)
    await provisioner.ensure_queue(vhost, "full")
    await _dead_letters(vhost, small.dlq_name, "refused", "returned")
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel()
        await channel.default_exchange.publish(aio_pika.Message(b"{}"), routing_key="full")

    async with DeadLetterQueue.open(small, vhost) as dlq:
        assert await dlq.depth() == 2
        assert await dlq.depth("full") == 1
        assert await dlq.depth("gone") is None
        assert await dlq.depth("full") == 1  # a missing queue closed the probe's channel
        refused, returned = await _taken(dlq, 2)
        assert [refused.message_id, returned.message_id] == ["refused", "returned"]
        results = await dlq.publish([(refused, "full", {}), (returned, "gone", {})])
        assert [type(result) for result in results] == [QueueFull, Unroutable]
        for letter in (refused, returned):
            await letter.give_back()
    async with DeadLetterQueue.open(small, vhost) as dlq:
        for _ in range(50):  # the broker counts the returned ones a moment later
            if await dlq.depth() == 3:
                break
            await asyncio.sleep(0.1)
        assert await dlq.depth() == 3


async def test_copies_of_one_message_id_go_in_rounds_and_each_gets_its_own_answer(
    small: Settings, provisioner: Provisioner
) -> None:
    """aiormq books a return by message id: with two copies of one id in flight, the return
    of the one to a deleted queue could be booked against the other. In rounds, the first
    is `Unroutable` and the second confirmed, in their order."""
    vhost = uuid.uuid4().hex
    await provisioner.ensure_vhost(vhost)
    await provisioner.ensure_queue(vhost, "here")
    await _dead_letters(vhost, small.dlq_name, "same", "same")
    async with DeadLetterQueue.open(small, vhost) as dlq:
        first, second = await _taken(dlq, 2)
        results = await dlq.publish([(first, "gone", {}), (second, "here", {"n": "2"})])
        assert [type(result) for result in results] == [Unroutable, type(None)]
        await second.ack()
        await first.give_back()
        assert await dlq.depth("here") == 1
