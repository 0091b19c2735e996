"""Nothing accepted is lost: broker outage, a relay killed mid-flight, a queue deleted under us,
several relays at once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from queuekeeper.app import Runtime
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.publisher import AmqpPublisher
from queuekeeper.config import Settings
from queuekeeper.events.outbox import Claimed
from queuekeeper.events.relay import Relay
from queuekeeper.observability.metrics import AMQP_RECONNECTS, DELIVERIES
from tests.events.support import (
    drain,
    event_detail,
    order_event,
    post_batch,
    post_event,
    register,
    wait_settled,
)
from tests.helpers import Backend
from tests.proxy import TcpProxy, free_port

OUTAGE_PORT = free_port()


async def _all_settled(client: httpx.AsyncClient, event_ids: list[str], timeout: float) -> None:
    for event_id in event_ids:
        await wait_settled(client, event_id, timeout)


@pytest.mark.settings(
    amqp_url=f"amqp://guest:guest@127.0.0.1:{OUTAGE_PORT}/",
    relay_backoff_base=0.2,
    relay_backoff_max=0.5,
)
async def test_events_accepted_during_a_broker_outage_are_all_delivered_once_it_returns(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    proxy = TcpProxy(port=OUTAGE_PORT)
    proxy.start()
    try:
        registered = await register(backend)
        response = await post_event(
            client, order_event(registered.offering, event_id="before"), wait=True
        )
        assert response.json()["deliveries"][0]["state"] == "published"
        reconnects_before = AMQP_RECONNECTS._value.get()

        proxy.stop()  # the AMQP port is down; the open connection is cut
        ids = [f"outage-{n}" for n in range(20)]
        for event_id in ids[:10]:
            response = await post_event(client, order_event(registered.offering, event_id=event_id))
            assert response.status_code == 202
        response = await post_batch(
            client, [order_event(registered.offering, event_id=i) for i in ids[10:]]
        )
        assert response.status_code == 202

        # The relay tried, failed, and keeps the copies pending with the reason.
        for _ in range(100):
            copy = (await event_detail(client, ids[0]))["deliveries"][0]
            if copy["last_error"]:
                break
            await asyncio.sleep(0.05)
        assert copy["state"] == "pending"
        assert copy["attempts"] >= 1
        assert copy["last_error"]

        proxy.start()
        await _all_settled(client, ids, timeout=20)
        states = {(await event_detail(client, i))["deliveries"][0]["state"] for i in ids}
        assert states == {"published"}
        received = [m.message_id for m in await drain(registered.vhost, registered.queue_name)]
        assert sorted(received) == sorted(["before", *ids])  # each exactly once
        assert AMQP_RECONNECTS._value.get() > reconnects_before
    finally:
        proxy.close()


BLACKHOLE_PORT = free_port()


@pytest.mark.settings(relay_enabled=False)
async def test_copies_claimed_by_a_relay_that_dies_are_delivered_by_another(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    registered = await register(backend)
    ids = [f"crash-{n}" for n in range(5)]
    response = await post_batch(client, [order_event(registered.offering, event_id=i) for i in ids])
    assert response.status_code == 202

    # A `queuekeeper relay` process whose broker hangs: it claims, publishes into the void
    # and is killed (SIGKILL: no clean-up) before any confirm.
    hang = TcpProxy(port=BLACKHOLE_PORT, blackhole=True)
    hang.start()
    env = {
        **os.environ,
        "QUEUEKEEPER_DATABASE_URL": settings.database_url,
        "QUEUEKEEPER_AMQP_URL": hang.amqp_url(),
        "QUEUEKEEPER_INSTANCE_NAME": settings.instance_name,
        "QUEUEKEEPER_RELAY_LEASE_SECONDS": "2",
        "QUEUEKEEPER_AMQP_CONNECT_TIMEOUT": "60",
    }
    command = [str(Path(sys.executable).parent / "queuekeeper"), "relay"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        claimed: dict[str, Any] = {}
        for _ in range(200):
            claimed = (await event_detail(client, ids[-1]))["deliveries"][0]
            if claimed["claimed_by"] and hang.accepted:
                break
            await asyncio.sleep(0.05)
        assert claimed["claimed_by"], "the relay process never claimed anything"
        dead_relay = claimed["claimed_by"]
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        hang.close()
    for event_id in ids:
        copy = (await event_detail(client, event_id))["deliveries"][0]
        assert (copy["state"], copy["claimed_by"]) == ("pending", dead_relay)

    # Another relay takes the copies over once the dead one's lease has run out.
    state: Runtime = app.state.queuekeeper
    publisher = AmqpPublisher(state.settings)
    survivor = Relay(state.settings, state.engine, publisher, state.provisioner)
    survivor.start()
    try:
        await _all_settled(client, ids, timeout=15)
    finally:
        await survivor.stop()
        await publisher.close()
    for event_id in ids:
        copy = (await event_detail(client, event_id))["deliveries"][0]
        assert copy["state"] == "published"
        assert copy["attempts"] == 2
    received = [m.message_id for m in await drain(registered.vhost, registered.queue_name)]
    assert sorted(received) == sorted(ids)


async def test_a_queue_deleted_behind_our_back_is_declared_again_and_the_event_delivered(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    registered = await register(backend)
    assert await management.delete_queue(registered.vhost, registered.queue_name)
    returned_before = DELIVERIES.labels(outcome="returned")._value.get()

    response = await post_event(
        client, order_event(registered.offering, event_id="reborn"), wait=True
    )
    assert response.json()["deliveries"][0]["state"] == "published"
    assert DELIVERIES.labels(outcome="returned")._value.get() == returned_before + 1
    copy = (await event_detail(client, "reborn"))["deliveries"][0]
    assert "returned by the broker as unroutable" in copy["last_error"]
    assert copy["attempts"] == 2
    info = await management.get_queue(registered.vhost, registered.queue_name)
    assert info is not None
    assert info.arguments["x-overflow"] == "reject-publish-dlx"
    received = [m.message_id for m in await drain(registered.vhost, registered.queue_name)]
    assert received == ["reborn"]


class _CountingRelay(Relay):
    claimed = 0

    async def claim(self) -> list[Claimed]:
        claimed = await super().claim()
        self.claimed += len(claimed)
        return claimed


@pytest.mark.settings(relay_enabled=False, relay_batch_size=20, relay_concurrency=2)
async def test_relays_share_the_outbox_without_claiming_a_copy_twice(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    ids = [f"shared-{n}" for n in range(300)]
    response = await post_batch(client, [order_event(registered.offering, event_id=i) for i in ids])
    assert response.status_code == 202

    state: Runtime = app.state.queuekeeper
    publishers = [AmqpPublisher(state.settings) for _ in range(2)]
    relays = [
        _CountingRelay(state.settings, state.engine, publisher, state.provisioner)
        for publisher in publishers
    ]
    for relay in relays:
        relay.start()
    try:
        await _all_settled(client, ids[-1:], timeout=20)
        await _all_settled(client, ids, timeout=20)
    finally:
        for relay in relays:
            await relay.stop()
        for publisher in publishers:
            await publisher.close()
    assert relays[0].claimed > 0
    assert relays[1].claimed > 0
    assert relays[0].claimed + relays[1].claimed == 300
    for event_id in ids[:20]:
        assert (await event_detail(client, event_id))["deliveries"][0]["attempts"] == 1
    received = [m.message_id for m in await drain(registered.vhost, registered.queue_name)]
    assert sorted(received) == sorted(ids)
