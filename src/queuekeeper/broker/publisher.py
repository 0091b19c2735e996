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

What a nack means is decided here, once per queue after the batch's confirms are in
(`_judge_nacks`): RabbitMQ nacks both a publish a full queue refuses and one whose
queue process failed under it (its node killed), and only the first, under
`reject-publish-dlx`, leaves a copy in the dead-letter queue.

Reconnects are our own, not aio-pika's robust connection: a publish that fails
because the connection dropped is reported as `UNREACHABLE`, the outbox relay
retries it later, and the next use of the vhost opens a fresh connection, on the
first node of the configured list that answers (`broker/nodes.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ssl
import time
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
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
from queuekeeper.broker.topology import (
    CLASSIC,
    DEAD_LETTERING_OVERFLOW,
    QUEUE_TYPE,
    queue_arguments,
)
from queuekeeper.config import Settings
from queuekeeper.observability.metrics import AMQP_POOL_SIZE, AMQP_RECONNECTS, CONFIRM_LATENCY

log = structlog.get_logger(__name__)

# Queues of one vhost with a channel each; more share channels (never one message_id twice).
MAX_CHANNELS_PER_CONNECTION = 64


class Outcome(enum.Enum):
    CONFIRMED = "confirmed"
    # basic.nack from a queue that dead-letters what overflows (`reject-publish-dlx`), seen
    # full after the nack: the broker has dead-lettered the message.
    REJECTED = "rejected"
    # basic.nack that left no copy anywhere: a full queue under `reject-publish` (every
    # quorum queue), or a queue that was not full, so its process failed under the publish
    # (its node lost). To be published again.
    REFUSED = "refused"
    # basic.return: nothing routed it, i.e. the queue does not exist.
    RETURNED = "returned"
    # The vhost refused the connection (missing vhost or permissions).
    VHOST_REFUSED = "vhost_refused"
    # Connection or channel lost, broker unreachable, or no confirm in time.
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    error: str | None = None


# A nack as `_publish_one` sees it; `_judge_nacks` turns each into REJECTED or REFUSED.
_NACKED = Result(Outcome.REFUSED, "nacked by the broker")


@dataclass(frozen=True)
class Outgoing:
    routing_key: str
    message: aio_pika.Message


@dataclass
class _Channel:
    channel: AbstractChannel
    exchange: AbstractExchange
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
                        self.by_key[routing_key] = _Channel(opened, opened.default_exchange)
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
        # Reads a nacked queue's own arguments; without it (benchmarks, some tests) the
        # configured ones stand in.
        self.management = management
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
                results = await asyncio.gather(*(self._publish_one(entry, item) for item in items))
                if any(result is _NACKED for result in results):
                    results = await self._judge_nacks(entry, items, results)
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
        message_id = item.message.message_id or ""
        try:
            channel = await entry.channel_for(item.routing_key, message_id)
        except CONNECT_ERRORS as exc:
            # RuntimeError: aio-pika's "connection closed" (ChannelInvalidStateError included)
            return Result(Outcome.UNREACHABLE, describe(exc))
        started = time.perf_counter()
        try:
            await channel.exchange.publish(
                item.message,
                routing_key=item.routing_key,
                mandatory=True,
                timeout=self.settings.publish_timeout,
            )
        except PublishError as exc:  # a subclass of DeliveryError: test it first
            reply = getattr(exc.frame, "reply_text", "")
            return Result(Outcome.RETURNED, f"returned by the broker as unroutable ({reply})")
        except DeliveryError:
            return _NACKED
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

    async def _judge_nacks(
        self, entry: _VhostConnection, items: Sequence[Outgoing], results: Sequence[Result]
    ) -> list[Result]:
        """Each nack as dead-lettered (`REJECTED`) or refused with no copy kept (`REFUSED`),
        looking at each nacked queue once."""
        nacked = list(
            {
                item.routing_key
                for item, result in zip(items, results, strict=True)
                if result is _NACKED
            }
        )
        verdicts = dict(
            zip(
                nacked,
                await asyncio.gather(*(self._judged(entry, queue) for queue in nacked)),
                strict=True,
            )
        )
        return [
            verdicts[item.routing_key] if result is _NACKED else result
            for item, result in zip(items, results, strict=True)
        ]

    async def _judged(self, entry: _VhostConnection, queue: str) -> Result:
        """The verdict, within `publish_timeout`. A nack that cannot be judged keeps its copy
        (a duplicate at worst), and never costs the batch's other outcomes."""
        try:
            async with asyncio.timeout(self.settings.publish_timeout):
                return await self._nack_verdict(entry, queue)
        except Exception as exc:
            log.warning("nack_not_judged", vhost=entry.vhost, queue=queue, error=repr(exc)[:300])
            return Result(
                Outcome.REFUSED,
                f"nacked by the broker; whether its queue was full could not be told "
                f"({type(exc).__name__}); retrying with backoff",
            )

    async def _nack_verdict(self, entry: _VhostConnection, queue: str) -> Result:
        rule = await self._overflow_rule(entry.vhost, queue)
        if rule is None:
            return Result(
                Outcome.REFUSED,
                "nacked by the broker, and its queue is gone: nothing was dead-lettered; "
                "retrying with backoff",
            )
        overflow, limit, byte_limit = rule
        if overflow != DEAD_LETTERING_OVERFLOW:
            return Result(
                Outcome.REFUSED,
                f"nacked by the broker: the queue is full (x-overflow {overflow}: nothing was "
                "dead-lettered) or its process failed; retrying with backoff",
            )
        # A queue that just nacked for being full still holds its limit of ready messages,
        # unless its consumer took one since; then the copy is published again and may also
        # sit in the dead-letter queue: a duplicate, where reading it as full could lose it.
        ready = await entry.ready_messages(queue)
        if ready is not None and byte_limit is not None:
            # Its fill in bytes is not known exactly (only as statistics seconds old); a live
            # queue under a byte limit counts as full, or each retry would be dead-lettered
            # again and crowd other dead letters out of the bounded dead-letter queue.
            return Result(
                Outcome.REJECTED,
                f"nacked by the broker: the queue is full (x-overflow {overflow}, a limit of "
                f"{byte_limit} bytes), the message went to the dead-letter queue",
            )
        if ready is not None and limit is not None and ready >= limit:
            return Result(
                Outcome.REJECTED,
                f"nacked by the broker: the queue is full (x-overflow {overflow}, {ready} of "
                f"{limit} messages ready), the message went to the dead-letter queue",
            )
        seen = "could not be read" if ready is None else f"held {ready} of {limit} messages"
        return Result(
            Outcome.REFUSED,
            f"nacked by the broker while the queue was not full (it {seen}): its process "
            "failed under the publish (a node lost?), nothing was dead-lettered; retrying "
            "with backoff",
        )

    async def _overflow_rule(
        self, vhost: str, queue: str
    ) -> tuple[str, int | None, int | None] | None:
        """The queue's `x-overflow`, length limit and byte limit as the broker applies them;
        None when the queue is gone.

        Its own arguments (a queue declared before a setting changed keeps its old ones until
        reconcile can repair it, only when empty, and a full queue is not), with a policy's
        limits where lower (RabbitMQ applies the lower) and its `overflow` where the queue
        has none. Only a classic queue dead-letters on overflow (a quorum queue's
        `reject-publish-dlx` behaves as `drop-head`). Without a Management API client
        (benchmarks, some tests), the configured arguments; when the API fails, its
        ManagementError, so that the copy is kept."""
        policy: dict[str, Any] = {}
        if self.management is None:
            arguments = queue_arguments(self.settings)
            kind = arguments.get(QUEUE_TYPE, CLASSIC)
        else:
            info = await self.management.get_queue(
                vhost, queue, columns="type,arguments,effective_policy_definition"
            )
            if info is None:
                return None
            arguments, policy, kind = info.arguments, info.effective_policy, info.type or CLASSIC
        overflow = arguments.get("x-overflow") or policy.get("overflow") or "drop-head"
        if kind != CLASSIC:
            return f"{overflow} on a {kind} queue", None, None

        def lower(argument: str, key: str) -> int | None:
            limits = [v for v in (arguments.get(argument), policy.get(key)) if isinstance(v, int)]
            return min(limits, default=None)

        return (
            str(overflow),
            lower("x-max-length", "max-length"),
            lower("x-max-length-bytes", "max-length-bytes"),
        )

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
