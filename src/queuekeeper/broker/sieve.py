"""Taking chosen copies out of a queue, keeping the rest
(docs/decisions/003-revoked-scope-copies.md,
docs/decisions/030-queued-copies-on-every-access-loss.md).

A consumer has one queue for every entity it binds; when its owner loses the right to some
of them (or to everything), their copies already queued must not reach the agent. AMQP
cannot remove chosen messages from a queue, so the queue is read once through, a batch at a
time: the caller judges each batch (by the copies' event and offering), and each message is
either dropped or published again to the same queue and confirmed, and only then acked. A
failure leaves the messages unacked, so the broker puts them back: nothing else is lost.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from queuekeeper.broker.amqp import amqp_nodes, amqp_ssl_context, connect_vhost
from queuekeeper.config import Settings

# Set on every copy by the relay (events/relay.event_message).
OFFERING_HEADER = "offering_uuid"
EVENT_HEADER = "event_id"
# Messages held unacked while their batch is judged.
BATCH = 100


def copy_of(message: AbstractIncomingMessage, headers: dict[str, Any]) -> aio_pika.Message:
    """A message to publish again as it was received, with `headers`, persistent."""
    return aio_pika.Message(
        body=message.body,
        headers=headers,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=message.priority,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        # aio-pika matches a mandatory return to its publish by message_id.
        message_id=message.message_id or f"queuekeeper-copy-{uuid.uuid4().hex}",
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
    )


@dataclass(frozen=True)
class Sieved:
    kept: int
    removed: int


@dataclass(frozen=True)
class QueuedCopy:
    """A message of the queue as the judge sees it: the event it is a copy of and the
    offering it was published for (None when its headers do not say)."""

    event_id: str | None
    offering_uuid: str | None  # hex

    @classmethod
    def of(cls, message: AbstractIncomingMessage) -> QueuedCopy:
        headers = dict(message.headers or {})
        event = headers.get(EVENT_HEADER) or message.message_id
        offering = headers.get(OFFERING_HEADER)
        return cls(str(event) if event else None, str(offering) if offering else None)


# Given a batch of copies, the positions of those to remove.
Judge = Callable[[Sequence[QueuedCopy]], Awaitable[Collection[int]]]


async def remove_copies(settings: Settings, vhost: str, queue: str, judge: Judge) -> Sieved:
    """Read `queue` once through, BATCH messages at a time, dropping those `judge` names and
    publishing the others again (to its tail, confirmed). The caller makes sure nobody else
    consumes the queue meanwhile: a message another consumer holds unacked is not seen."""
    timeout = settings.management_timeout
    connection, _node = await connect_vhost(
        amqp_nodes(settings), vhost, connect_timeout=timeout, ssl_context=amqp_ssl_context(settings)
    )
    kept = removed = 0
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        declared = await channel.declare_queue(queue, passive=True)
        # The closed connections' consumers go a moment after the close: once they have, what
        # they held unacked is back in the queue and counted.
        deadline = asyncio.get_running_loop().time() + timeout
        while declared.declaration_result.consumer_count:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"queue {queue!r} still has consumers")
            await asyncio.sleep(0.05)
            declared = await channel.declare_queue(queue, passive=True)
        # Only what was there when we started: what we publish again goes behind it.
        left = int(declared.declaration_result.message_count or 0)
        while left > 0:
            batch: list[AbstractIncomingMessage] = []
            while len(batch) < min(left, BATCH):
                message = await declared.get(fail=False, no_ack=False, timeout=timeout)
                if message is None:
                    break
                batch.append(message)
            left = 0 if len(batch) < min(left, BATCH) else left - len(batch)
            unwanted = await judge([QueuedCopy.of(message) for message in batch])
            for position, message in enumerate(batch):
                if position in unwanted:
                    await message.ack()
                    removed += 1
                    continue
                await channel.default_exchange.publish(
                    copy_of(message, dict(message.headers or {})),
                    routing_key=queue,
                    mandatory=True,
                    timeout=timeout,
                )
                await message.ack()  # only now: the copy is confirmed in the queue
                kept += 1
    return Sieved(kept, removed)
