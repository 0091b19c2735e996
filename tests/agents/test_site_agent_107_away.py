"""The published waldur-site-agent 1.0.7 away for longer than its queue's TTL loses nothing
and gets everything back in acceptance order (contract §11).

Presence is simulated where the test needs an away agent: a helper writes the queue's
presence rows as the presence job does (tests/parking/support.py). The consumer is the real
agent's STOMP subscription, so with the presence job running the test holds as well: the
job then writes the same rows itself.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import async_sessionmaker

from queuekeeper.config import Settings
from queuekeeper.db import create_engine, create_sessionmaker
from tests.agents.harness import AGENT_107_TYPES, Server, agent_config, start_agent, valid_payload
from tests.agents.test_site_agent_107_e2e import INITIAL_PROCESSING
from tests.conftest import SERVICE_TOKEN
from tests.events.support import queue_depth
from tests.helpers import Backend
from tests.parking.support import set_presence, wait_for_states

EVENTS = 1000
SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


def _event(offering: uuid.UUID, n: int) -> dict[str, Any]:
    object_type = AGENT_107_TYPES[n % len(AGENT_107_TYPES)]
    return {
        "event_id": f"away-{n:05}",
        "offering_uuid": offering.hex,
        "object_type": object_type,
        "payload": valid_payload(object_type),
    }


async def _boundary() -> datetime:
    await asyncio.sleep(0.05)
    moment = datetime.now(UTC)
    await asyncio.sleep(0.05)
    return moment


async def _post(http: httpx.AsyncClient, events: list[dict[str, Any]]) -> None:
    response = await http.post(
        "/api/internal/events/batch/",
        json={"events": events},
        headers=SERVICE,
        params={"wait": "true"},
    )
    assert response.status_code == 200, response.text


@pytest.mark.timeout(600)
@pytest.mark.settings(park_after_seconds=1, park_check_interval=0.2, queue_message_ttl_ms=2000)
async def test_107_away_longer_than_its_ttl_gets_every_event_once_in_order_on_return(
    server: Server, site_agent_107_python: Path, settings: Settings, tmp_path: Path
) -> None:
    engine = create_engine(settings)
    sessions: async_sessionmaker[Any] = create_sessionmaker(engine)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            backend = Backend(http, SERVICE_TOKEN)
            agent, offering = await backend.agent_with_offering()
            config = agent_config(
                tmp_path / "agent.yaml", f"{server.url}/api/", agent.token, offering.hex
            )
            first = await start_agent(
                site_agent_107_python, config, tmp_path, "first", INITIAL_PROCESSING
            )
            status = await first.ready(timeout=120)
            (consumer,) = status["consumers"]
            queue, vhost = consumer["queue_name"], consumer["vhost"]
            await first.stop()

            # Stopped: a copy published before parking starts expires (TTL) and is
            # dead-lettered; then the agent has been away longer than park_after.
            expiring = _event(offering, -1) | {"event_id": "away-expired"}
            answer = await http.post(
                "/api/internal/events/", json=expiring, headers=SERVICE, params={"wait": "true"}
            )
            assert answer.json()["deliveries"][0]["state"] == "published", answer.text
            await set_presence(sessions, vhost, queue, consumers=0, away_for=60)
            await asyncio.sleep(0.6)
            events = [_event(offering, n) for n in range(EVENTS)]
            response = await http.post(
                "/api/internal/events/batch/", json={"events": events}, headers=SERVICE
            )
            assert response.status_code == 202, response.text
            await wait_for_states(sessions, queue, {"published": 1, "parked": EVENTS}, timeout=60)
            for _ in range(100):
                if await queue_depth(vhost, "waldur.dlq.messages") == 1:
                    break
                await asyncio.sleep(0.1)
            assert await queue_depth(vhost, queue) == 0
            assert await queue_depth(vhost, "waldur.dlq.messages") == 1

            # Back: the agent subscribes; presence sees its consumer.
            second = await start_agent(
                site_agent_107_python, config, tmp_path, "second", INITIAL_PROCESSING
            )
            try:
                await second.ready(timeout=120)
                subscribed = time.monotonic()
                await set_presence(sessions, vhost, queue, consumers=1)
                while not second.received():
                    assert time.monotonic() - subscribed < 10, second.log_tail()
                    await asyncio.sleep(0.05)
                first_after = time.monotonic() - subscribed
                received = await second.wait_received(EVENTS + 1, timeout=240)

                # A replay of a window re-sends exactly that window's events, marked.
                window = [_event(offering, EVENTS + n) for n in range(20)]
                since = await _boundary()
                await _post(http, window[:10])
                await _post(http, window[10:])
                until = await _boundary()
                await _post(http, [_event(offering, EVENTS + 20)])
                await second.wait_received(EVENTS + 22, timeout=60)
                replay = await http.post(
                    f"/api/event-consumers/{consumer['rmq_username']}/replay/",
                    json={"since": since.isoformat(), "until": until.isoformat()},
                    headers=agent.headers,
                )
                assert replay.status_code == 202, replay.text
                assert replay.json() == {"replayed": 20}
                again = (await second.wait_received(EVENTS + 42, timeout=60))[EVENTS + 22 :]
                await asyncio.sleep(1)  # nothing more than the window
                assert len(second.received()) == EVENTS + 42
            finally:
                await second.stop()
            replayed = [item["headers"]["amqp-message-id"] for item in again]
            assert replayed == [event["event_id"] for event in window]
            assert {item["headers"].get("x-queuekeeper-replay") for item in again} == {"true"}
            received = received[: EVENTS + 1]
            ids = [item["headers"]["amqp-message-id"] for item in received]
            assert len(ids) == len(set(ids)) == EVENTS + 1, second.log_tail()
            assert ids == ["away-expired", *(event["event_id"] for event in events)]
            by_id = {event["event_id"]: event for event in events}
            for item in received[1:]:
                sent = by_id[item["headers"]["amqp-message-id"]]
                assert item["object_type"] == sent["object_type"]
                assert json.loads(item["body"])["object_type"] == sent["object_type"]
            await wait_for_states(sessions, queue, {"published": EVENTS + 42})
            print(f"\nfirst parked copy {first_after:.2f} s after subscribe")
    finally:
        await engine.dispose()
