"""A replica killed while it releases parked copies loses nothing (contract §11, §6): what it
moved back to pending but never settled parks again behind the queue's backlog, and another
replica releases it, in acceptance order."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aio_pika
import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import update

from queuekeeper.app import Runtime
from queuekeeper.broker.publisher import AmqpPublisher
from queuekeeper.config import Settings
from queuekeeper.events.relay import Relay
from queuekeeper.models import Delivery, DeliveryState, utcnow
from queuekeeper.parking.gate import ParkingGate
from queuekeeper.parking.release import Releaser
from tests.brokers import BROKER
from tests.events.support import drain, order_event, post_batch, register
from tests.helpers import Backend
from tests.parking.support import copy_states, set_presence, wait_for_states

COPIES = 3000


@pytest.mark.settings(
    relay_enabled=False,
    park_check_interval=0.1,
    relay_lease_seconds=2,
    park_release_max_in_flight=2 * COPIES,  # nobody reads the queue in this test
)
async def test_a_replica_killed_while_releasing_loses_nothing(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    state: Runtime = app.state.queuekeeper
    registered = await register(backend)
    queue, vhost = registered.queue_name, registered.vhost
    ids = [f"crash-{n:05}" for n in range(COPIES)]
    for start in range(0, COPIES, 500):
        chunk = ids[start : start + 500]
        response = await post_batch(
            client, [order_event(registered.offering, event_id=i) for i in chunk]
        )
        assert response.status_code == 202, response.text
    # Parked while the agent was away (no relay runs in this app: nothing published them).
    async with state.sessions() as session:
        await session.execute(
            update(Delivery)
            .where(Delivery.queue_name == queue)
            .values(state=DeliveryState.PARKED, parked_at=utcnow())
        )
        await session.commit()
    await set_presence(state.sessions, vhost, queue, consumers=1)

    # A replica (`queuekeeper relay`: relay and releaser) releases them and is killed
    # (SIGKILL: no clean-up) part way.
    env = {
        **os.environ,
        "QUEUEKEEPER_DATABASE_URL": settings.database_url,
        "QUEUEKEEPER_AMQP_URL": BROKER.amqp_url(),
        "QUEUEKEEPER_MANAGEMENT_URL": BROKER.management_url,
        "QUEUEKEEPER_INSTANCE_NAME": settings.instance_name,
        "QUEUEKEEPER_RELAY_LEASE_SECONDS": "2",
        "QUEUEKEEPER_PARK_CHECK_INTERVAL": "0.1",
        "QUEUEKEEPER_PARK_RELEASE_MAX_IN_FLIGHT": str(2 * COPIES),
    }
    command = [str(Path(sys.executable).parent / "queuekeeper"), "relay"]
    # The queue's depth is watched on one channel opened before the replica starts (a passive
    # declare is a round trip of about a millisecond), so the kill follows the first copy
    # published within a few milliseconds however slowly a loaded machine starts the
    # process: a new connection per look took long enough to miss the whole release.
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    depth_at_kill = 0
    async with connection:
        channel = await connection.channel()
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            deadline = asyncio.get_running_loop().time() + 90
            while asyncio.get_running_loop().time() < deadline and process.poll() is None:
                declared = await channel.declare_queue(queue, passive=True)
                depth_at_kill = int(declared.declaration_result.message_count or 0)
                if depth_at_kill:
                    break
                await asyncio.sleep(0.002)
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
    assert 0 < depth_at_kill < COPIES, "the kill did not land during the release"
    states = await copy_states(state.sessions, queue)
    assert states["published"] < COPIES, states  # some were never settled by the dead one

    # Another replica takes over once the dead one's leases have run out.
    publisher = AmqpPublisher(state.settings)
    survivor = Relay(state.settings, state.engine, publisher, state.provisioner)
    gate = ParkingGate(state.settings, state.engine)
    survivor.hold_back = gate.hold_back
    releaser = Releaser(state.settings, state.engine, survivor, publisher, gate, state.jobs)
    survivor.start()
    releaser.start()
    try:
        await wait_for_states(state.sessions, queue, {"published": COPIES}, timeout=60)
    finally:
        await releaser.stop()
        await survivor.stop()
        await publisher.close()
    received = [str(m.message_id) for m in await drain(vhost, queue)]
    assert set(received) == set(ids)  # nothing lost; a copy in flight may come twice
    first_seen = list(dict.fromkeys(received))
    assert first_seen == ids  # and in acceptance order
