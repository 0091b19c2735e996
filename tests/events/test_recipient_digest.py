"""A store remembers the recipients it read (docs/decisions/020-recipient-digest.md): the
next event of the same offering and type is one statement, and a change of who
may receive it (access revoked, owner deactivated, token expired, a queue registered) is seen
by the very next event, as when every store read the recipients first."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select

from queuekeeper.events import outbox_postgres
from queuekeeper.models import Delivery, Event
from tests.events.support import SERVICE, Registered, order_event, post_event, register
from tests.helpers import Backend, database_statements

# A store: the recipients' read and the write; with the recipients remembered, the write.
COLD = 2
WARM = 1
_STORE = {*outbox_postgres.RECIPIENTS.values(), *outbox_postgres.INSERT_ACCEPTED.values()}


async def _accepted(app: FastAPI, client: httpx.AsyncClient, offering: uuid.UUID) -> Any:
    """Post one event; its answer and the statements its store ran."""
    with database_statements(app.state.queuekeeper.engine) as statements:
        response = await post_event(client, order_event(offering))
    assert response.status_code == 202, response.text
    # The store's own statements (outbox_postgres.RECIPIENTS, INSERT_ACCEPTED), not a relay's
    # claim or the access sweep's queries that a change wakes meanwhile.
    store = [s for s in statements if s in _STORE]
    return response.json(), len(store)


async def _copies(app: FastAPI, event_id: str) -> int:
    async with app.state.queuekeeper.sessions() as session:
        found = await session.scalar(
            select(func.count()).select_from(Delivery).where(Delivery.event_id == event_id)
        )
    return int(found or 0)


async def test_the_next_event_of_an_offering_is_one_statement(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    first, cold = await _accepted(app, client, registered.offering)
    second, warm = await _accepted(app, client, registered.offering)
    assert (first["queued"], second["queued"]) == (1, 1)
    assert (cold, warm) == (COLD, WARM)
    assert await _copies(app, second["event_id"]) == 1


async def _revoke_access(client: httpx.AsyncClient, registered: Registered) -> None:
    response = await client.delete(
        f"/api/internal/offerings/{registered.offering}/users/{registered.agent.uuid}/",
        headers=SERVICE,
    )
    assert response.status_code == 204, response.text


async def _set_active(client: httpx.AsyncClient, registered: Registered, active: bool) -> None:
    agent = registered.agent
    response = await client.put(
        f"/api/internal/users/{agent.uuid}/",
        json={"username": f"user-{agent.uuid.hex[:8]}", "is_active": active},
        headers=SERVICE,
    )
    assert response.status_code == 200, response.text


async def _deactivate(client: httpx.AsyncClient, registered: Registered) -> None:
    await _set_active(client, registered, active=False)


async def _delete_user(client: httpx.AsyncClient, registered: Registered) -> None:
    response = await client.delete(f"/api/internal/users/{registered.agent.uuid}/", headers=SERVICE)
    assert response.status_code == 204, response.text


Change = Callable[[httpx.AsyncClient, Registered], Awaitable[None]]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_revoke_access, id="access-revoked"),
        pytest.param(_deactivate, id="owner-deactivated"),
        pytest.param(_delete_user, id="owner-deleted"),
    ],
)
async def test_a_revocation_is_seen_by_the_next_event(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, change: Change
) -> None:
    registered = await register(backend)
    other = await register(backend, offering=registered.offering)  # keeps the offering served
    first, _ = await _accepted(app, client, registered.offering)
    assert first["queued"] == 2
    await change(client, registered)
    second, statements = await _accepted(app, client, registered.offering)
    assert second["queued"] == 1
    assert await _copies(app, second["event_id"]) == 1
    # The write with the remembered recipients wrote nothing; read again, written.
    assert statements == 3
    assert other.queue_name


async def test_an_expired_token_is_seen_by_the_next_event(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    expires = datetime.now(UTC) + timedelta(seconds=1.5)
    await backend.expire_token_at(registered.agent, expires)
    first, _ = await _accepted(app, client, registered.offering)
    assert first["queued"] == 1
    await asyncio.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.2)
    # Nothing was written between: only the clock says the owner may no longer receive.
    second, _ = await _accepted(app, client, registered.offering)
    assert second["queued"] == 0
    assert await _copies(app, second["event_id"]) == 0


async def test_a_queue_registered_after_is_sent_the_next_event(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    first, _ = await _accepted(app, client, registered.offering)
    assert first["queued"] == 1
    await register(backend, offering=registered.offering)
    second, _ = await _accepted(app, client, registered.offering)
    assert second["queued"] == 2
    assert await _copies(app, second["event_id"]) == 2


def _before_each_write(
    monkeypatch: pytest.MonkeyPatch, action: Callable[[int], Awaitable[None]]
) -> list[int]:
    """Run `action(n)` before a store's n-th write, after it read (or remembered) the
    recipients: a change committed there is what the write's digest check is for. Returns
    the writes made so far."""
    real_insert = outbox_postgres.StoreUnit.insert
    writes: list[int] = []

    async def insert(self: outbox_postgres.StoreUnit, *args: Any, **kwargs: Any) -> Any:
        writes.append(len(writes) + 1)
        await action(writes[-1])
        return await real_insert(self, *args, **kwargs)

    monkeypatch.setattr(outbox_postgres.StoreUnit, "insert", insert)
    return writes


async def test_access_revoked_between_the_read_and_the_write_gets_no_copy(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered = await register(backend)

    async def revoke_first(write: int) -> None:
        if write == 1:
            await _revoke_access(client, registered)

    writes = _before_each_write(monkeypatch, revoke_first)
    response = await post_event(client, order_event(registered.offering))
    assert response.status_code == 202, response.text
    assert writes == [1, 2]  # the first write saw the change and wrote nothing; read again
    assert response.json()["queued"] == 0
    assert await _copies(app, response.json()["event_id"]) == 0


async def test_recipients_changing_before_every_write_is_a_503_that_stored_nothing(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered = await register(backend)
    await register(backend, offering=registered.offering)  # keeps the offering served

    async def flip_owner(write: int) -> None:  # each try read the recipients afresh
        await _set_active(client, registered, active=write % 2 == 0)

    writes = _before_each_write(monkeypatch, flip_owner)
    response = await post_event(client, order_event(registered.offering))
    assert response.status_code == 503, response.text
    assert "changed while they were stored, 3 times over" in response.text
    assert "nothing of this request was stored" in response.text
    assert writes == [1, 2, 3]
    async with app.state.queuekeeper.sessions() as session:
        events = await session.scalar(
            select(func.count())
            .select_from(Event)
            .where(Event.offering_uuid == registered.offering)
        )
    assert events == 0
