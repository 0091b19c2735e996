"""Replay (contract §11) to a webhook consumer: the window's events posted again, in order,
with their original webhook-id."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest

from queuekeeper.config import Settings
from queuekeeper.models import utcnow
from tests.events.support import order_event, post_event
from tests.helpers import Backend
from tests.webhooks.support import WEBHOOK_SETTINGS, copies, eventually, receiving, webhook_consumer

pytestmark = pytest.mark.settings(**WEBHOOK_SETTINGS)


async def test_a_replay_posts_the_window_again_in_order_with_the_same_ids(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    async with receiving() as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        since = utcnow() - timedelta(seconds=5)
        for n in range(3):
            await post_event(client, order_event(offering, event_id=f"replayed-{n}"))
        await receiver.wait_for(3)
        response = await client.post(
            f"/api/event-consumers/{hook.uuid}/replay/",
            json={"since": since.isoformat()},
            headers=agent.headers,
        )
        assert response.status_code == 202, response.text
        assert response.json() == {"replayed": 3}
        await receiver.wait_for(6)
        ids = [f"replayed-{n}" for n in range(3)]
        assert receiver.ids() == ids + ids

        async def delivered() -> bool:
            rows = await copies(settings, hook.uuid)
            return len(rows) == 6 and all(r["state"] == "published" for r in rows)

        await eventually(delivered, what="the replay's copies delivered")
        rows = await copies(settings, hook.uuid)
        assert [r["replay"] for r in rows] == [False] * 3 + [True] * 3
        assert all(r["webhook"] for r in rows)
