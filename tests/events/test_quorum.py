"""Quorum queues on the real broker (a single node runs them too): their own argument set,
read back; the dead-letter queue of the same type; a full queue's nack retried, not lost."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY

from queuekeeper.app import Runtime
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.publisher import AmqpPublisher
from queuekeeper.events.relay import Relay
from tests.events.support import drain, event_detail, order_event, post_event, register
from tests.helpers import Backend

pytestmark = pytest.mark.settings(queue_type="quorum", relay_enabled=False)

QUORUM_ARGUMENTS = {
    "x-queue-type": "quorum",
    "x-message-ttl": 3_600_000,
    "x-max-length": 10_000,
    "x-overflow": "reject-publish",
    "x-dead-letter-strategy": "at-least-once",
    "x-dead-letter-exchange": "",
    "x-dead-letter-routing-key": "waldur.dlq.messages",
}


async def test_quorum_queues_and_their_dead_letter_queue_are_declared_and_read_back(
    backend: Backend, management: ManagementClient
) -> None:
    registered = await register(backend)
    info = await management.get_queue(
        registered.vhost, registered.queue_name, columns="name,type,durable,arguments"
    )
    assert info is not None
    assert info.type == "quorum"
    assert info.durable is True
    assert info.arguments == QUORUM_ARGUMENTS
    dlq = await management.get_queue(
        registered.vhost, "waldur.dlq.messages", columns="name,type,arguments"
    )
    assert dlq is not None
    assert dlq.type == "quorum"
    assert dlq.arguments == {
        "x-queue-type": "quorum",
        "x-max-length": 100_000,
        "x-message-ttl": 7 * 24 * 3_600_000,
        "x-overflow": "drop-head",
    }


def _full_count() -> float:
    return REGISTRY.get_sample_value("queuekeeper_deliveries_total", {"outcome": "nacked"}) or 0


@pytest.mark.settings(queue_type="quorum", relay_enabled=False, queue_max_length=1)
async def test_a_full_quorum_queue_nack_is_retried_with_backoff_then_published(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    state: Runtime = app.state.queuekeeper
    settings = state.settings.model_copy(update={"relay_backoff_base": 1.0})
    publisher = AmqpPublisher(settings)
    relay = Relay(settings, state.engine, publisher, state.provisioner)
    # A quorum queue tells publishing channels that it is full asynchronously, so a burst
    # overshoots its limit; once it has said so, the next publishes are nacked.
    ids: list[str] = []
    before = _full_count()
    try:
        for _ in range(2):
            for _ in range(3):
                response = await post_event(client, order_event(registered.offering))
                assert response.status_code == 202, response.text
                ids.append(response.json()["event_id"])
            assert await relay.run_once() == 3
            await asyncio.sleep(0.2)
        copies = [(await event_detail(client, i))["deliveries"][0] for i in ids]
        full = [copy for copy in copies if copy["state"] == "pending"]
        assert full, copies
        assert {copy["state"] for copy in copies} == {"published", "pending"}
        assert {copy["last_error"] for copy in full} == {
            "nacked by the broker: the queue is full (x-overflow reject-publish on a quorum "
            "queue: nothing was dead-lettered) or its process failed; retrying with backoff"
        }
        assert {copy["attempts"] for copy in full} == {1}
        assert _full_count() == before + len(full)

        # The agent consumes; the next attempts, after the backoff, get in.
        taken = [m.message_id for m in await drain(registered.vhost, registered.queue_name)]
        for _ in range(100):
            pending = [
                i
                for i in ids
                if (await event_detail(client, i))["deliveries"][0]["state"] == "pending"
            ]
            if not pending:
                break
            await relay.run_once()
            taken += [m.message_id for m in await drain(registered.vhost, registered.queue_name)]
            await asyncio.sleep(0.05)
        assert pending == []
        taken += [m.message_id for m in await drain(registered.vhost, registered.queue_name)]
        assert sorted(taken) == sorted(ids)  # every event once, none lost
        # Nothing went to the dead-letter queue: the nack was a retry, not a dead letter.
        assert await drain(registered.vhost, "waldur.dlq.messages") == []
    finally:
        await publisher.close()
