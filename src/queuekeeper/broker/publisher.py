"""AMQP publishing with publisher confirms: one connection per vhost from a bounded pool.

Each publish is `mandatory` and persistent and waits for the broker's confirm,
but publishes are issued concurrently, so a batch keeps many confirms in flight
on one channel instead of paying one round trip per message.

Why a channel per queue: aiormq matches a `basic.return` to its publish by
`message_id`. Every copy of an event carries the event id as its `message_id`,
and two copies may go to two queues in the same vhost (one user, several
subscriptions); in flight on one channel, a return for one copy would be booked
against the other. So each queue of a vhost gets a channel of its own (up to
MAX_CHANNELS_PER_CONNECTION; past that, any channel without that `message_id`
in flight), and one channel per queue also keeps each queue's messages in the
order they were published.

What a nack means is not decided here: the transport reports it, and `broker/verdict.py`
judges it by the queue's arguments and policy, once per queue after the batch's confirms
are in; only the queue's ready messages (a passive declare) are read through this
transport.

Reconnects are our own, not aio-pika's robust connection: a publish that fails
because the connection dropped is reported as `UNREACHABLE`, the outbox relay
retries it later, and the next use of the vhost opens a fresh connection, on the
first node of the configured list that answers (`broker/nodes.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, HeadersType
from aio_pika.exceptions import DeliveryError, PublishError

from queuekeeper.broker.amqp import (
    CONNECT_ERRORS,
    amqp_nodes,
    amqp_ssl_context,
    connect_vhost,
    describe,
    vhost_refused,
    vhost_url,
)
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.nodes import NodeList, node_label
from queuekeeper.broker.verdict import NACKED, NackVerdict, Outcome, Result
from queuekeeper.config import Settings
from queuekeeper.observability.metrics import AMQP_POOL_SIZE, AMQP_RECONNECTS, CONFIRM_LATENCY

log = structlog.get_logger(__name__)

# Queues of one vhost with a channel each; more share channels (never one message_id twice).
MAX_CHANNELS_PER_CONNECTION = 64


# Who sent a message (its `app_id` property), for consumers and the broker's own tools.
APP_ID = "queuekeeper"


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message for one queue, through the default exchange: its body and its AMQP
    properties, as `json_message` builds them."""

    routing_key: str
    body: bytes
    properties: aiormq.spec.Basic.Properties

    @property
    def message_id(self) -> str:
        return self.properties.message_id or ""


def json_message(
    routing_key: str,
    body: bytes,
    *,
    message_id: str,
    headers: HeadersType,
    timestamp: datetime | None = None,
    message_type: str | None = None,
) -> Outgoing:
    """A persistent JSON message from queuekeeper. Its properties are what an
    `aio_pika.Message` with these values sends (priority 0 included), made without one:
    that object checks each attribute it is given, about 10 µs of CPU per message
    (docs/decisions/017-single-event-cost.md)."""
    return Outgoing(
        routing_key,
        body,
        aiormq.spec.Basic.Properties(
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT.value,
            priority=0,
            message_id=message_id,
            timestamp=timestamp,
            message_type=message_type,
            app_id=APP_ID,
            headers=headers,
        ),
    )


@dataclass
class _Channel:
    channel: AbstractChannel
    in_flight: set[str] = field(default_factory=set)


class _VhostConnection:
    def __init__(self, vhost: str) -> None:
        self.vhost = vhost
        self.connection: AbstractConnection | None = None
        self.node: str | None = None  # the node URL it is connected to
        self.channels: list[_Channel] = []
        self.by_key: dict[str, _Channel] = {}
        self.users = 0
        self.last_used = time.monotonic()
        self.lock = asyncio.Lock()
        self.released = asyncio.Condition()
        self.waiting = 0

    @property
    def broken(self) -> bool:
        # aio-pika's is_closed only turns true on a close *we* asked for; a connection the
        # broker or the network dropped shows as no longer `connected`.
        connection = self.connection
        return connection is not None and (
            connection.is_closed or not connection.connected.is_set()
        )

    async def connect(
        self, nodes: NodeList, connect_timeout: float, ssl_context: ssl.SSLContext | None
    ) -> None:
        async with self.lock:
            if self.connection is not None:
                return
            self.connection, self.node = await connect_vhost(
                nodes, self.vhost, connect_timeout=connect_timeout, ssl_context=ssl_context
            )

    async def channel_for(self, routing_key: str, message_id: str) -> _Channel:
        """The queue's own channel, unless that one has this message_id in flight."""
        while True:
            if self.connection is None or self.broken:
                raise aiormq.exceptions.ChannelInvalidStateError("connection lost")
            self.channels = [ch for ch in self.channels if not ch.channel.is_closed]
            own = self.by_key.get(routing_key)
            if own is not None and not own.channel.is_closed:
                if message_id not in own.in_flight:
                    own.in_flight.add(message_id)
                    return own
            elif len(self.channels) < MAX_CHANNELS_PER_CONNECTION:
                async with self.lock:  # one opening at a time; a concurrent one may have won
                    current = self.by_key.get(routing_key)
                    room = len(self.channels) < MAX_CHANNELS_PER_CONNECTION
                    if room and (current is None or current.channel.is_closed):
                        if self.connection is None or self.broken:
                            raise aiormq.exceptions.ChannelInvalidStateError("connection lost")
                        opened = await self.connection.channel(
                            publisher_confirms=True, on_return_raises=True
                        )
                        self.by_key[routing_key] = _Channel(opened)
                        self.channels.append(self.by_key[routing_key])
                continue
            else:  # more queues than channels: share, but never one message_id twice
                for candidate in self.channels:
                    if not candidate.channel.is_closed and message_id not in candidate.in_flight:
                        candidate.in_flight.add(message_id)
                        return candidate
            self.waiting += 1
            try:
                async with self.released:
                    await self.released.wait()
            finally:
                self.waiting -= 1

    async def ready_messages(self, queue: str) -> int | None:
        """The queue's ready messages now, by a passive declare on a channel of its own (a
        missing or unavailable queue closes that channel, not one with publishes in flight);
        None when the queue cannot be read: gone, or its node down."""
        connection = self.connection
        if connection is None or self.broken:
            return None
        channel: AbstractChannel | None = None
        try:
            channel = await connection.channel(publisher_confirms=False)
            declared = await channel.declare_queue(queue, passive=True)
            return declared.declaration_result.message_count
        except CONNECT_ERRORS as exc:
            log.info("queue_not_readable", vhost=self.vhost, queue=queue, error=describe(exc))
            return None
        finally:
            if channel is not None and not channel.is_closed:
                with contextlib.suppress(*CONNECT_ERRORS):
                    await channel.close()

    async def release(self, channel: _Channel, message_id: str) -> None:
        channel.in_flight.discard(message_id)
        if self.waiting:
            async with self.released:
                self.released.notify_all()

    async def close(self) -> None:
        connection, self.connection, self.channels = self.connection, None, []
        self.by_key = {}
        if connection is not None and not connection.is_closed:
            try:
                await asyncio.wait_for(connection.close(), timeout=5)
            except Exception as exc:  # closing a dead connection may fail; it is gone either way
                log.debug("amqp_close_failed", vhost=self.vhost, error=repr(exc))


class AmqpPublisher:
    """Publishes to per-vhost connections; at most `amqp_pool_size` are open at once."""

    def __init__(self, settings: Settings, management: ManagementClient | None = None) -> None:
        self.settings = settings
        self.verdict = NackVerdict(settings, management)
        self._ssl = amqp_ssl_context(settings)
        self.nodes = amqp_nodes(settings)
        self._pool: OrderedDict[str, _VhostConnection] = OrderedDict()
        # Bounds the connections in use at once, so making room always finds an idle one.
        self._slots = asyncio.Semaphore(settings.amqp_pool_size)
        self._lost: set[str] = set()
        self._closed = False
        self._probes: dict[str, AbstractConnection] = {}  # node URL -> its probe connection
        # One lock per node: a node that hangs must not hold up the probes of the others.
        self._probe_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def url(self, vhost: str) -> str:
        """The URL `vhost` is opened with on the first configured node."""
        return vhost_url(self.nodes.urls[0], vhost)

    @property
    def open_connections(self) -> int:
        return len(self._pool)

    async def publish(self, vhost: str, items: Sequence[Outgoing]) -> list[Result]:
        """Publish every item to `vhost` (confirms in flight together); one result per item."""
        if not items:
            return []
        try:
            async with self._use(vhost) as entry:
                if len(items) == 1:  # a single event's copy: no task to run it
                    results = [await self._publish_one(entry, items[0])]
                else:
                    results = await asyncio.gather(
                        *(self._publish_one(entry, item) for item in items)
                    )
                if any(result is NACKED for result in results):
                    queues = [item.routing_key for item in items]
                    results = await self.verdict.judge(vhost, queues, results, entry.ready_messages)
        except CONNECT_ERRORS as exc:
            if vhost_refused(exc):
                return [Result(Outcome.VHOST_REFUSED, describe(exc))] * len(items)
            log.warning(
                "amqp_connect_failed",
                vhost=vhost,
                # Which broker it could not reach, whatever the error's own words say.
                nodes=[node_label(url) for url in self.nodes.urls],
                error=describe(exc),
            )
            return [Result(Outcome.UNREACHABLE, describe(exc))] * len(items)
        return list(results)

    async def queue_ready(self, vhost: str, queue: str) -> int | None:
        """The queue's ready messages now, exactly (a passive declare, not the Management
        API's lagging figure); None when it cannot be read (gone, node down, no broker)."""
        try:
            async with self._use(vhost) as entry:
                return await entry.ready_messages(queue)
        except CONNECT_ERRORS as exc:
            log.info("queue_not_readable", vhost=vhost, queue=queue, error=describe(exc))
            return None

    async def _publish_one(self, entry: _VhostConnection, item: Outgoing) -> Result:
        message_id = item.message_id
        try:
            channel = await entry.channel_for(item.routing_key, message_id)
        except CONNECT_ERRORS as exc:
            # RuntimeError: aio-pika's "connection closed" (ChannelInvalidStateError included)
            return Result(Outcome.UNREACHABLE, describe(exc))
        started = time.perf_counter()
        try:
            # On aiormq's channel, as aio-pika's default exchange would publish: it adds
            # only checks of its own objects (decision 017).
            underlay = await channel.channel.get_underlay_channel()
            await underlay.basic_publish(
                item.body,
                routing_key=item.routing_key,
                properties=item.properties,
                mandatory=True,
                timeout=self.settings.publish_timeout,
            )
        except PublishError as exc:  # a subclass of DeliveryError: test it first
            reply = getattr(exc.frame, "reply_text", "")
            return Result(Outcome.RETURNED, f"returned by the broker as unroutable ({reply})")
        except DeliveryError:
            return NACKED
        except TimeoutError:
            return Result(
                Outcome.UNREACHABLE,
                f"no confirm within {self.settings.publish_timeout:g} s",
            )
        except (aiormq.exceptions.AMQPError, RuntimeError, OSError) as exc:
            return Result(Outcome.UNREACHABLE, describe(exc))
        finally:
            await entry.release(channel, message_id)
        CONFIRM_LATENCY.observe(time.perf_counter() - started)
        return Result(Outcome.CONFIRMED)

    @asynccontextmanager
    async def _use(self, vhost: str) -> AsyncIterator[_VhostConnection]:
        if self._closed:
            raise aiormq.exceptions.ChannelInvalidStateError("publisher closed")
        async with self._slots:
            entry = self._pool.get(vhost)
            if entry is not None and entry.broken:
                self._lost.add(vhost)
                await self._drop(entry)
                entry = None
            elif entry is not None and entry.users == 0 and self._moved_back(entry):
                await self._drop(entry)
                entry = None
            if entry is None:
                await self._make_room()
                entry = _VhostConnection(vhost)
                self._pool[vhost] = entry
                AMQP_POOL_SIZE.set(len(self._pool))
            self._pool.move_to_end(vhost)
            entry.users += 1
            try:
                if entry.connection is None:
                    await entry.connect(self.nodes, self.settings.amqp_connect_timeout, self._ssl)
                    if vhost in self._lost:
                        self._lost.discard(vhost)
                        AMQP_RECONNECTS.inc()
                        log.info("amqp_reconnected", vhost=vhost)
                yield entry
            except BaseException:
                if entry.connection is None or entry.broken:
                    self._lost.add(vhost)
                    await self._drop(entry)
                raise
            finally:
                entry.users -= 1
                entry.last_used = time.monotonic()
            if entry.broken:
                self._lost.add(vhost)
                await self._drop(entry)

    def _moved_back(self, entry: _VhostConnection) -> bool:
        """An idle connection that failed over, once a node listed before its own answers
        again: closed, so the next use reconnects there (back to the configured spread)."""
        node = entry.node
        if node is None or len(self.nodes) == 1:
            return False
        preferred = self.nodes.preferred()
        if preferred == node or self.nodes.urls.index(preferred) > self.nodes.urls.index(node):
            return False
        log.info("amqp_moving_back", vhost=entry.vhost, node=node_label(preferred))
        return True

    async def _drop(self, entry: _VhostConnection) -> None:
        if self._pool.get(entry.vhost) is entry:
            del self._pool[entry.vhost]
            AMQP_POOL_SIZE.set(len(self._pool))
        if entry.users == 0:
            await entry.close()

    async def _make_room(self) -> None:
        """Close least recently used idle connections until one more fits."""
        while len(self._pool) >= self.settings.amqp_pool_size:
            idle = next((e for e in self._pool.values() if e.users == 0), None)
            if idle is None:  # cannot happen while _slots bounds the users; never block on it
                return
            log.info("amqp_pool_evicted", vhost=idle.vhost)
            await self._drop(idle)

    async def close_idle(self, now: float | None = None) -> int:
        """Close connections unused for `amqp_idle_seconds`; returns how many."""
        now = time.monotonic() if now is None else now
        idle = [
            entry
            for entry in self._pool.values()
            if entry.users == 0 and now - entry.last_used >= self.settings.amqp_idle_seconds
        ]
        for entry in idle:
            await self._drop(entry)
        return len(idle)

    async def probe(self, node: str | None = None) -> None:
        """Readiness: a channel opened and closed on one long-lived connection to the node
        URL's own vhost (the first node by default), so a probe costs a round trip, not a
        TCP and AMQP handshake. Raises when the node cannot be reached; the next probe
        connects again."""
        node = node or self.nodes.urls[0]
        async with self._probe_locks[node]:
            probe = self._probes.get(node)
            if probe is None or probe.is_closed or not probe.connected.is_set():
                self._probes.pop(node, None)
                if probe is not None:
                    with contextlib.suppress(Exception):
                        await probe.close()
                probe = self._probes[node] = await aio_pika.connect(
                    node,
                    timeout=self.settings.readiness_timeout,
                    ssl_context=self._ssl,
                    client_properties={"connection_name": "queuekeeper readiness"},
                )
        channel = await probe.channel(publisher_confirms=False)
        await channel.close()

    async def close(self) -> None:
        self._closed = True
        probes, self._probes = list(self._probes.values()), {}
        for probe in probes:
            with contextlib.suppress(Exception):
                await probe.close()
        entries = list(self._pool.values())
        self._pool.clear()
        AMQP_POOL_SIZE.set(0)
        await asyncio.gather(*(entry.close() for entry in entries))
