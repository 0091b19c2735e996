"""Helpers for the publishing tests: the backend's event calls and direct broker probes."""

from __future__ import annotations

import asyncio
import os
import uuid
from asyncio.subprocess import PIPE, STDOUT
from dataclasses import dataclass
from typing import Any

import aio_pika
import httpx
from aio_pika.abc import AbstractIncomingMessage
from fastapi import FastAPI

from queuekeeper.app import Runtime
from queuekeeper.broker.publisher import AmqpPublisher
from queuekeeper.events.relay import Relay
from tests.brokers import BROKER
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Agent, Backend
from tests.ops.tools import require, unavailable

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


@dataclass
class Registered:
    agent: Agent
    offering: uuid.UUID
    subscription: str
    queue_name: str
    object_type: str

    @property
    def vhost(self) -> str:
        return self.agent.vhost


async def register(
    backend: Backend,
    *,
    agent: Agent | None = None,
    offering: uuid.UUID | None = None,
    object_type: str = "order",
    subscription: str | None = None,
) -> Registered:
    """A user with access to an offering, a subscription, and a registered queue."""
    if agent is None:
        agent = await backend.put_user()
    if offering is None:
        offering = await backend.put_offering()
    await backend.grant(agent, offering)
    if subscription is None:
        subscription = (await agent.create_subscription())["uuid"]
    response = await agent.create_queue(subscription, offering, object_type)
    assert response.status_code in (200, 201), response.text
    return Registered(agent, offering, subscription, response.json()["queue_name"], object_type)


def order_event(offering: uuid.UUID, **extra: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "offering_uuid": offering.hex,
        "object_type": "order",
        "payload": {"order_uuid": uuid.uuid4().hex, "order_state": "executing"},
    }
    event.update(extra)
    return event


async def post_event(
    client: httpx.AsyncClient, event: dict[str, Any], *, wait: bool = False
) -> httpx.Response:
    return await client.post(
        "/api/internal/events/",
        json=event,
        headers=SERVICE,
        params={"wait": "true"} if wait else {},
    )


async def post_batch(
    client: httpx.AsyncClient, events: list[dict[str, Any]], *, wait: bool = False
) -> httpx.Response:
    return await client.post(
        "/api/internal/events/batch/",
        json={"events": events},
        headers=SERVICE,
        params={"wait": "true"} if wait else {},
    )


async def event_detail(client: httpx.AsyncClient, event_id: str) -> dict[str, Any]:
    response = await client.get(f"/api/internal/events/{event_id}/", headers=SERVICE)
    assert response.status_code == 200, response.text
    detail: dict[str, Any] = response.json()
    return detail


async def wait_settled(
    client: httpx.AsyncClient, event_id: str, timeout: float = 15.0
) -> dict[str, Any]:
    """Poll the event until no copy is pending."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        detail = await event_detail(client, event_id)
        if all(d["state"] != "pending" for d in detail["deliveries"]):
            return detail
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"event {event_id} still pending: {detail['deliveries']}")
        await asyncio.sleep(0.05)


async def queue_depth(vhost: str, queue: str) -> int:
    """Exact ready-message count (a passive declare; the Management API's figure lags)."""
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


async def on_queue_process(vhost: str, queue: str, action: str) -> str:
    """Evaluate Erlang `action` on the broker's process of a classic queue, bound to `P` (say
    `sys:suspend(P)` or `exit(P, kill)`), and return what it printed: what no client can make
    a queue do, done to a queue of the test's own vhost on the local node through
    `rabbitmqctl eval`."""
    if BROKER.host not in ("127.0.0.1", "localhost"):
        unavailable(f"the broker at {BROKER.host} is not this machine's: no rabbitmqctl eval")
    ctl = require("rabbitmqctl")
    expression = (
        f'{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"{vhost}">>, queue, '
        f'<<"{queue}">>)), P = amqqueue:get_pid(Q), {action}.'
    )
    process = await asyncio.create_subprocess_exec(
        ctl, "eval", expression, stdout=PIPE, stderr=STDOUT
    )
    output, _ = await process.communicate()
    if process.returncode != 0 and os.geteuid() != 0:
        # rabbitmqctl reaches the node with its Erlang cookie, which the broker's package
        # keeps for root and the rabbitmq user (another user's is one rabbitmqctl made up).
        unavailable("rabbitmqctl eval failed for a user other than root (the broker's cookie)")
    assert process.returncode == 0, output.decode()
    return output.decode().strip()


async def drain(vhost: str, queue: str) -> list[AbstractIncomingMessage]:
    """Take every message off a queue (basic.get until empty), acknowledging each."""
    taken: list[AbstractIncomingMessage] = []
    connection = await aio_pika.connect(BROKER.amqp_url(vhost))
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        while True:
            message = await declared.get(fail=False, no_ack=True)
            if message is None:
                return taken
            taken.append(message)


def relay_of(app: FastAPI, **changes: object) -> tuple[Relay, AmqpPublisher]:
    """A relay of the app's database and broker with `changes` to its settings, and its
    publisher (the caller closes it), not started."""
    state: Runtime = app.state.queuekeeper
    settings = state.settings.model_copy(update=changes)
    publisher = AmqpPublisher(settings)
    return Relay(settings, state.engine, publisher, state.provisioner), publisher
