"""Group commit: accept requests that arrive together share one transaction.

A backend sends events one at a time, as they happen. Each request stored on its own
costs a connection checkout, two round trips and a commit (an fsync) per event; here the
requests waiting while one store runs are stored together in the next one, so under load
a store carries many requests and the per-event cost falls, while a lone request still
goes straight through. Each
request is answered only after the commit that holds it (nothing is answered
before it is durable), and each keeps its own outcome: an unknown offering in one
request fails that request alone.

When this process runs a relay, the copies are written already claimed by it (the
lease is in the insert) and handed to it in memory: it publishes them without a
poll or a claim query. Other relays take them over if the lease runs out, as with
any claim. Without a relay (or when its queue of handed copies is full) the copies
are written pending and the relays find them as usual.

Past what it can store in time, the intake refuses at once (`Unavailable`, a 503
with Retry-After) instead of letting waiting requests pile up into seconds.

The intake only groups requests (docs/decisions/005-group-commit.md); what a group's
transaction writes, and the lease a handed copy carries, are the outbox's
(`Outbox.store`, events/outbox.py; docs/decisions/006-outbox-leases.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from queuekeeper.common.signals import OutboxSignals
from queuekeeper.config import Settings
from queuekeeper.events.outbox import Accepted, Claimed, Outbox, Request
from queuekeeper.events.outbox_postgres import KeptConnection
from queuekeeper.events.recipients import RecipientsChanged
from queuekeeper.events.schemas import EventIn
from queuekeeper.exceptions import DomainError, Unavailable
from queuekeeper.models import utcnow

log = structlog.get_logger(__name__)

# A concurrent deletion of a recipient queue makes the insert fail its foreign key:
# the recipients are looked up again, this many times at most.
ATTEMPTS = 3


class Receiver(Protocol):
    """The relay of this process, as the intake sees it."""

    id: str

    def takes_handoff(self) -> bool: ...

    def hand_over(self, claimed: list[Claimed], *, straight: bool = False) -> None: ...


@dataclass
class _Request(Request):
    future: asyncio.Future[Accepted]
    since: float  # loop time it arrived


class Intake:
    def __init__(
        self,
        engine: AsyncEngine,
        sessions: async_sessionmaker[AsyncSession],
        settings: Settings,
        signals: OutboxSignals,
    ) -> None:
        self.engine = engine
        self.outbox = Outbox(engine, settings)
        self.sessions = sessions  # for `?wait=true`, which reads the copies' states
        self.settings = settings
        self.signals = signals
        self.relay: Receiver | None = None  # set when this process starts its relay
        self._waiting: list[_Request] = []
        self._waiting_events = 0
        self._flusher: asyncio.Task[None] | None = None
        # The stores run one at a time (`_flush`), so they keep one connection between
        # them instead of a checkout and return each.
        self._connection = KeptConnection(engine)

    async def close(self, wait: float = 5.0) -> None:
        """Wait (up to `wait` seconds) for the store under way, then give its connection
        back to the pool; a store still running keeps it (the pool's disposal follows)."""
        if self._flusher is not None and not self._flusher.done():
            _, running = await asyncio.wait({self._flusher}, timeout=wait)
            if running:
                return
        await self._connection.release()

    async def accept(
        self, events: Sequence[EventIn], bodies: list[dict[str, Any]], field_prefix: str
    ) -> Accepted:
        """Store validated events (with their message bodies); returns once committed."""
        loop = asyncio.get_running_loop()
        limit = self.settings.events_accept_queue
        if self._waiting and self._waiting_events + len(events) > limit:
            raise Unavailable(
                f"More than {limit} events are waiting to be stored; nothing of this request "
                "was stored. Retry."
            )
        # The oldest waiting request says how far behind the service is: past the limit
        # (a process starved of CPU, a slow database) refuse now rather than in seconds.
        waited = loop.time() - self._waiting[0].since if self._waiting else 0.0
        if waited > self.settings.events_accept_max_wait:
            raise Unavailable(
                f"Events wait {waited:.2f} s to be stored (the service is overloaded); nothing "
                "of this request was stored. Retry."
            )
        future: asyncio.Future[Accepted] = loop.create_future()
        self._waiting.append(_Request(events, bodies, field_prefix, future, loop.time()))
        self._waiting_events += len(events)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="events-intake")
        return await future

    async def _flush(self) -> None:
        """Store what is waiting, one transaction per round, until nothing is."""
        while self._waiting:
            group: list[_Request] = []
            size = 0
            while self._waiting and (not group or size + len(self._waiting[0].events) <= 2000):
                request = self._waiting.pop(0)
                group.append(request)
                size += len(request.events)
            self._waiting_events -= size
            try:
                results = await self._commit(group)
            except Exception as exc:  # each request answers with what went wrong
                for request in group:
                    if not request.future.done():
                        request.future.set_exception(exc)
                continue
            for request, result in zip(group, results, strict=True):
                if request.future.done():  # the caller went away; its events are stored
                    continue
                if isinstance(result, DomainError):
                    request.future.set_exception(result)
                else:
                    request.future.set_result(result)

    async def _commit(self, group: list[_Request]) -> list[Accepted | DomainError]:
        relay = self.relay
        for attempt in range(ATTEMPTS):
            now = utcnow()
            held = relay is not None and relay.takes_handoff()
            lease = self.outbox.lease(relay.id, now) if relay is not None and held else None
            try:
                stored = await self.outbox.store(group, now, lease, self._connection)
            except IntegrityError:
                if attempt + 1 == ATTEMPTS:
                    raise
                log.info("event_recipients_changed_retrying", attempt=attempt + 1)
                continue
            except RecipientsChanged:
                if attempt + 1 == ATTEMPTS:
                    raise Unavailable(
                        "The recipients of these events changed while they were stored, "
                        f"{ATTEMPTS} times over; nothing of this request was stored. Retry."
                    ) from None
                log.info("event_recipients_changed_retrying", attempt=attempt + 1)
                continue
            # Committed: only now may anyone hear of it.
            if stored.handed and relay is not None:
                relay.hand_over(stored.handed, straight=stored.handed_straight)
            elif stored.deliveries > stored.webhooks:
                self.signals.accepted.notify()
            if stored.webhooks and relay is not None:  # the dispatcher runs beside it
                self.signals.webhook_consumers |= stored.webhook_consumers
                self.signals.webhooks.notify()
            return stored.results
        raise AssertionError("unreachable")  # pragma: no cover
