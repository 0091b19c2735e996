"""A published waldur-site-agent away for longer than its queue's TTL loses nothing, gets
everything back in acceptance order, and its status says why its queue was silent
(contract §11), for each unified-queue release of tests/agents/releases.py.

Nothing here writes presence: the agent's stop is seen through RabbitMQ's event exchange
by the server's presence writer, parking starts QUEUEKEEPER_PARK_AFTER_SECONDS later, and
the test watches it through the status answer the agent's own token gets.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import async_sessionmaker

from queuekeeper.config import Settings
from queuekeeper.db import create_engine, create_sessionmaker
from tests.agents.harness import RunningAgent, Server, agent_config, start_agent, valid_payload
from tests.agents.releases import Release, releases_under_test
from tests.agents.test_agent_matrix import agent_python, runner_flags
from tests.conftest import SERVICE_TOKEN
from tests.events.support import queue_depth
from tests.helpers import Agent, Backend
from tests.parking.support import wait_for_states

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
PARK_AFTER = 2.0  # the copy published just after the stop must not park: margin for a busy CPU
CHECK_INTERVAL = 0.2
EVENTS = 1000
UNIFIED = [release for release in releases_under_test() if release.protocol == "unified"]


def _event(release: Release, offering: uuid.UUID, n: int, prefix: str = "away") -> dict[str, Any]:
    object_type = release.types[n % len(release.types)]
    return {
        "event_id": f"{prefix}-{n:05}",
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


async def _status(http: httpx.AsyncClient, agent: Agent, consumer: str) -> dict[str, Any]:
    response = await http.get(f"/api/event-consumers/{consumer}/status/", headers=agent.headers)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def _status_until(
    http: httpx.AsyncClient,
    agent: Agent,
    consumer: str,
    expected: dict[str, Any],
    timeout: float,
) -> dict[str, Any]:
    """The status answer once it has every field of `expected` (polled well under the
    per-token rate limit)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = await _status(http, agent, consumer)
        if all(answer.get(key) == value for key, value in expected.items()):
            return answer
        assert time.monotonic() < deadline, f"status {answer}, expected {expected}"
        await asyncio.sleep(0.25)


def _ids(received: list[dict[str, Any]]) -> list[str]:
    return [item["headers"]["amqp-message-id"] for item in received]


async def _start(
    python: Path, config: Path, tmp_path: Path, name: str, release: Release
) -> tuple[RunningAgent, dict[str, Any]]:
    running = await start_agent(python, config, tmp_path, name, *runner_flags(release))
    return running, await running.ready(timeout=120)


async def _first_within(running: RunningAgent, subscribed: float, limit: float) -> float:
    while not running.received():
        assert time.monotonic() - subscribed < limit, running.log_tail()
        await asyncio.sleep(0.05)
    return time.monotonic() - subscribed


@pytest.mark.timeout(600)
@pytest.mark.parametrize("release", UNIFIED, ids=[release.version for release in UNIFIED])
@pytest.mark.settings(
    park_after_seconds=PARK_AFTER,
    park_check_interval=CHECK_INTERVAL,
    # Short, so the copy published just after the stop expires while the agent is away;
    # the release holds at most 10 ready, so no released copy waits near the TTL however
    # slowly a loaded machine lets the agent read (1,000 released at once outlived a 2 s
    # TTL under the whole suite's load: they were dead-lettered, not read).
    queue_message_ttl_ms=5000,
    park_release_max_in_flight=10,
    dead_letter_census_seconds=1,
)
async def test_agent_away_longer_than_its_ttl_gets_every_event_once_in_order_on_return(
    release: Release, server: Server, settings: Settings, tmp_path: Path
) -> None:
    started = time.monotonic()
    python = await agent_python(release)
    count = EVENTS
    engine = create_engine(settings)
    sessions: async_sessionmaker[Any] = create_sessionmaker(engine)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            agent, offering = await Backend(http, SERVICE_TOKEN).agent_with_offering()
            config = agent_config(
                tmp_path / "agent.yaml", f"{server.url}/api/", agent.token, offering.hex
            )
            first, ready = await _start(python, config, tmp_path, "first", release)
            (consumer,) = ready["consumers"]
            queue, vhost, uuid_ = (
                consumer["queue_name"],
                consumer["vhost"],
                consumer["rmq_username"],
            )
            assert tuple(consumer["observable_object_types"]) == release.types, first.log_tail()
            await _status_until(
                http, agent, uuid_, {"connected": True, "delivery_blocked_reason": None}, 10
            )
            before_stop = datetime.now(UTC)
            await first.stop()
            stopped = datetime.now(UTC)
            assert first.process.returncode == 0, first.log_tail()

            # Just stopped, not yet away for PARK_AFTER: a copy is published; it expires
            # (TTL) in the queue and is dead-lettered.
            expiring = _event(release, offering, 0, prefix="expired")
            answer = await http.post(
                "/api/internal/events/", json=expiring, headers=SERVICE, params={"wait": "true"}
            )
            assert answer.json()["deliveries"][0]["state"] == "published", answer.text

            # The event exchange saw the stop: away since then, and parking once PARK_AFTER
            # has passed (the relay's gate looks again every CHECK_INTERVAL).
            away = await _status_until(
                http, agent, uuid_, {"delivery_blocked_reason": "agent_away"}, PARK_AFTER + 10
            )
            away_since = datetime.fromisoformat(away["away_since"])
            assert (
                before_stop - timedelta(seconds=1) <= away_since <= stopped + timedelta(seconds=2)
            ), (away_since, before_stop, stopped)
            assert away["connected"] is False, away
            assert away["consumers"] == 0, away
            assert away["parked"] == 0, away
            await asyncio.sleep(2 * CHECK_INTERVAL)
            events = [_event(release, offering, n) for n in range(count)]
            response = await http.post(
                "/api/internal/events/batch/", json={"events": events}, headers=SERVICE
            )
            assert response.status_code == 202, response.text
            await wait_for_states(sessions, queue, {"published": 1, "parked": count}, timeout=60)
            while await queue_depth(vhost, "waldur.dlq.messages") != 1:
                assert time.monotonic() - started < 300
                await asyncio.sleep(0.1)
            assert await queue_depth(vhost, queue) == 0
            # The dead letter is in the status once a census has seen it (one a second
            # here: docs/decisions/023-dead-letter-census.md).
            away = await _status_until(http, agent, uuid_, {"dead_letters": 1}, 15)
            assert away["delivery_blocked_reason"] == "agent_away", away
            assert away["parked"] == count, away
            assert away["connected"] is False, away
            assert datetime.fromisoformat(away["away_since"]) == away_since, away
            assert away["dead_letters"] == 1, away

            # Back: the agent subscribes; presence sees its consumer, the expired dead
            # letter comes first, then the parked copies in acceptance order.
            second, _ = await _start(python, config, tmp_path, "second", release)
            try:
                first_after = await _first_within(second, time.monotonic(), 10)
                released_at = time.monotonic()
                received = await second.wait_received(count + 1, timeout=240)
                released = time.monotonic() - released_at
                back = await _status_until(
                    http,
                    agent,
                    uuid_,
                    {"connected": True, "delivery_blocked_reason": None, "parked": 0},
                    30,
                )
                assert back["away_since"] is None, back

                # A replay of a window re-sends exactly that window's events, marked.
                window = [_event(release, offering, n, prefix="window") for n in range(20)]
                since = await _boundary()
                await _post(http, window[:10])
                await _post(http, window[10:])
                until = await _boundary()
                await _post(http, [_event(release, offering, 0, prefix="after")])
                await second.wait_received(count + 22, timeout=60)
                replay = await http.post(
                    f"/api/event-consumers/{uuid_}/replay/",
                    json={"since": since.isoformat(), "until": until.isoformat()},
                    headers=agent.headers,
                )
                assert replay.status_code == 202, replay.text
                assert replay.json() == {"replayed": 20}
                again = (await second.wait_received(count + 42, timeout=60))[count + 22 :]
                await asyncio.sleep(1)  # nothing more than the window
                assert len(second.received()) == count + 42, second.log_tail()
            finally:
                await second.stop()
            assert _ids(again) == [event["event_id"] for event in window]
            assert {item["headers"].get("x-queuekeeper-replay") for item in again} == {"true"}
            first_round = second.received()[: count + 22]
            assert all("x-queuekeeper-replay" not in item["headers"] for item in first_round)
            received = received[: count + 1]
            ids = _ids(received)
            assert len(ids) == len(set(ids)) == count + 1, second.log_tail()
            assert ids == [expiring["event_id"], *(event["event_id"] for event in events)]
            by_id = {event["event_id"]: event for event in [expiring, *events]}
            for item in received:
                sent = by_id[item["headers"]["amqp-message-id"]]
                # The handler that ran is the one the agent's router picked for the type.
                assert item["object_type"] == sent["object_type"]
                body = json.loads(item["body"])
                assert body["object_type"] == sent["object_type"]
                assert {key: body[key] for key in sent["payload"]} == sent["payload"]
            assert {item["object_type"] for item in received} == set(release.types)
            await wait_for_states(sessions, queue, {"published": count + 42})
            print(
                f"\n{release.version}: {count} parked copies, first {first_after:.2f} s after "
                f"subscribe, all in {released:.1f} s; test {time.monotonic() - started:.0f} s"
            )
    finally:
        await engine.dispose()
