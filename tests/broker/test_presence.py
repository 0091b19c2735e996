"""broker/presence.py against the real broker: the event exchange's consumer events as the
listener parses them (classic and quorum queues, a connection that dies without cancelling),
and the exact consumer count of a passive declare."""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage

from queuekeeper.broker.amqp import vhost_url
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.presence import ConsumerEvent, PresenceListener, consumer_counts
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.config import Settings


@pytest.fixture
def provisioner(settings: Settings, clean_state: None, management: ManagementClient) -> Provisioner:
    return Provisioner(management, settings, uuid.uuid4())


async def wait_for(events: list[ConsumerEvent], count: int, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while len(events) < count:
            await asyncio.sleep(0.02)


async def ignore(message: AbstractIncomingMessage) -> None:
    """A consumer that reads nothing of interest: only its presence matters."""


@pytest.mark.parametrize("quorum", [False, True], ids=["classic", "quorum"])
async def test_consumer_events_and_counts(
    settings: Settings, provisioner: Provisioner, quorum: bool
) -> None:
    vhost = uuid.uuid4().hex
    await provisioner.ensure_vhost(vhost)
    queue = f"consumer_{uuid.uuid4().hex}"
    if quorum:
        settings = settings.model_copy(update={"queue_type": "quorum"})
        provisioner = Provisioner(provisioner.management, settings, await provisioner.identify())
    await provisioner.ensure_queue(vhost, queue)

    seen: list[ConsumerEvent] = []

    async def handler(event: ConsumerEvent) -> None:
        if event.vhost == vhost:  # the broker is shared: other tests' consumers come and go
            seen.append(event)

    listener = PresenceListener(settings, handler)
    listener.start()
    try:
        async with asyncio.timeout(10):
            await listener.connected.wait()
        assert await consumer_counts(settings, vhost, [queue, "consumer_missing"]) == {
            queue: 0,
            "consumer_missing": None,
        }
        agent = await aio_pika.connect(vhost_url(settings.amqp_urls[0], vhost))
        channel = await agent.channel()
        declared = await channel.get_queue(queue, ensure=False)
        await declared.consume(ignore)
        await declared.consume(ignore)
        await wait_for(seen, 2)
        assert [(e.queue, e.arrived) for e in seen] == [(queue, True), (queue, True)]
        assert await consumer_counts(settings, vhost, [queue]) == {queue: 2}
        # The agent's connection dies without cancelling its consumers.
        await agent.close()
        await wait_for(seen, 4)
        assert [(e.queue, e.arrived) for e in seen[2:]] == [(queue, False), (queue, False)]
        assert seen[3].at >= seen[0].at
        assert await consumer_counts(settings, vhost, [queue]) == {queue: 0}
    finally:
        await listener.stop()


def test_events_that_are_not_a_consumers_are_ignored() -> None:
    headers: dict[str, object] = {"vhost": "v", "queue": "q", "timestamp_in_ms": 1795695748555}
    assert ConsumerEvent.parse("queue.created", headers) is None
    assert ConsumerEvent.parse("consumer.created", {"vhost": "v"}) is None
    event = ConsumerEvent.parse("consumer.deleted", headers)
    assert event is not None
    assert (event.vhost, event.queue, event.arrived) == ("v", "q", False)
    assert event.at.timestamp() == pytest.approx(1795695748.555)
