"""The AMQP publisher against the real broker: outcomes, the bounded pool, reconnects."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime

import aio_pika
import aiormq
import pytest
from aio_pika.abc import HeadersType
from pamqp.header import ContentHeader

from queuekeeper.broker import publisher as publisher_module
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.broker.publisher import AmqpPublisher, Outgoing, json_message
from queuekeeper.broker.verdict import Outcome
from queuekeeper.config import Settings
from queuekeeper.observability.metrics import AMQP_POOL_SIZE, AMQP_RECONNECTS
from tests.proxy import TcpProxy, free_port

QUEUE = "subscription_publisher_test"


@pytest.fixture
def provisioner(settings: Settings, clean_state: None, management: ManagementClient) -> Provisioner:
    """Vhosts made with it carry the test's tag, so clean_state removes them afterwards."""
    return Provisioner(management, settings, uuid.uuid4())


async def _vhost_with_queue(provisioner: Provisioner, *queues: str) -> str:
    vhost = uuid.uuid4().hex
    await provisioner.ensure_vhost(vhost)
    for queue in queues or (QUEUE,):
        await provisioner.ensure_queue(vhost, queue)
    return vhost


def _message(queue: str, message_id: str) -> Outgoing:
    return json_message(queue, b"{}", message_id=message_id, headers={})


def test_a_json_message_carries_on_the_wire_what_aio_pikas_message_carried() -> None:
    """`json_message` builds the properties without an `aio_pika.Message`: the frame that
    carries them is byte for byte the one such a message made (consumers see no change)."""
    accepted = datetime(2026, 12, 7, 12, 30, 15, tzinfo=UTC)
    headers: HeadersType = {"offering_uuid": uuid.uuid4().hex, "object_type": "order"}
    ours = json_message(
        QUEUE, b"{}", message_id="e-1", headers=headers, timestamp=accepted, message_type="order"
    )
    theirs = aio_pika.Message(
        b"{}",
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id="e-1",
        timestamp=accepted,
        type="order",
        app_id="queuekeeper",
        headers=headers,
    )

    def frame(properties: aiormq.spec.Basic.Properties) -> bytes:
        return ContentHeader(properties=properties, body_size=2).marshal()

    assert frame(ours.properties) == frame(theirs.properties)
    assert (ours.routing_key, ours.body, ours.message_id) == (QUEUE, b"{}", "e-1")


async def test_outcomes_confirmed_rejected_returned(
    settings: Settings, provisioner: Provisioner
) -> None:
    settings = settings.model_copy(update={"queue_max_length": 1})
    vhost = await _vhost_with_queue(
        Provisioner(provisioner.management, settings, provisioner.installation)
    )
    publisher = AmqpPublisher(settings)
    try:
        results = await publisher.publish(
            vhost,
            [
                _message(QUEUE, "a"),
                _message(QUEUE, "b"),  # the queue holds one: nacked
                _message("subscription_missing", "c"),  # no such queue: returned
            ],
        )
    finally:
        await publisher.close()
    assert [r.outcome for r in results] == [Outcome.CONFIRMED, Outcome.REJECTED, Outcome.RETURNED]
    assert "NO_ROUTE" in (results[2].error or "")


async def test_a_nack_is_judged_by_the_queue_on_the_broker_and_kept_when_it_cannot_be(
    settings: Settings, provisioner: Provisioner
) -> None:
    """Full by the queue's own limit (1, where the setting says 10): dead-lettered. With the
    Management API unreachable the nack cannot be judged: the copy is kept for a retry, and
    the batch's other outcomes stand."""
    one = settings.model_copy(update={"queue_max_length": 1})
    vhost = await _vhost_with_queue(
        Provisioner(provisioner.management, one, provisioner.installation)
    )
    ten = settings.model_copy(update={"queue_max_length": 10})
    down = settings.model_copy(update={"management_url": f"http://127.0.0.1:{free_port()}"})
    outcomes = {}
    for name, management in (("read", ManagementClient(ten)), ("down", ManagementClient(down))):
        publisher = AmqpPublisher(ten, management)
        try:
            outcomes[name] = await publisher.publish(
                vhost,
                [
                    _message(QUEUE, f"{name}-1"),  # fills the queue, or finds it full
                    _message(QUEUE, f"{name}-2"),  # nacked: the queue holds one
                    _message("subscription_missing", f"{name}-3"),
                ],
            )
        finally:
            await publisher.close()
            await management.aclose()
    read, down_ = outcomes["read"], outcomes["down"]
    assert [r.outcome for r in read] == [Outcome.CONFIRMED, Outcome.REJECTED, Outcome.RETURNED]
    assert "1 of 1 messages ready" in (read[1].error or "")
    assert [r.outcome for r in down_] == [Outcome.REFUSED, Outcome.REFUSED, Outcome.RETURNED]
    assert "could not be told (BrokerUnavailable)" in (down_[1].error or ""), down_


@pytest.mark.parametrize("channels", [64, 2])
async def test_copies_of_one_event_in_one_vhost_are_told_apart(
    settings: Settings,
    provisioner: Provisioner,
    monkeypatch: pytest.MonkeyPatch,
    channels: int,
) -> None:
    """Same message_id to several queues of one vhost at once, one of them missing: only
    that copy is returned, every other one confirmed (aiormq matches returns by message_id).
    With fewer channels than queues, queues share channels but never one message_id."""
    monkeypatch.setattr(publisher_module, "MAX_CHANNELS_PER_CONNECTION", channels)
    queues = [f"{QUEUE}_{n}" for n in range(4)]
    vhost = await _vhost_with_queue(provisioner, *queues)
    publisher = AmqpPublisher(settings)
    try:
        for missing in range(len(queues) + 1):
            names = [q if n != missing else "subscription_gone" for n, q in enumerate(queues)]
            results = await publisher.publish(
                vhost, [_message(name, "same-event") for name in names]
            )
            expected = [
                Outcome.RETURNED if n == missing else Outcome.CONFIRMED for n in range(len(names))
            ]
            assert [r.outcome for r in results] == expected
        assert len(publisher._pool[vhost].channels) == min(channels, len(queues) + 1)
    finally:
        await publisher.close()


async def test_unreachable_broker_and_refused_vhost(
    settings: Settings, provisioner: Provisioner
) -> None:
    down = AmqpPublisher(
        settings.model_copy(update={"amqp_url": f"amqp://guest:guest@127.0.0.1:{free_port()}/"})
    )
    results = await down.publish("any", [_message(QUEUE, "x")])
    assert results[0].outcome is Outcome.UNREACHABLE
    assert down.open_connections == 0
    await down.close()

    publisher = AmqpPublisher(settings)
    try:
        results = await publisher.publish(uuid.uuid4().hex, [_message(QUEUE, "y")])
    finally:
        await publisher.close()
    assert results[0].outcome is Outcome.VHOST_REFUSED


async def test_the_pool_is_bounded_and_closes_the_least_recently_used(
    settings: Settings, provisioner: Provisioner
) -> None:
    vhosts = [await _vhost_with_queue(provisioner) for _ in range(3)]
    publisher = AmqpPublisher(settings.model_copy(update={"amqp_pool_size": 2}))
    try:
        for vhost in vhosts[:2]:
            await publisher.publish(vhost, [_message(QUEUE, "1")])
        await publisher.publish(vhosts[0], [_message(QUEUE, "2")])  # 0 is now fresher
        await publisher.publish(vhosts[2], [_message(QUEUE, "3")])
        assert list(publisher._pool) == [vhosts[0], vhosts[2]]
        assert AMQP_POOL_SIZE._value.get() == 2
        results = await publisher.publish(vhosts[1], [_message(QUEUE, "4")])
        assert results[0].outcome is Outcome.CONFIRMED
        assert list(publisher._pool) == [vhosts[2], vhosts[1]]

        # Connections unused for amqp_idle_seconds are closed.
        idle_later = time.monotonic() + settings.amqp_idle_seconds + 1
        assert await publisher.close_idle(now=idle_later) == 2
        assert publisher.open_connections == 0
    finally:
        await publisher.close()


async def test_a_lost_connection_is_reopened(settings: Settings, provisioner: Provisioner) -> None:
    vhost = await _vhost_with_queue(provisioner)
    proxy = TcpProxy()
    proxy.start()
    publisher = AmqpPublisher(settings.model_copy(update={"amqp_url": proxy.amqp_url()}))
    try:
        first = await publisher.publish(vhost, [_message(QUEUE, "before")])
        assert first[0].outcome is Outcome.CONFIRMED
        before = AMQP_RECONNECTS._value.get()
        proxy.sever()
        outcomes = []
        for attempt in range(50):
            results = await publisher.publish(vhost, [_message(QUEUE, f"after-{attempt}")])
            outcomes.append(results[0].outcome)
            if results[0].outcome is Outcome.CONFIRMED:
                break
            await asyncio.sleep(0.05)
        assert outcomes[-1] is Outcome.CONFIRMED
        assert AMQP_RECONNECTS._value.get() == before + 1
        assert proxy.accepted == 2
    finally:
        await publisher.close()
        proxy.close()


async def test_confirms_are_awaited_together_not_one_round_trip_each(
    settings: Settings, provisioner: Provisioner
) -> None:
    """Through a link that delays every chunk from the broker by 50 ms, 100 publishes done one
    round trip at a time would take at least 5 s."""
    vhost = await _vhost_with_queue(provisioner)
    proxy = TcpProxy(delay=0.05)
    proxy.start()
    publisher = AmqpPublisher(settings.model_copy(update={"amqp_url": proxy.amqp_url()}))
    try:
        await publisher.publish(vhost, [_message(QUEUE, "warm-up")])
        started = time.perf_counter()
        results = await publisher.publish(vhost, [_message(QUEUE, f"m-{n}") for n in range(100)])
        elapsed = time.perf_counter() - started
    finally:
        await publisher.close()
        proxy.close()
    assert {r.outcome for r in results} == {Outcome.CONFIRMED}
    assert elapsed < 1.5, elapsed


def test_vhost_urls_keep_credentials_and_options(settings: Settings) -> None:
    publisher = AmqpPublisher(
        settings.model_copy(
            update={"amqp_url": "amqps://qk:p%40ss@broker.example:5671/?heartbeat=30"}
        )
    )
    assert publisher.url("0f" * 16) == (
        f"amqps://qk:p%40ss@broker.example:5671/{'0f' * 16}?heartbeat=30"
    )
