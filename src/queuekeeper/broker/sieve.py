"""Taking one offering's copies out of a consumer's queue, keeping the rest
(docs/decisions/003-revoked-scope-copies.md).

A consumer bound to several offerings has one queue for all of them; when the owner's
grant of one offering is revoked, that offering's copies already queued must not reach
the agent. AMQP cannot remove chosen messages from a queue, so the queue is read once
through: each message (basic.get) is either dropped (its `offering_uuid` header names
the offering) or published again to the same queue and confirmed, and only then acked.
A failure leaves the message unacked, so the broker puts it back: nothing else is lost.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from queuekeeper.broker.amqp import amqp_nodes, amqp_ssl_context, connect_vhost
from queuekeeper.config import Settings

# Set on every copy by the relay (events/relay.event_message).
OFFERING_HEADER = "offering_uuid"


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


async def remove_offering_copies(
    settings: Settings, vhost: str, queue: str, offering_uuids: Collection[uuid.UUID]
) -> Sieved:
    """Read `queue` once through, dropping the copies of `offering_uuids` and publishing the
    others again (to its tail, confirmed). The caller makes sure nobody else consumes the
    queue meanwhile: a message another consumer holds unacked is not seen."""
    offerings = {offering.hex for offering in offering_uuids}
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
        for _ in range(int(declared.declaration_result.message_count or 0)):
            message = await declared.get(fail=False, no_ack=False, timeout=timeout)
            if message is None:
                break
            headers = dict(message.headers or {})
            if str(headers.get(OFFERING_HEADER) or "") in offerings:
                await message.ack()
                removed += 1
                continue
            await channel.default_exchange.publish(
                copy_of(message, headers), routing_key=queue, mandatory=True, timeout=timeout
            )
            await message.ack()  # only now: the copy is confirmed in the queue
            kept += 1
    return Sieved(kept, removed)
