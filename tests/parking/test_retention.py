"""Retention (contract §11): parked copies past QUEUEKEEPER_EVENT_RETENTION_DAYS are given up
with the reason `retention`; the retention job prunes old settled events page by page."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import update

from queuekeeper.app import Runtime
from queuekeeper.jobs.runs import Job, Trigger
from queuekeeper.models import Delivery, Event, utcnow
from queuekeeper.observability.metrics import COPIES_GIVEN_UP_RETENTION
from queuekeeper.parking import retention
from tests.events.support import SERVICE, event_detail, order_event, post_batch, register
from tests.helpers import Backend
from tests.parking.support import set_presence, wait_for_states

pytestmark = pytest.mark.settings(
    park_after_seconds=60, park_check_interval=0.1, event_retention_days=14
)


async def _age(app: FastAPI, event_ids: list[str], days: float, *, finished: bool) -> None:
    then = utcnow() - timedelta(days=days)
    async with app.state.queuekeeper.sessions() as session:
        await session.execute(
            update(Event).where(Event.event_id.in_(event_ids)).values(accepted=then)
        )
        values = {"created": then, **({"finished": then} if finished else {})}
        await session.execute(
            update(Delivery).where(Delivery.event_id.in_(event_ids)).values(**values)
        )
        await session.commit()


async def test_parked_copies_past_retention_are_given_up_and_old_events_pruned_by_pages(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    state: Runtime = app.state.queuekeeper
    registered = await register(backend)
    queue, vhost = registered.queue_name, registered.vhost
    await set_presence(state.sessions, vhost, queue, consumers=0, away_for=3600)
    await asyncio.sleep(0.3)
    await post_batch(
        client,
        [order_event(registered.offering, event_id=i) for i in ("old-1", "old-2", "fresh")],
    )
    await wait_for_states(state.sessions, queue, {"parked": 3})
    other = await backend.put_offering()  # no recipients: settled at once
    await post_batch(client, [order_event(other, event_id=f"gone-{n}") for n in range(3)])
    await _age(app, ["old-1", "old-2"], days=15, finished=False)
    await _age(app, ["gone-0", "gone-1", "gone-2"], days=15, finished=True)

    counted = COPIES_GIVEN_UP_RETENTION._value.get()
    monkeypatch.setattr(retention, "PAGE", 1)  # every page of one: the job goes on to the end
    run = await state.jobs.run(Job.RETENTION, Trigger.API)
    assert run.status == "succeeded", run.failures
    assert run.found == {"parked_given_up_retention": 2, "events_pruned": 3}
    assert COPIES_GIVEN_UP_RETENTION._value.get() - counted == 2

    for event_id in ("old-1", "old-2"):
        (copy,) = (await event_detail(client, event_id))["deliveries"]
        assert copy["state"] == "given_up"
        assert copy["last_error"].startswith("retention")
    assert (await event_detail(client, "fresh"))["deliveries"][0]["state"] == "parked"
    for event_id in ("gone-0", "gone-1", "gone-2"):
        response = await client.get(f"/api/internal/events/{event_id}/", headers=SERVICE)
        assert response.status_code == 404

    # Given up now, the records stay listed for a retention period after that, then go.
    run = await state.jobs.run(Job.RETENTION, Trigger.API)
    assert run.found == {}
    await _age(app, ["old-1", "old-2"], days=15, finished=True)
    run = await state.jobs.run(Job.RETENTION, Trigger.API)
    assert run.found == {"events_pruned": 2}
    await event_detail(client, "fresh")
    # Once pruned, the id is new again: the dedupe window is the retention time.
    response = await post_batch(client, [order_event(other, event_id="gone-0")])
    assert response.json()["events"][0]["duplicate"] is False
