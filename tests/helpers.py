"""Test helpers: a backend that pushes the directory, an agent that calls the REST API."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper.events import outbox_postgres


@dataclass
class Agent:
    """A user pushed by the backend, seen from the agent's side."""

    client: httpx.AsyncClient
    uuid: uuid.UUID
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Token {self.token}"}

    @property
    def vhost(self) -> str:
        return self.uuid.hex

    async def create_subscription(self, **body: Any) -> dict[str, Any]:
        response = await self.client.post(
            "/api/event-subscriptions/", json=body, headers=self.headers
        )
        assert response.status_code == 201, response.text
        result: dict[str, Any] = response.json()
        return result

    async def create_queue(
        self, subscription_uuid: str, offering_uuid: uuid.UUID | str, object_type: str = "order"
    ) -> httpx.Response:
        offering = offering_uuid.hex if isinstance(offering_uuid, uuid.UUID) else offering_uuid
        return await self.client.post(
            f"/api/event-subscriptions/{subscription_uuid}/create_queue/",
            json={"offering_uuid": offering, "object_type": object_type},
            headers=self.headers,
        )


class Backend:
    def __init__(self, client: httpx.AsyncClient, service_token: str) -> None:
        self.client = client
        self.headers = {"Authorization": f"Bearer {service_token}"}

    async def put_user(self, user_uuid: uuid.UUID | None = None, **body: Any) -> Agent:
        user_uuid = user_uuid or uuid.uuid4()
        body.setdefault("username", f"user-{user_uuid.hex[:8]}")
        body.setdefault("token", secrets.token_hex(20))
        response = await self.client.put(
            f"/api/internal/users/{user_uuid}/", json=body, headers=self.headers
        )
        assert response.status_code in (200, 201), response.text
        return Agent(self.client, user_uuid, body["token"])

    async def put_offering(
        self, offering_uuid: uuid.UUID | None = None, name: str = "HPC"
    ) -> uuid.UUID:
        offering_uuid = offering_uuid or uuid.uuid4()
        response = await self.client.put(
            f"/api/internal/offerings/{offering_uuid}/", json={"name": name}, headers=self.headers
        )
        assert response.status_code in (200, 201), response.text
        return offering_uuid

    async def grant(self, agent: Agent, offering_uuid: uuid.UUID) -> None:
        response = await self.client.put(
            f"/api/internal/offerings/{offering_uuid}/users/{agent.uuid}/", headers=self.headers
        )
        assert response.status_code in (200, 201), response.text

    async def expire_token_at(self, agent: Agent, when: datetime) -> None:
        """The agent's token stops being valid at `when` (the user pushed again with it)."""
        response = await self.client.put(
            f"/api/internal/users/{agent.uuid}/",
            json={"username": f"user-{agent.uuid.hex[:8]}", "token_expires_at": when.isoformat()},
            headers=self.headers,
        )
        assert response.status_code == 200, response.text

    async def agent_with_offering(self) -> tuple[Agent, uuid.UUID]:
        agent = await self.put_user()
        offering = await self.put_offering()
        await self.grant(agent, offering)
        return agent, offering


class Operator:
    """The operator's admin API (service token)."""

    def __init__(self, client: httpx.AsyncClient, service_token: str) -> None:
        self.client = client
        self.headers = {"Authorization": f"Bearer {service_token}"}

    async def reconcile(
        self, *, dry_run: bool = False, force: bool = False, expect: int = 200
    ) -> dict[str, Any]:
        response = await self.client.post(
            "/api/admin/reconcile/",
            params={"dry_run": str(dry_run).lower(), "force": str(force).lower()},
            headers=self.headers,
        )
        assert response.status_code == expect, response.text
        result: dict[str, Any] = response.json()
        return result

    async def cleanup_stale(self, *, dry_run: bool = False) -> dict[str, Any]:
        response = await self.client.post(
            "/api/admin/cleanup-stale/",
            params={"dry_run": str(dry_run).lower()},
            headers=self.headers,
        )
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    async def redrive(self, vhost: str | None = None) -> dict[str, Any]:
        response = await self.client.post(
            "/api/admin/dead-letters/redrive/",
            params={"vhost": vhost} if vhost else None,
            headers=self.headers,
        )
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    async def get(self, path: str, **params: Any) -> Any:
        response = await self.client.get(path, params=params or None, headers=self.headers)
        assert response.status_code == 200, response.text
        return response.json()


async def clear_of_a_window_edge(period: float = 60.0, margin: float = 10.0) -> None:
    """Start a rate-limit test well inside one of the limiter's windows, which are aligned to
    the clock: the sliding window counter weighs the previous window's calls by how much of it
    still overlaps (docs/decisions/012-sliding-window-rate-limit.md), so calls straddling an
    edge are counted as fewer than they were, and a test's last call may pass."""
    left = period - time.time() % period
    if left < margin:
        await asyncio.sleep(left + 0.05)


# Set while a `database_statements(..., own_only=True)` block runs: the code it calls, and the
# tasks that code starts, see it; the app's background tasks, started before, do not.
_COUNTED: ContextVar[bool] = ContextVar("qk_test_counted_statements", default=False)


@contextmanager
def database_statements(engine: AsyncEngine, *, own_only: bool = False) -> Iterator[list[str]]:
    """Every statement sent to the database while inside: those through SQLAlchemy (its
    `before_cursor_execute` event) and those the outbox sends to asyncpg itself
    (`outbox_postgres.send`). With `own_only`, only those of the code called inside (a
    request through the ASGI transport), not those a background job of the app sends
    meanwhile, which a busy machine may schedule at any moment."""
    statements: list[str] = []
    original = outbox_postgres.send

    def through_sqlalchemy(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if not own_only or _COUNTED.get():
            statements.append(statement)

    async def to_the_driver(driver: Any, sql: str, arguments: Sequence[Any]) -> list[Any]:
        if not own_only or _COUNTED.get():
            statements.append(sql)
        return await original(driver, sql, arguments)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(outbox_postgres, "send", to_the_driver)
        event.listen(engine.sync_engine, "before_cursor_execute", through_sqlalchemy)
        counted = _COUNTED.set(True)
        try:
            yield statements
        finally:
            _COUNTED.reset(counted)
            event.remove(engine.sync_engine, "before_cursor_execute", through_sqlalchemy)
