"""Events reach real consumers on the real broker: who gets them, what they look like, outcomes."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime
from typing import Any, cast

import aio_pika
import httpx
import pytest
from fastapi import FastAPI
from structlog.testing import capture_logs

from queuekeeper.app import Runtime
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.topology import queue_arguments
from queuekeeper.events.relay import Relay
from queuekeeper.observability.metrics import DELIVERIES
from tests.brokers import BROKER
from tests.events.support import (
    Registered,
    drain,
    event_detail,
    on_queue_process,
    order_event,
    post_batch,
    post_event,
    queue_depth,
    register,
    wait_settled,
)
from tests.helpers import Backend
from tests.proxy import closed_port, free_port
from tests.stomp_client import StompConsumer


async def _consumer(vhost: str, subscription: str, token: str, queue: str) -> StompConsumer:
    consumer = StompConsumer(vhost, subscription, token)
    await asyncio.to_thread(consumer.connect)
    consumer.subscribe(f"/amq/queue/{queue}", sub_id=queue)
    return consumer


async def test_an_event_reaches_each_registered_queue_and_nowhere_else(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    first = await register(backend)
    offering = first.offering
    second = await register(backend, offering=offering)
    other_type = await register(
        backend, agent=second.agent, offering=offering, object_type="resource"
    )
    other_offering = await register(backend, object_type="order")
    inactive = await register(backend, offering=offering)
    await backend.put_user(inactive.agent.uuid, is_active=False, token=inactive.agent.token)
    revoked = await register(backend, offering=offering)
    response = await client.delete(
        f"/api/internal/offerings/{offering}/users/{revoked.agent.uuid}/",
        headers=backend.headers,
    )
    assert response.status_code == 204

    consumers = [
        await _consumer(r.vhost, r.subscription, r.agent.token, r.queue_name)
        for r in (first, second)
    ]
    try:
        response = await post_event(client, order_event(offering, event_id="to-all"), wait=True)
        assert response.status_code == 200, response.text
        assert {d["queue_name"] for d in response.json()["deliveries"]} == {
            first.queue_name,
            second.queue_name,
        }
        assert {d["state"] for d in response.json()["deliveries"]} == {"published"}
        narrowed = order_event(offering, event_id="to-second", user_uuids=[second.agent.uuid.hex])
        response = await post_event(client, narrowed, wait=True)
        assert [d["queue_name"] for d in response.json()["deliveries"]] == [second.queue_name]

        got_first = await asyncio.to_thread(consumers[0].wait_for, 1)
        got_second = await asyncio.to_thread(consumers[1].wait_for, 2)
        await asyncio.sleep(0.3)  # anything extra would have arrived by now
        assert [m.headers["amqp-message-id"] for m in consumers[0].listener.messages] == ["to-all"]
        assert [m.headers["amqp-message-id"] for m in got_second] == ["to-all", "to-second"]
        assert json.loads(got_first[0].body)["offering_uuid"] == offering.hex
    finally:
        for consumer in consumers:
            consumer.close()

    for quiet in (other_type, other_offering, inactive):
        assert await queue_depth(quiet.vhost, quiet.queue_name) == 0, quiet.queue_name
    response = await client.get("/api/event-subscription-queues/", headers=revoked.agent.headers)
    assert response.json() == []  # revoking access deleted its queue


async def test_message_body_and_properties(client: httpx.AsyncClient, backend: Backend) -> None:
    registered = await register(backend)
    payload = {"order_uuid": uuid.uuid4().hex, "order_state": "done", "nested": {"a": [1, 2]}}
    event = {
        "event_id": "shape-1",
        "offering_uuid": str(registered.offering),  # dashed in, hex out
        "object_type": "order",
        "payload": payload,
    }
    before = datetime.now(UTC).replace(microsecond=0)
    response = await post_event(client, event, wait=True)
    assert response.json()["deliveries"][0]["state"] == "published"

    (message,) = await drain(registered.vhost, registered.queue_name)
    assert json.loads(message.body) == {
        **payload,
        "offering_uuid": registered.offering.hex,
        "object_type": "order",
    }
    assert message.content_type == "application/json"
    assert message.message_id == "shape-1"
    assert message.type == "order"
    assert message.app_id == "queuekeeper"
    assert message.delivery_mode == 2  # persistent
    assert message.timestamp is not None
    assert before <= message.timestamp.replace(tzinfo=UTC) <= datetime.now(UTC)
    assert message.headers == {
        "offering_uuid": registered.offering.hex,
        "object_type": "order",
        "event_id": "shape-1",
    }


async def test_a_batch_of_1000_is_delivered_once_each(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    events = [order_event(registered.offering, event_id=f"k-{n}") for n in range(1000)]
    response = await post_batch(client, events, wait=True)
    assert response.status_code == 200, response.text
    answers = response.json()["events"]
    assert len(answers) == 1000
    assert all(a["deliveries"][0]["state"] == "published" for a in answers)
    received = [m.message_id for m in await drain(registered.vhost, registered.queue_name)]
    assert sorted(received) == sorted(e["event_id"] for e in events)


@pytest.mark.settings(queue_max_length=1)
async def test_a_full_queue_rejects_and_the_broker_dead_letters(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    rejected_before = DELIVERIES.labels(outcome="rejected")._value.get()
    events = [order_event(registered.offering, event_id=f"full-{n}") for n in range(2)]
    response = await post_batch(client, events, wait=True)
    states = [a["deliveries"][0]["state"] for a in response.json()["events"]]
    assert states == ["published", "rejected"]
    # The relay counts once its settlement is written; the wait may answer in between.
    deadline = asyncio.get_running_loop().time() + 5
    while DELIVERIES.labels(outcome="rejected")._value.get() == rejected_before:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)
    assert DELIVERIES.labels(outcome="rejected")._value.get() == rejected_before + 1
    detail = await event_detail(client, "full-1")
    assert "queue is full" in detail["deliveries"][0]["last_error"]
    assert detail["deliveries"][0]["finished"] is not None

    (dead,) = await drain(registered.vhost, "waldur.dlq.messages")
    assert dead.message_id == "full-1"
    assert dead.headers["x-death"][0]["queue"] == registered.queue_name
    assert [m.message_id for m in await drain(registered.vhost, registered.queue_name)] == [
        "full-0"
    ]


async def _published(client: httpx.AsyncClient, event_id: str) -> dict[str, Any]:
    """The event's one copy, once settled; it must have been published."""
    (copy,) = (await wait_settled(client, event_id))["deliveries"]
    assert copy["state"] == "published", copy
    return cast(dict[str, Any], copy)


@pytest.mark.settings(relay_backoff_base=0.2, publish_timeout=30)
async def test_a_nack_from_a_queue_whose_process_failed_is_retried_not_lost(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    """RabbitMQ nacks a publish whose queue process dies under it (as when the queue's node
    is killed) just as it nacks one that a full queue dead-letters; this one went nowhere."""
    registered = await register(backend)
    nacked_before = DELIVERIES.labels(outcome="nacked")._value.get()
    await on_queue_process(registered.vhost, registered.queue_name, "sys:suspend(P)")
    response = await post_event(client, order_event(registered.offering, event_id="crash-1"))
    assert response.status_code == 202, response.text
    # The relay's publish reaches the stalled queue (in its mailbox) and waits for its confirm.
    # Its message is looked for by its id: a stalled queue also gets timer messages.
    mailbox = (
        'lists:any(fun(M) -> string:find(io_lib:format("~p", [M]), "crash-1") =/= nomatch end, '
        "element(2, erlang:process_info(P, messages)))"
    )
    for _ in range(30):
        if await on_queue_process(registered.vhost, registered.queue_name, mailbox) == "true":
            break
    else:
        raise AssertionError("the relay's publish never reached the queue")
    await on_queue_process(registered.vhost, registered.queue_name, "exit(P, kill)")

    copy = await _published(client, "crash-1")
    assert copy["attempts"] >= 2
    assert "nacked by the broker while the queue was not full" in copy["last_error"]
    assert DELIVERIES.labels(outcome="nacked")._value.get() > nacked_before
    received = await drain(registered.vhost, registered.queue_name)
    assert [m.message_id for m in received] == ["crash-1"]
    assert await drain(registered.vhost, "waldur.dlq.messages") == []


@pytest.mark.settings(queue_max_length=1, queue_overflow="reject-publish", relay_backoff_base=0.2)
async def test_a_full_queue_that_dead_letters_nothing_keeps_the_copy_until_there_is_room(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    events = [order_event(registered.offering, event_id=f"keep-{n}") for n in range(2)]
    response = await post_batch(client, events)
    assert response.status_code == 202, response.text
    assert (await _published(client, "keep-0"))["attempts"] == 1
    deadline = asyncio.get_running_loop().time() + 15
    while not (copy := (await event_detail(client, "keep-1"))["deliveries"][0])["last_error"]:
        assert asyncio.get_running_loop().time() < deadline, copy
        await asyncio.sleep(0.05)
    assert copy["state"] == "pending"
    assert (
        "queue is full (x-overflow reject-publish: nothing was dead-lettered)" in copy["last_error"]
    )

    # The agent consumes; a later attempt gets in (maybe while it drains). Each event once,
    # and nothing went to the dead-letter queue.
    taken = [m.message_id for m in await drain(registered.vhost, registered.queue_name)]
    assert taken[0] == "keep-0"
    await _published(client, "keep-1")
    taken += [m.message_id for m in await drain(registered.vhost, registered.queue_name)]
    assert taken == ["keep-0", "keep-1"]
    assert await drain(registered.vhost, "waldur.dlq.messages") == []


async def _second_of_two_is_dead_lettered(
    client: httpx.AsyncClient,
    registered: Registered,
    prefix: str,
    reason: str = "1 of 1 messages ready",
) -> None:
    """Two events into a queue that holds one: the second is nacked, judged full by the
    limit in force, and dead-lettered."""
    events = [order_event(registered.offering, event_id=f"{prefix}-{n}") for n in range(2)]
    response = await post_batch(client, events, wait=True)
    assert [a["deliveries"][0]["state"] for a in response.json()["events"]] == [
        "published",
        "rejected",
    ]
    detail = await event_detail(client, f"{prefix}-1")
    assert reason in detail["deliveries"][0]["last_error"]
    (dead,) = await drain(registered.vhost, "waldur.dlq.messages")
    assert dead.message_id == f"{prefix}-1"


@pytest.mark.settings(queue_max_length=10, events_wait_timeout=5)
async def test_a_full_queue_is_judged_by_its_own_limit_not_the_configured_one(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    """Raising `queue_max_length` leaves a queue that holds messages on its old limit
    (reconcile repairs only empty ones); when it is full, its nacks are dead letters."""
    registered = await register(backend)
    state: Runtime = app.state.queuekeeper
    older = {**queue_arguments(state.settings), "x-max-length": 1}
    connection = await aio_pika.connect(BROKER.amqp_url(registered.vhost))
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(registered.queue_name)
        await channel.declare_queue(registered.queue_name, durable=True, arguments=older)

    await _second_of_two_is_dead_lettered(client, registered, "old")


@pytest.mark.parametrize(
    ("cap", "reason"),
    [
        ({"max-length": 1}, "1 of 1 messages ready"),
        # One event's body is about 150 bytes: the first fits, the second does not.
        ({"max-length-bytes": 200}, "a limit of 200 bytes"),
    ],
)
@pytest.mark.settings(queue_max_length=10, events_wait_timeout=5)
async def test_a_full_queue_is_judged_by_an_operator_policy_that_caps_it_lower(
    client: httpx.AsyncClient,
    backend: Backend,
    management: ManagementClient,
    cap: dict[str, int],
    reason: str,
) -> None:
    """RabbitMQ applies the lower of a queue's limit and a policy's; a byte limit, whose
    fill is not known exactly, makes a live queue count as full."""
    registered = await register(backend)
    async with httpx.AsyncClient(
        base_url=BROKER.management_url, auth=(BROKER.user, BROKER.password)
    ) as broker:
        response = await broker.put(
            f"/api/operator-policies/{registered.vhost}/cap",
            json={"pattern": ".*", "definition": cap, "apply-to": "queues"},
        )
        assert response.status_code in (201, 204), response.text
    # A policy in force, as an operator sees it: the Management API shows it seconds later.
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        info = await management.get_queue(
            registered.vhost, registered.queue_name, columns="arguments,effective_policy_definition"
        )
        if info is not None and info.effective_policy == cap:
            break
        assert asyncio.get_running_loop().time() < deadline, info
        await asyncio.sleep(0.2)

    await _second_of_two_is_dead_lettered(client, registered, "cap", reason)


@pytest.mark.settings(relay_enabled=False, events_wait_timeout=0.3)
async def test_wait_answers_pending_when_the_wait_limit_passes(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    started = asyncio.get_running_loop().time()
    response = await post_event(client, order_event(registered.offering), wait=True)
    elapsed = asyncio.get_running_loop().time() - started
    assert response.status_code == 200
    assert response.json()["deliveries"] == [
        {
            "queue_name": registered.queue_name,
            "vhost": registered.vhost,
            "state": "pending",
            "reason": "not confirmed by the broker within 0.3 s (QUEUEKEEPER_EVENTS_WAIT_TIMEOUT); "
            "it is stored and will be delivered: follow it with GET "
            "/api/internal/events/{event_id}/",
        }
    ]
    assert 0.3 <= elapsed < 3


@pytest.mark.settings(relay_enabled=False)
async def test_wait_that_ends_pending_says_the_relays_last_error(
    backend: Backend, make_client: Any
) -> None:
    """The broker cannot be reached: the answer says so instead of a bare `pending`."""
    registered = await register(backend)
    port = closed_port()
    unreachable = await make_client(
        relay_enabled=True,
        amqp_url=f"amqp://guest:guest@127.0.0.1:{port}/",
        events_wait_timeout=2.0,
        relay_backoff_base=0.05,
    )
    with capture_logs() as logs:
        response = await post_event(unreachable, order_event(registered.offering), wait=True)
    assert response.status_code == 200
    (copy,) = response.json()["deliveries"]
    assert copy["state"] == "pending"
    assert str(port) in copy["reason"], copy
    # The log names the broker it could not reach, as host:port.
    failed = [entry for entry in logs if entry["event"] == "amqp_connect_failed"]
    assert failed, logs
    assert failed[0]["nodes"] == [f"127.0.0.1:{port}"]


async def test_wait_with_no_recipients_answers_at_once(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    offering = await backend.put_offering()
    response = await post_event(client, order_event(offering), wait=True)
    assert response.status_code == 200
    assert response.json()["queued"] == 0
    assert response.json()["deliveries"] == []


@pytest.mark.settings(relay_enabled=False)
async def test_revoked_access_gives_up_a_waiting_copy(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    registered = await register(backend)
    await post_event(client, order_event(registered.offering, event_id="late"))
    response = await client.delete(
        f"/api/internal/offerings/{registered.offering}/users/{registered.agent.uuid}/",
        headers=backend.headers,
    )
    assert response.status_code == 204
    state: Runtime = app.state.queuekeeper
    relay = Relay(state.settings, state.engine, _NoPublisher(), state.provisioner)  # type: ignore[arg-type]
    # Given up by the revocation itself (docs/decisions/021-authorized-when-published.md):
    # the relay finds nothing left to take.
    assert await relay.run_once() == 0
    (copy,) = (await event_detail(client, "late"))["deliveries"]
    assert copy["state"] == "given_up"
    assert "access to the offering was revoked" in copy["last_error"]
    assert await management.get_queue(registered.vhost, registered.queue_name) is None


class _NoPublisher:
    async def publish(self, *_args: object) -> list[object]:
        raise AssertionError("a copy whose queue is gone must not be published")


@pytest.mark.settings(
    amqp_url=f"amqp://guest:guest@127.0.0.1:{free_port()}/",  # nothing listens there
    delivery_max_age=0.6,
    relay_backoff_base=0.1,
    relay_backoff_max=0.2,
)
async def test_a_copy_is_given_up_after_the_maximum_age(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    """The broker is unreachable (nothing listens on the AMQP port given): retried until too old."""
    registered = await register(backend)
    response = await post_event(client, order_event(registered.offering), wait=True)
    (copy,) = response.json()["deliveries"]
    assert copy["state"] == "given_up"
    detail = await event_detail(client, response.json()["event_id"])
    error = detail["deliveries"][0]["last_error"]
    assert "not confirmed within delivery_max_age (0.6 s)" in error
    assert "last error:" in error
    assert detail["deliveries"][0]["attempts"] >= 2
