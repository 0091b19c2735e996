"""What the outbox relay (events/relay.py) and the webhook dispatcher
(webhooks/dispatcher.py) share: a process's loop over the outbox's copies.

Each starts its own loops beside two of this base's: the listener, which wakes it on the
copies any process commits unclaimed (a trigger's NOTIFY on the subclass's `channel`;
docs/decisions/007-notify-wakeups.md), and housekeeping, which renews the leases of the
copies it holds every `HOUSEKEEPING_INTERVAL` (so a busy process does not lose its claims
to another and deliver them twice, docs/decisions/006-outbox-leases.md) and then does the
subclass's round. A stop ends the loops, letting work in flight finish for a grace period.

While it listens, an idle loop looks in the database less and less often (`_poll_wait`):
whatever makes a copy due now is announced, so its looks are only for what nothing
announces (a dead replica's copies, due when their lease ends), and a retry it scheduled
itself wakes it when due (docs/decisions/034-idle-polls.md).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterable
from contextlib import suppress
from datetime import datetime
from typing import Any, ClassVar

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper.common.signals import Signal
from queuekeeper.config import Settings
from queuekeeper.events.outbox import Outbox
from queuekeeper.events.outbox_postgres import listen
from queuekeeper.models import utcnow

HOUSEKEEPING_INTERVAL = 5.0  # seconds between lease renewals, gauge refreshes and the like
STOP_GRACE = 5.0  # seconds a stopping loop lets the work in flight finish
# A subclass's own loops: each coroutine, and its task's name.
Loops = list[tuple[Coroutine[Any, Any, None], str]]
# What a NOTIFY calls, and what reads its payload (None: nothing does).
Listeners = tuple[Callable[[], None], Callable[[str], None] | None]


async def finish(tasks: Iterable[asyncio.Task[None]], grace: float) -> int:
    """Wait up to `grace` seconds for `tasks`, cancel those still running, then wait for
    every one to end; returns how many were cut short."""
    group = list(tasks)
    if not group:
        return 0
    _done, pending = await asyncio.wait(group, timeout=grace)
    for task in pending:
        task.cancel()
    await asyncio.gather(*group, return_exceptions=True)
    return len(pending)


class DeliveryLoop(ABC):
    """The relay's and the dispatcher's start and stop, NOTIFY listener, lease renewal and
    housekeeping round; the subclass says what it claims and delivers (the abstract
    methods: one that misses any cannot be made)."""

    kind: ClassVar[str]  # its log events' prefix: `<kind>_listen_failed`, ...
    id_key: ClassVar[str]  # the field naming its id in its log events
    channel: ClassVar[str]  # the NOTIFY channel announcing its copies
    engine: AsyncEngine  # the subclass's: the listener holds a connection of its pool

    def __init__(
        self, settings: Settings, engine: AsyncEngine, loop_id: str, announced: Signal
    ) -> None:
        self.settings = settings
        # Claims, renewals and settlements: the outbox's (events/outbox.py).
        self.outbox = Outbox(engine, settings)
        self.id = loop_id
        # Its events logged under the subclass's module, as its own are.
        self._log = structlog.get_logger(type(self).__module__)
        self._announced = announced  # copies stored by this process
        self._stopping = asyncio.Event()
        self._wake = Signal()
        self._tasks: list[asyncio.Task[None]] = []
        # The copies it holds (claimed, not settled yet) and when their lease ends.
        self._held: dict[int, datetime] = {}
        # Its looks in the database (`_poll_wait`): whether its NOTIFY listener is up, how
        # many looks in a row found nothing, and (loop time) when the earliest retry it
        # scheduled falls due.
        self._listening = False
        self._idle_looks = 0
        self._retry_due_at: float | None = None

    # --- what a subclass adds -------------------------------------------------------------
    @abstractmethod
    def _loops(self) -> Loops:
        """Its own loops (and their task names), started before the listener and
        housekeeping."""

    @abstractmethod
    def _on_accepted(self) -> None:
        """Copies were stored by this process (`announced`)."""

    @abstractmethod
    def _listeners(self) -> Listeners:
        """What a NOTIFY on `channel` calls, and what reads its payload (None: nothing)."""

    @abstractmethod
    def _on_missed(self) -> None:
        """Listening stopped and starts again: what was announced meanwhile is to be
        looked for now."""

    @abstractmethod
    async def _housekeep(self, rounds: int) -> None:
        """One housekeeping round after the leases are renewed (`rounds` counts from 1)."""

    @abstractmethod
    async def _stopped(self, grace: float, cut_short: int) -> None:
        """After its loops ended on a stop (`cut_short` of them cancelled after `grace`)."""

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._stopping.clear()
        self._announced.listen(self._on_accepted)
        self._tasks = [
            *(asyncio.create_task(loop, name=name) for loop, name in self._loops()),
            asyncio.create_task(self._housekeeping(), name=f"{self.kind}-housekeeping"),
            asyncio.create_task(self._listen(), name=f"{self.kind}-listen"),
        ]

    async def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop claiming; let the work in flight finish for up to `grace` seconds."""
        self.request_stop()
        self._announced.forget(self._on_accepted)
        cut_short = await finish(self._tasks, grace)
        self._tasks = []
        await self._stopped(grace, cut_short)

    def request_stop(self) -> None:
        self._stopping.set()
        self._wake.notify()

    async def wait_stopped(self) -> None:
        """Return once `request_stop` was called (by a signal handler, say)."""
        await self._stopping.wait()

    async def _listen(self) -> None:
        """Wake on copies committed by any process (announced on `channel`); while the
        database is unreachable the poll interval does, and listening starts again."""
        notified, payloads = self._listeners()
        while not self._stopping.is_set():
            failed = False
            try:
                await listen(
                    self.engine, self.channel, notified, self._stopping, payloads, self._heard
                )
            except Exception as exc:
                failed = True
                self._log.warning(
                    f"{self.kind}_listen_failed", **{self.id_key: self.id}, error=repr(exc)[:500]
                )
            finally:
                self._listening = False
            if self._stopping.is_set():
                return
            self._on_missed()  # what was announced while nobody listened: look for it now
            if failed:
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), HOUSEKEEPING_INTERVAL)

    def _heard(self) -> None:
        self._listening = True

    # --- how long an idle loop waits before it looks in the database ----------------------
    def _poll_wait(self) -> float:
        """`relay_poll_interval` while not listening; while listening, doubled by each look
        in a row that found nothing, up to `relay_idle_poll_max`; never past a retry this
        loop scheduled (docs/decisions/034-idle-polls.md)."""
        base = self.settings.relay_poll_interval
        wait = base
        if self._listening:
            most = max(base, self.settings.relay_idle_poll_max)
            wait = min(most, base * 2 ** min(self._idle_looks, 16))
        if self._retry_due_at is not None:
            left = self._retry_due_at - asyncio.get_running_loop().time()
            if left <= 0:
                # Due: this wait's end looks for it, once. A dispatcher whose every run slot
                # is busy does not claim then; a run's end does (it claims again), and a
                # retry still past due must not make every later wait zero.
                self._retry_due_at = None
                return 0.0
            wait = min(wait, left)
        return wait

    def _looked(self, found: bool) -> None:
        """A claim found copies (`found`) or none: the next wait is the shortest again, or
        doubles. A retry that fell due has been looked for."""
        self._idle_looks = 0 if found else self._idle_looks + 1
        due = self._retry_due_at
        if due is not None and asyncio.get_running_loop().time() >= due:
            self._retry_due_at = None

    def _retry_scheduled(self, when: datetime) -> None:
        """This loop made a copy due again at `when`: look for it then, however idle."""
        # A few milliseconds late rather than early: a look before the copy's due time
        # would not find it, and the next could be `relay_idle_poll_max` later.
        delay = max(0.0, (when - utcnow()).total_seconds()) + 0.005
        due = asyncio.get_running_loop().time() + delay
        if self._retry_due_at is None or due < self._retry_due_at:
            self._retry_due_at = due
            self._wake.notify()  # a wait begun before now may be longer: begin it again

    # --- housekeeping ---------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        rounds = 0
        while not self._stopping.is_set():
            with suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), HOUSEKEEPING_INTERVAL)
                return
            rounds += 1
            try:
                await self.renew_leases()
                await self._housekeep(rounds)
            except Exception as exc:  # housekeeping never takes the loop down
                self._log.warning(f"{self.kind}_housekeeping_failed", error=repr(exc)[:500])

    async def renew_leases(self) -> int:
        return await self.outbox.renew_held(self.id, self._held)
