"""One vhost's dead-letter queue over AMQP, as a redrive uses it: take its messages one at a
time and hold them unacknowledged, look at the queues they came from, publish a copy back
and confirm it, then acknowledge or return each (deadletters/service.py decides which).

What RabbitMQ and aio-pika say is kept here: a passive declare of a missing queue closes
its channel, a nack of a confirmed publish means the queue refused it (full), a mandatory
publish nobody routed comes back as a return, and aiormq matches a return to its publish
by `message_id`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage
from aio_pika.abc import AbstractQueue as _Queue
from aio_pika.exceptions import ChannelNotFoundEntity, DeliveryError, PublishError

from queuekeeper.broker.amqp import amqp_nodes, amqp_ssl_context, connect_vhost
from queuekeeper.broker.sieve import copy_of
from queuekeeper.config import Settings


class QueueFull(Exception):
    """The queue refused the copy (its length limit, overflow `reject-publish`)."""


class Unroutable(Exception):
    """No queue took the copy: the queue is gone."""


@dataclass(frozen=True, eq=False)
class DeadLetter:
    """A message taken off the dead-letter queue, held unacknowledged until `ack` or
    `give_back` (or the connection's close, which gives it back too)."""

    headers: dict[str, Any]
    message_id: str  # "" when it has none
    timestamp: datetime | None  # when it was first published, when it says
    size: int  # of its body, in bytes
    _message: AbstractIncomingMessage = field(repr=False)

    @classmethod
    def of(cls, message: AbstractIncomingMessage) -> DeadLetter:
        stamp = message.timestamp
        if isinstance(stamp, datetime) and stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=UTC)  # AMQP's timestamp is UTC, read without a zone
        return cls(
            dict(message.headers or {}),
            message.message_id or "",
            stamp if isinstance(stamp, datetime) else None,
            len(message.body),
            message,
        )

    async def ack(self) -> None:
        await self._message.ack()

    async def give_back(self) -> None:
        """Back to the dead-letter queue, in its place."""
        await self._message.nack(requeue=True)


class DeadLetterQueue:
    """The dead-letter queue of one vhost on one connection (`open`)."""

    def __init__(self, connection: AbstractConnection, name: str, timeout: float) -> None:
        self.connection, self.name, self.timeout = connection, name, timeout
        self._probe: AbstractChannel | None = None
        self._publisher: AbstractChannel | None = None
        self._queue: _Queue | None = None

    @classmethod
    @asynccontextmanager
    async def open(cls, settings: Settings, vhost: str) -> AsyncIterator[DeadLetterQueue]:
        connection, _node = await connect_vhost(
            amqp_nodes(settings),
            vhost,
            connect_timeout=settings.management_timeout,
            ssl_context=amqp_ssl_context(settings),
        )
        async with connection:
            yield cls(connection, settings.dlq_name, settings.management_timeout)

    async def depth(self, queue: str | None = None) -> int | None:
        """How many messages `queue` (the dead-letter queue itself by default) holds ready;
        None when it does not exist."""
        if self._probe is None or self._probe.is_closed:
            # Passive declares of missing queues close their channel: they get one of their
            # own, opened again after each.
            self._probe = await self.connection.channel(publisher_confirms=False)
        try:
            declared = await self._probe.declare_queue(queue or self.name, passive=True)
        except ChannelNotFoundEntity:
            self._probe = None
            return None
        return declared.declaration_result.message_count or 0

    async def take(self) -> DeadLetter | None:
        """The next dead letter, held unacknowledged; None when no more is ready (another
        reader may hold the rest unacknowledged)."""
        if self._queue is None:
            self._queue = await (await self._channel()).get_queue(self.name, ensure=False)
        message = await self._queue.get(no_ack=False, fail=False, timeout=self.timeout)
        return DeadLetter.of(message) if message is not None else None

    async def publish(
        self, copies: Sequence[tuple[DeadLetter, str, dict[str, Any]]]
    ) -> list[BaseException | None]:
        """Publish a copy of each dead letter to its queue, with its headers, persistent and
        mandatory, and wait for the confirms; per copy, None when confirmed, else `QueueFull`,
        `Unroutable` or what else went wrong. In order, in rounds: a copy whose `message_id`
        its round already holds starts the next, since aiormq books a return by the id and two
        in flight could book it against the wrong one."""
        channel = await self._channel()
        results: list[BaseException | None] = [None] * len(copies)
        rounds: list[list[int]] = []
        ids: set[str] = set()
        for position, (letter, _queue, _headers) in enumerate(copies):
            if not rounds or (letter.message_id and letter.message_id in ids):
                rounds.append([])
                ids = set()
            rounds[-1].append(position)
            ids.add(letter.message_id)
        for members in rounds:
            answers = await asyncio.gather(
                *(self._publish_one(channel, *copies[position]) for position in members),
                return_exceptions=True,
            )
            for position, answer in zip(members, answers, strict=True):
                results[position] = answer
        return results

    async def _publish_one(
        self, channel: AbstractChannel, letter: DeadLetter, queue: str, headers: dict[str, Any]
    ) -> None:
        try:
            await channel.default_exchange.publish(
                copy_of(letter._message, headers),
                routing_key=queue,
                mandatory=True,
                timeout=self.timeout,
            )
        except PublishError as exc:  # a subclass of DeliveryError: test it first
            raise Unroutable(f"no queue {queue!r} took it") from exc
        except DeliveryError as exc:
            raise QueueFull(f"queue {queue!r} refused it") from exc

    async def _channel(self) -> AbstractChannel:
        if self._publisher is None:
            self._publisher = await self.connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
        return self._publisher
