"""A queue of the wrong type (the installation moved from classic to quorum queues): the
type cannot change in place, so reconcile re-creates it only when it is empty and unconsumed
and reports it otherwise; the dead-letter queue follows the same rule."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from queuekeeper.broker.management import ManagementClient
from tests.events.support import drain
from tests.helpers import Backend, Operator
from tests.reconcile.test_reconcile import SPEC_ARGUMENTS, publish, registered_queue

pytestmark = pytest.mark.settings(queue_type="quorum")

TYPE_DRIFT = "queue type: expected quorum, broker has classic"
CLASSIC_DLQ = {
    "x-max-length": 100_000,
    "x-message-ttl": 7 * 24 * 3_600_000,
    "x-overflow": "drop-head",
}


async def _as_classic(
    management: ManagementClient, vhost: str, name: str, arguments: dict[str, Any]
) -> None:
    await management.delete_queue(vhost, name)
    await management.put_queue(vhost, name, arguments=arguments)


async def test_an_empty_classic_queue_becomes_quorum(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, _, queue = await registered_queue(backend)
    name = queue["queue_name"]
    await _as_classic(management, agent.vhost, name, SPEC_ARGUMENTS)
    await _as_classic(management, agent.vhost, "waldur.dlq.messages", CLASSIC_DLQ)

    dry = await operator.reconcile(dry_run=True)
    assert dry["found"]["queues_drifted"] == 1
    assert any(TYPE_DRIFT in entry["detail"] for entry in dry["actions"])

    run = await operator.reconcile()

    assert run["status"] == "succeeded", run
    assert run["changed"] == {"drift_repaired": 1, "dead_letter_queues_ensured": 1}
    [repair] = [entry for entry in run["actions"] if entry["item"] == f"{agent.vhost}/{name}"]
    assert TYPE_DRIFT in repair["detail"]
    for queue_name in (name, "waldur.dlq.messages"):
        info = await management.get_queue(agent.vhost, queue_name, columns="name,type")
        assert info is not None
        assert info.type == "quorum", queue_name
    assert (await operator.reconcile())["changed"] == {}


async def test_a_classic_queue_holding_messages_is_reported_and_kept(
    backend: Backend, operator: Operator, management: ManagementClient
) -> None:
    agent, _, queue = await registered_queue(backend)
    name = queue["queue_name"]
    await _as_classic(management, agent.vhost, name, SPEC_ARGUMENTS)
    await publish(agent.vhost, name, b'{"keep": "me"}')

    run = await operator.reconcile()

    assert run["status"] == "partial"
    [failure] = run["failures"]
    assert failure["item"] == f"{agent.vhost}/{name}"
    assert TYPE_DRIFT in failure["reason"]
    assert "not empty" in failure["reason"].lower()
    info = await management.get_queue(agent.vhost, name, columns="name,type,messages_ready")
    assert info is not None
    assert info.type == "classic"


async def test_an_agent_registering_a_busy_queue_of_the_other_type_is_answered_200(
    backend: Backend, management: ManagementClient
) -> None:
    """Mid-migration an agent restarts while its classic queue still holds events: it must
    start (200, never 409) and drain them; the queue converts at a later registration."""
    agent, subscription, queue = await registered_queue(backend)
    name = queue["queue_name"]
    await _as_classic(management, agent.vhost, name, SPEC_ARGUMENTS)
    await publish(agent.vhost, name, b'{"keep": "me"}')

    with capture_logs() as logs:
        response = await agent.create_queue(subscription["uuid"], queue["offering_uuid"])
    assert response.status_code == 200, response.text
    assert [entry["event"] for entry in logs if entry["event"] == "queue_type_drift_kept"]
    info = await management.get_queue(agent.vhost, name, columns="name,type,messages")
    assert info is not None
    assert info.type == "classic"

    # Drained, the next registration converts it.
    await drain(agent.vhost, name)
    response = await agent.create_queue(subscription["uuid"], queue["offering_uuid"])
    assert response.status_code == 200, response.text
    info = await management.get_queue(agent.vhost, name, columns="name,type")
    assert info is not None
    assert info.type == "quorum"


async def test_a_busy_queue_with_other_arguments_besides_its_type_is_still_a_409(
    backend: Backend, management: ManagementClient
) -> None:
    agent, subscription, queue = await registered_queue(backend)
    name = queue["queue_name"]
    await _as_classic(management, agent.vhost, name, {**SPEC_ARGUMENTS, "x-max-length": 5})
    await publish(agent.vhost, name, b'{"keep": "me"}')
    response = await agent.create_queue(subscription["uuid"], queue["offering_uuid"])
    assert response.status_code == 409, response.text
