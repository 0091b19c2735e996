"""Dead letters of a consumer's queue are redriven back to it, as for subscription queues."""

from __future__ import annotations

import pytest

from tests.consumers.test_reconcile import consumer_of
from tests.deadletters.test_redrive import DLQ, depth, event, publish, wait_for_depth
from tests.events.support import drain
from tests.helpers import Backend, Operator


@pytest.mark.settings(queue_max_length=2)
async def test_a_consumers_dead_letter_goes_back_to_its_queue(
    backend: Backend, operator: Operator
) -> None:
    agent, answer = await consumer_of(backend)
    queue = answer["queue_name"]
    assert await publish(agent.vhost, queue, event("c-1"))
    assert await publish(agent.vhost, queue, event("c-2"))
    assert not await publish(agent.vhost, queue, event("c-3"))  # full: dead-lettered
    await wait_for_depth(agent.vhost, DLQ, 1)
    assert [m.message_id for m in await drain(agent.vhost, queue)] == ["c-1", "c-2"]

    run = await operator.redrive()
    assert run["status"] == "succeeded", run
    assert run["changed"] == {"redriven": 1}
    assert [m.message_id for m in await drain(agent.vhost, queue)] == ["c-3"]
    assert await depth(agent.vhost, DLQ) == 0
