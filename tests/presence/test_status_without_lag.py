"""Status without lag (contract §12): in the seconds after an agent (re)connects, before the
broker's statistics have caught up (its collection interval, 5 s), the status already counts
what the queue holds and lists the connection that reads it, on the consumer's `/status/`
and on the admin queue rows (docs/decisions/028-status-without-lag.md).

A real STOMP client subscribes with client acknowledgements and a prefetch, so the queue
holds a known number of ready and unacked messages the moment it subscribes; each answer
is asked for as soon as presence says it is connected, never after waiting for the
statistics."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.conftest import SERVICE_TOKEN
from tests.events.support import order_event, post_event
from tests.helpers import Backend
from tests.presence.test_presence import register, status, wait_status
from tests.stomp_client import StompConsumer

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
# The broker's statistics interval (RabbitMQ's default `collect_statistics_interval`): an
# answer asked later than this after a subscribe could be right from the statistics alone.
STATISTICS_SECONDS = 5.0
COPIES = 6


def read_without_acking(registration: dict[str, Any], token: str, prefetch: int) -> StompConsumer:
    """Subscribe, and hold `prefetch` messages unacked."""
    consumer = StompConsumer(
        vhost=registration["vhost"], login=registration["rmq_username"], passcode=token
    )
    consumer.connect()
    consumer.subscribe(
        f"/amq/queue/{registration['queue_name']}", ack="client-individual", prefetch=prefetch
    )
    assert len(consumer.wait_for(prefetch)) == prefetch
    return consumer


async def admin_row(client: httpx.AsyncClient, registration: dict[str, Any]) -> dict[str, Any]:
    response = await client.get(
        "/api/admin/queues/", params={"vhost": registration["vhost"]}, headers=SERVICE
    )
    assert response.status_code == 200, response.text
    (row,) = [r for r in response.json() if r["queue_name"] == registration["queue_name"]]
    return dict(row)


@pytest.mark.settings(presence_interval_seconds=0)
async def test_counts_and_connections_right_after_each_reconnect(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    registration = await register(agent, offering)
    consumer = registration["rmq_username"]
    for _ in range(COPIES):
        accepted = await post_event(client, order_event(offering), wait=True)
        assert accepted.status_code == 200, accepted.text
    before = await status(client, consumer, agent.headers)
    assert (before["ready"], before["unacked"]) == (COPIES, 0)
    assert before["connected"] is False
    assert before["connections"] == []

    ports: list[int] = []
    for prefetch in (2, 1, 3):  # each reconnect is a new connection, from a new port
        subscribed = time.monotonic()
        reader = await asyncio.to_thread(read_without_acking, registration, agent.token, prefetch)
        try:
            answer, _ = await wait_status(
                client, consumer, agent.headers, lambda a: a["connected"], timeout=3
            )
            row = await admin_row(client, registration)
            took = time.monotonic() - subscribed
            # Within one statistics interval of the subscribe (the interval's phase is the
            # broker's: the counts below, changed by each reconnect's prefetch, show that
            # the answer did not come from statistics a reconnect behind).
            assert took < STATISTICS_SECONDS, f"asked {took:.1f} s after the subscribe"
            for seen in (answer, row):
                assert (seen["ready"], seen["unacked"]) == (COPIES - prefetch, prefetch), seen
                (connection,) = seen["connections"]
                assert connection["peer_host"] in ("127.0.0.1", "::1")
                assert isinstance(connection["peer_port"], int)
                assert connection["peer_port"] not in ports  # not the connection before
            ports.append(answer["connections"][0]["peer_port"])
        finally:
            await asyncio.to_thread(reader.close)
        # Gone: what it held unacked is ready again at once, and no connection is listed.
        gone, _ = await wait_status(
            client, consumer, agent.headers, lambda a: a["connected"] is False, timeout=3
        )
        assert (gone["ready"], gone["unacked"]) == (COPIES, 0)
        assert gone["connections"] == []
