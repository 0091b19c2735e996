"""Contract §14, "judged as it leaves", for the redrive of dead letters: a run judges each
queue's owner once when it meets the queue; a dead letter goes back only if that judgment
still holds when its batch is published (docs/decisions/029-judged-as-it-leaves.md)."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import delete

from queuekeeper.broker.deadletters import DeadLetter
from queuekeeper.deadletters.service import Verdict, VhostRedrive
from queuekeeper.models import Role
from tests.consumers.scopes import role, scopes, tree
from tests.consumers.test_event_consumers_api import register
from tests.deadletters.test_redrive import DLQ, publish, wait_for_depth
from tests.deadletters.test_redrive import event as dead_event
from tests.events.support import drain
from tests.helpers import Backend, Operator


@pytest.mark.settings(queue_max_length=1)
async def test_a_role_deleted_after_the_judgment_stops_the_redrive(
    app: FastAPI,
    backend: Backend,
    client: httpx.AsyncClient,
    operator: Operator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A customer-bound consumer's dead letter is judged redrivable; before its batch is
    published the role that bound the customer is deleted. Before: it went back to the
    queue on the judgment made moments earlier. Now the batch's check sees the access
    change, judges the queue again and gives the dead letter up as not authorized."""
    entities = await tree(client)
    watcher = await backend.put_user()
    granted = await role(client, watcher, "customer", entities.customer)
    made = await register(watcher, {"scopes": scopes(("customer", entities.customer))})
    assert made.status_code in (200, 201), made.text
    queue = made.json()["queue_name"]
    assert await publish(watcher.vhost, queue, dead_event("keeper"))
    message = dead_event("lost")
    message.headers = {"offering_uuid": entities.offering.hex}
    assert not await publish(watcher.vhost, queue, message)  # full: dead-lettered
    await wait_for_depth(watcher.vhost, DLQ, 1)
    await drain(watcher.vhost, queue)

    judge = VhostRedrive.judge
    revoked: list[Verdict] = []

    async def judged_then_revoked(self: VhostRedrive, incoming: DeadLetter) -> Verdict:
        verdict = await judge(self, incoming)
        if verdict.kind == "redrive" and not revoked:
            revoked.append(verdict)
            async with app.state.queuekeeper.sessions() as session:
                await session.execute(delete(Role).where(Role.uuid == granted))
                await session.commit()
        return verdict

    monkeypatch.setattr(VhostRedrive, "judge", judged_then_revoked)
    run = await operator.redrive()
    assert revoked, "the dead letter was never judged redrivable"
    assert run["changed"] == {"given_up": 1}, run
    assert await drain(watcher.vhost, queue) == []
