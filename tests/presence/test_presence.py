"""Presence (contract §11): a consumer's arrival and departure are known within seconds, from
the broker's event exchange, and the periodic check repairs what the events missed.

A real STOMP client (the site agent's library) subscribes and goes away; the status answer
is read through the API, as an agent operator would."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from queuekeeper.jobs.runs import Job, Trigger
from queuekeeper.models import QueuePresence
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Agent, Backend
from tests.stomp_client import StompConsumer

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


async def register(agent: Agent, offering: uuid.UUID, **body: Any) -> dict[str, Any]:
    response = await agent.client.post(
        "/api/event-consumers/register/",
        json={"scopes": [{"type": "offering", "uuid": offering.hex}], **body},
        headers=agent.headers,
    )
    assert response.status_code == 201, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def status(
    client: httpx.AsyncClient, consumer: str, headers: dict[str, str]
) -> dict[str, Any]:
    response = await client.get(f"/api/event-consumers/{consumer}/status/", headers=headers)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def wait_status(
    client: httpx.AsyncClient,
    consumer: str,
    headers: dict[str, str],
    want: Any,
    timeout: float = 10.0,
) -> tuple[dict[str, Any], float]:
    """Poll the status until `want(answer)`; the answer and the seconds it took."""
    started = time.monotonic()
    while True:
        answer = await status(client, consumer, headers)
        if want(answer):
            return answer, time.monotonic() - started
        assert time.monotonic() - started < timeout, answer
        await asyncio.sleep(0.1)


def stomp(agent: Agent, registration: dict[str, Any]) -> StompConsumer:
    consumer = StompConsumer(
        vhost=registration["vhost"], login=registration["rmq_username"], passcode=agent.token
    )
    consumer.connect()
    consumer.subscribe(f"/amq/queue/{registration['queue_name']}")
    return consumer


@pytest.mark.settings(presence_interval_seconds=0)
async def test_arrival_and_departure_are_known_within_seconds(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    """Events alone (the periodic check is off): subscribe, then disconnect."""
    agent, offering = await backend.agent_with_offering()
    registration = await register(agent, offering)
    consumer_uuid = registration["rmq_username"]
    before = await status(client, consumer_uuid, agent.headers)
    assert before["connected"] is False
    assert before["connections"] == []

    reader = await asyncio.to_thread(stomp, agent, registration)
    try:
        answer, took = await wait_status(
            client, consumer_uuid, agent.headers, lambda a: a["connected"]
        )
        assert answer["consumers"] == 1
        assert answer["away_since"] is None
        assert answer["delivery_blocked_reason"] is None
        assert took < 5, f"arrival learnt after {took:.1f} s"
        # The Management API's connection list is statistics, a few seconds behind.
        answer, _ = await wait_status(
            client,
            consumer_uuid,
            agent.headers,
            lambda a: a["connections"] and a["connections"][0]["connected_at"],
            timeout=15,
        )
        (connection,) = answer["connections"]
        assert connection["peer_host"] in ("127.0.0.1", "::1")
        assert isinstance(connection["peer_port"], int)
        assert "STOMP" in (connection["client"] or "")
        connected_at = datetime.fromisoformat(connection["connected_at"])
        assert abs(connected_at - datetime.now(UTC)) < timedelta(seconds=30)
    finally:
        await asyncio.to_thread(reader.close)
    left = datetime.now(UTC)
    answer, took = await wait_status(
        client, consumer_uuid, agent.headers, lambda a: a["connected"] is False
    )
    assert took < 5, f"departure learnt after {took:.1f} s"
    assert answer["consumers"] == 0
    away = datetime.fromisoformat(answer["away_since"])
    assert abs(away - left) < timedelta(seconds=5)
    # Away for less than QUEUEKEEPER_PARK_AFTER_SECONDS: events still go to the queue.
    assert answer["delivery_blocked_reason"] is None


@pytest.mark.settings(presence_events_enabled=False, presence_interval_seconds=0)
async def test_the_periodic_check_repairs_what_no_event_said(
    app: FastAPI, backend: Backend, client: httpx.AsyncClient
) -> None:
    """No listener: the `presence` job alone finds the consumer, then its departure, and
    sets `away_since` when it first sees a queue nobody reads."""
    state = app.state.queuekeeper
    agent, offering = await backend.agent_with_offering()
    read = await register(agent, offering)
    other_offering = await backend.put_offering()
    await backend.grant(agent, other_offering)
    unread = await register(agent, other_offering)

    reader = await asyncio.to_thread(stomp, agent, read)
    try:
        checked = datetime.now(UTC)
        await state.jobs.run(Job.PRESENCE, Trigger.API)
        async with state.sessions() as session:
            rows = {
                row.queue_name: row
                for row in await session.scalars(
                    select(QueuePresence).where(QueuePresence.vhost == agent.vhost)
                )
            }
        assert rows[read["queue_name"]].consumers == 1
        assert rows[read["queue_name"]].away_since is None
        assert rows[unread["queue_name"]].consumers == 0
        first_seen = rows[unread["queue_name"]].away_since
        assert first_seen is not None
        assert abs(first_seen - checked) < timedelta(seconds=5)
        assert (await status(client, read["rmq_username"], agent.headers))["connected"] is True
    finally:
        await asyncio.to_thread(reader.close)
    # Nothing tells this replica; the next check does (the listing lags: it asks the queue).
    assert (await status(client, read["rmq_username"], agent.headers))["connected"] is True
    await asyncio.sleep(0.5)
    await state.jobs.run(Job.PRESENCE, Trigger.API)
    answer = await status(client, read["rmq_username"], agent.headers)
    assert answer["connected"] is False
    assert answer["away_since"] is not None
    # A second check keeps the first sight's time: away since then, not since each check.
    await state.jobs.run(Job.PRESENCE, Trigger.API)
    again = await status(client, unread["rmq_username"], agent.headers)
    assert again["away_since"] is not None
    assert datetime.fromisoformat(again["away_since"]) == first_seen
    # The run set the gauges the alerts read: both queues without a consumer, the longest
    # away since the first sight.
    scrape = (await client.get("/metrics")).text
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
    }
    assert samples["queuekeeper_queues_without_consumer"] == 2
    longest = samples["queuekeeper_queue_longest_away_seconds"]
    assert longest == pytest.approx((datetime.now(UTC) - first_seen).total_seconds(), abs=5)
    assert samples["queuekeeper_parked_copies"] == 0


async def test_replicas_agree_whichever_hears_the_event(
    make_client: Any, backend: Backend, client: httpx.AsyncClient
) -> None:
    """Two more replicas on the same database: each hears every event and writes the same
    absolute count; every replica answers the same."""
    replicas = [await make_client(presence_interval_seconds=0) for _ in range(2)]
    agent, offering = await backend.agent_with_offering()
    registration = await register(agent, offering)
    consumer_uuid = registration["rmq_username"]
    reader = await asyncio.to_thread(stomp, agent, registration)
    try:
        for http in (client, *replicas):
            await wait_status(http, consumer_uuid, SERVICE, lambda a: a["connected"])
    finally:
        await asyncio.to_thread(reader.close)
    answers = [
        (await wait_status(http, consumer_uuid, SERVICE, lambda a: a["connected"] is False))[0]
        for http in (client, *replicas)
    ]
    assert len({answer["away_since"] for answer in answers}) == 1
