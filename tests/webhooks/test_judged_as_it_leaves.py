"""Contract §14, "judged as it leaves", for webhook consumers: a copy accepted before a
revocation and not yet posted when the revocation is answered is given up, never posted
(docs/decisions/029-judged-as-it-leaves.md). A real receiver on 127.0.0.1 that answers
slowly, the dispatcher beside the relay, the directory changed through the internal API."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web

from queuekeeper.config import Settings
from queuekeeper.events.outbox_postgres import REFUSED_REASON
from tests.consumers.scopes import role, scopes, staff, tree, unrole
from tests.events.support import order_event, post_event
from tests.helpers import Agent, Backend
from tests.webhooks.support import WEBHOOK_SETTINGS, copies, eventually, receiving
from tests.webhooks.test_registration import register_webhook

# The receiver takes 1.5 s to answer: well within the attempt's timeout.
SLOW = 1.5
pytestmark = pytest.mark.settings(**{**WEBHOOK_SETTINGS, "webhook_timeout_seconds": 5.0})

Revoke = Callable[[httpx.AsyncClient, Backend, Agent, uuid.UUID], Awaitable[None]]


async def _put_user(client: httpx.AsyncClient, backend: Backend, who: Agent, **body: Any) -> None:
    answer = await client.put(
        f"/api/internal/users/{who.uuid}/",
        json={"username": f"user-{who.uuid.hex[:8]}", **body},
        headers=backend.headers,
    )
    assert answer.status_code == 200, answer.text


async def demoted(
    client: httpx.AsyncClient, backend: Backend, who: Agent, granted: uuid.UUID
) -> None:
    """No longer staff, and the role on the project deleted: no way left to the project."""
    await _put_user(client, backend, who, is_staff=False)
    await unrole(client, granted)


async def deactivated(
    client: httpx.AsyncClient, backend: Backend, who: Agent, _granted: uuid.UUID
) -> None:
    await _put_user(client, backend, who, is_active=False)


async def without_token(
    client: httpx.AsyncClient, backend: Backend, who: Agent, _granted: uuid.UUID
) -> None:
    await _put_user(client, backend, who, token=None)


@pytest.mark.parametrize("revoke", [demoted, deactivated, without_token])
async def test_copies_behind_a_slow_post_are_not_posted_after_a_revocation(
    client: httpx.AsyncClient, backend: Backend, settings: Settings, revoke: Revoke
) -> None:
    """Finding 1: a staff user with a role on project P, a webhook consumer bound to P whose
    receiver answers after 1.5 s, three events of P back to back; while the first copy is
    being posted the user loses access, answered within a fraction of a second, and a new
    event is refused (`queued: 0`). Before: copies 2 and 3 still arrived (at +1.5 s and
    +3.1 s), trusted as fresh from the store. Now they are given up, not authorized."""

    async def slow(_request: web.Request, _number: int) -> web.StreamResponse:
        await asyncio.sleep(SLOW)
        return web.Response(status=200, text="ok")

    watcher = await staff(backend)
    entities = await tree(client)
    granted = await role(client, watcher, "project", entities.project)
    async with receiving(slow) as receiver:
        made = await register_webhook(
            watcher,
            {"webhook_url": receiver.url, "scopes": scopes(("project", entities.project))},
        )
        assert made.status_code == 201, made.text
        hook = uuid.UUID(made.json()["uuid"])
        ids = []
        for _ in range(3):
            answer = await post_event(client, order_event(entities.offering))
            assert answer.status_code in (200, 202), answer.text
            assert answer.json()["queued"] == 1, answer.text
            ids.append(answer.json()["event_id"])

        (first,) = await receiver.wait_for(1)
        await revoke(client, backend, watcher, granted)
        # Answered while the first copy is still being posted.
        assert time.monotonic() - first.at < SLOW, "the revocation took too long to answer"
        refused = await post_event(client, order_event(entities.offering))
        assert refused.json()["queued"] == 0, refused.text

        async def settled() -> bool:
            states = [c["state"] for c in await copies(settings, hook)]
            return "pending" not in states

        await eventually(settled, timeout=3 * SLOW + 5, what="the copies settled")
        # Long enough for both later copies to have been posted, had they been sent.
        await asyncio.sleep(max(0.0, first.at + 2 * SLOW + 0.5 - time.monotonic()))
        assert receiver.ids() == [ids[0]]
    rows = await copies(settings, hook)
    assert [(c["event_id"], c["state"]) for c in rows] == [
        (ids[0], "published"),
        (ids[1], "given_up"),
        (ids[2], "given_up"),
    ]
    assert {c["last_error"] for c in rows[1:]} == {REFUSED_REASON}
