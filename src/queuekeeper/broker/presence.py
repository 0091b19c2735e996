"""Who reads a queue, as the broker knows it: the event exchange's consumer events, and the
exact consumer count of a passive declare (docs/decisions/014-presence.md).

RabbitMQ's `rabbitmq_event_exchange` plugin publishes every `consumer.created` and
`consumer.deleted` (also when a connection dies) to the topic exchange
`amq.rabbitmq.event` in vhost `/`, the event's fields as message headers (`vhost`,
`queue`, `consumer_tag`, `timestamp_in_ms`, ...), within milliseconds. Each replica
reads them on an exclusive, auto-deleted, server-named queue of its own, so every replica
sees every event; what they write is the same absolute count (see presence/service.py),
so it does not matter how many do.

An event says that *a* consumer came or went, not how many remain: the count comes from
a passive `queue.declare`, which the queue answers itself, at once (the Management API's
counts are statistics, seconds behind).

This module is the only one that knows these names and headers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime

import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from queuekeeper.broker.amqp import (
    CONNECT_ERRORS,
    amqp_nodes,
    amqp_ssl_context,
    connect_vhost,
    describe,
)
from queuekeeper.common.tasks import cancel_within
from queuekeeper.config import Settings

log = structlog.get_logger(__name__)

EVENT_EXCHANGE = "amq.rabbitmq.event"
EVENT_VHOST = "/"  # where the plugin declares its exchange (its default)
ROUTING_KEYS = ("consumer.created", "consumer.deleted")
RETRY_SECONDS = (1, 2, 5, 10, 30)
STOP_SECONDS = 5.0  # the most a stop or a close waits on the broker


@dataclass(frozen=True)
class ConsumerEvent:
    """A consumer came (`arrived`) or went on `queue` of `vhost`, at `at`."""

    vhost: str
    queue: str
    arrived: bool
    at: datetime

    @classmethod
    def parse(cls, routing_key: str, headers: dict[str, object]) -> ConsumerEvent | None:
        """None for anything but a consumer event naming its vhost and queue."""
        if routing_key not in ROUTING_KEYS:
            return None
        vhost, queue = _text(headers.get("vhost")), _text(headers.get("queue"))
        if not vhost or not queue:
            return None
        stamp = headers.get("timestamp_in_ms")
        at = (
            datetime.fromtimestamp(stamp / 1000, UTC)
            if isinstance(stamp, int) and not isinstance(stamp, bool)
            else datetime.now(UTC)
        )
        return cls(vhost, queue, routing_key == "consumer.created", at)


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


Handler = Callable[[ConsumerEvent], Awaitable[None]]


class PresenceListener:
    """Reads the consumer events of the whole broker and hands each to `handler`.

    Reconnects on its own (from 1 s up to 30 s apart) when the broker goes away or the
    plugin is not enabled yet; what happened meanwhile is repaired by the periodic check
    (the `presence` job). `handler` must not raise; it is awaited in order, one at a time.
    """

    def __init__(self, settings: Settings, handler: Handler) -> None:
        self.settings = settings
        self.handler = handler
        self.connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="presence-listener")

    async def stop(self) -> None:
        if self._task is not None:
            # A stop that lands while the connection is being opened or closed must not wait
            # on the broker's answer.
            await cancel_within(self._task, STOP_SECONDS)
            self._task = None

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                await self._listen()
                failures = 0  # the connection was up, then closed: start the back-off anew
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure is a retry; never end the task
                log.warning(
                    "presence_listener_down",
                    error=describe(exc),
                    detail="consumer arrivals and departures are learnt only by the periodic "
                    "check until it reconnects; is the rabbitmq_event_exchange plugin enabled?",
                )
            self.connected.clear()
            await asyncio.sleep(RETRY_SECONDS[min(failures, len(RETRY_SECONDS) - 1)])
            failures += 1

    async def _listen(self) -> None:
        connection, node = await connect_vhost(
            amqp_nodes(self.settings),
            EVENT_VHOST,
            connect_timeout=self.settings.amqp_connect_timeout,
            ssl_context=amqp_ssl_context(self.settings),
        )
        closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_close(*_: object) -> None:
            if not closed.done():
                closed.set_result(None)

        connection.close_callbacks.add(on_close)
        try:
            channel = await connection.channel()
            channel.close_callbacks.add(on_close)
            queue = await channel.declare_queue("", exclusive=True, auto_delete=True)
            for key in ROUTING_KEYS:
                await queue.bind(EVENT_EXCHANGE, key)
            await queue.consume(self._on_message, no_ack=True)
            self.connected.set()
            log.info("presence_listener_up", node=node, exchange=EVENT_EXCHANGE)
            await closed
        finally:
            with contextlib.suppress(*CONNECT_ERRORS, TimeoutError):
                await asyncio.wait_for(connection.close(), STOP_SECONDS)

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        event = ConsumerEvent.parse(message.routing_key or "", dict(message.headers or {}))
        if event is not None:
            await self.handler(event)


async def consumer_counts(
    settings: Settings, vhost: str, queues: Collection[str]
) -> dict[str, int | None]:
    """Each queue's consumers now, by a passive declare on one connection to `vhost`;
    None for a queue that is not there (or cannot be read). Raises when the vhost cannot be
    reached at all."""
    connection: AbstractConnection
    connection, _node = await connect_vhost(
        amqp_nodes(settings),
        vhost,
        connect_timeout=settings.amqp_connect_timeout,
        ssl_context=amqp_ssl_context(settings),
    )
    counts: dict[str, int | None] = {}
    try:
        channel: AbstractChannel | None = None
        for name in queues:
            try:
                if channel is None or channel.is_closed:
                    # A missing queue closes the channel it was asked on: a new one per miss.
                    channel = await connection.channel(publisher_confirms=False)
                declared = await channel.declare_queue(name, passive=True)
                counts[name] = declared.declaration_result.consumer_count
            except CONNECT_ERRORS as exc:
                if connection.is_closed:
                    raise
                log.debug("queue_not_declared", vhost=vhost, queue=name, error=describe(exc))
                counts[name] = None
    finally:
        with contextlib.suppress(*CONNECT_ERRORS):
            await connection.close()
    return counts
