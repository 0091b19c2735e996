"""Helpers for the tests of copies leaving a queue when access ends (contract §14;
docs/decisions/030-queued-copies-on-every-access-loss.md)."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from typing import Any

import httpx
from sqlalchemy import func, select

from queuekeeper.config import Settings
from queuekeeper.db import create_engine
from queuekeeper.models import AccessSweep
from tests.consumers.scopes import SERVICE
from tests.events.support import post_event, queue_depth
from tests.helpers import Agent
from tests.stomp_client import StompConsumer


async def sent(client: httpx.AsyncClient, event: dict[str, Any]) -> str:
    answer = await post_event(client, event, wait=True)
    assert answer.status_code == 200, answer.text
    assert answer.json()["queued"] >= 1, answer.text
    event_id: str = answer.json()["event_id"]
    return event_id


# The sweep's own row in `access_sweeps` (consumers/repository.EXPIRY_WATERMARK), spelled out
# so that this file also runs, and fails, against code without the sweep.
EXPIRY_WATERMARK = "expiry_watermark"
PUSHED = 15.0  # seconds: a change the backend pushes (contract §14)
BY_TIME = 30.0  # an expiry nobody pushes


async def swept(settings: Settings, *, through: datetime | None = None) -> None:
    """Until the sweep has handled every access change so far (and, with `through`, the
    expiries up to then): its rows are deleted only after the queues were read through
    (consumers/sweep.py), so the queue is final then, not caught between two batches."""
    engine = create_engine(settings)
    deadline = time.monotonic() + BY_TIME
    try:
        while True:
            async with engine.connect() as connection:
                pending = await connection.scalar(
                    select(func.count())
                    .select_from(AccessSweep)
                    .where(AccessSweep.reason != EXPIRY_WATERMARK)
                )
                watermark = await connection.scalar(
                    select(func.max(AccessSweep.at)).where(AccessSweep.reason == EXPIRY_WATERMARK)
                )
            if not pending and (through is None or (watermark and watermark >= through)):
                return
            assert time.monotonic() < deadline, f"{pending} access changes still unswept"
            await asyncio.sleep(0.1)
    finally:
        await engine.dispose()


async def holds(agent: Agent, consumer: dict[str, Any], count: int, within: float) -> float:
    """Seconds until the consumer's queue holds exactly `count` ready copies; fails after
    `within`."""
    began = time.monotonic()
    while True:
        depth = await queue_depth(agent.vhost, consumer["queue_name"])
        if depth == count:
            return time.monotonic() - began
        assert time.monotonic() - began < within, f"{depth} copies still queued, not {count}"
        await asyncio.sleep(0.1)


def _read(vhost: str, login: str, token: str, queue: str, count: int) -> list[str]:
    stomp = StompConsumer(vhost, login, token)
    stomp.connect()
    try:
        stomp.subscribe(f"/amq/queue/{queue}")
        stomp.wait_for(count, 10.0)
        stomp.wait_for(count + 1, 0.5)
        return [m.headers["amqp-message-id"] for m in stomp.listener.messages]
    finally:
        stomp.close()


async def read_when_let_in(
    agent: Agent, consumer: dict[str, Any], count: int, token: str | None = None
) -> list[str]:
    """The message ids the agent reads once the broker lets it in again (its login is off
    while its queue is read through)."""
    deadline = time.monotonic() + PUSHED
    while True:
        try:
            return await asyncio.to_thread(
                _read,
                agent.vhost,
                consumer["rmq_username"],
                token or agent.token,
                consumer["queue_name"],
                count,
            )
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def push_user(client: httpx.AsyncClient, agent: Agent, **body: Any) -> None:
    """The backend's PUT of the whole user (a privilege left out is one it no longer has)."""
    response = await client.put(
        f"/api/internal/users/{agent.uuid}/",
        json={"username": f"user-{agent.uuid.hex[:8]}", **body},
        headers=SERVICE,
    )
    assert response.status_code == 200, response.text
