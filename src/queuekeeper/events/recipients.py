"""Where an event goes: the one query for a request's recipients and the decision per event.

An event of (offering, object type) gets one outbox copy per registered queue for
that pair whose subscription's owner is active, has an unexpired token and has
access to the offering, narrowed to the event's `user_uuids` when it names any.
A subscription that would receive the type (it lists it, or lists nothing) but
registered no queue for it is counted as skipped. Everything is read in one
statement per group of requests (the outbox's store: `outbox_postgres.RECIPIENTS` and its
Core twin), whatever the batch or the fan-out; the rest is decided here, in memory.

A consumer (contract §9) of an active owner with access, scoped to the offering, gets one
copy when its filter holds the type (an empty filter holds every type); its owner's
legacy queues then get none of that event (as Waldur does), so an agent upgraded from
1.0.5 to 1.0.7 does not fill the per-type queues it no longer reads, and a user on both
protocols gets each event once. Consumers come from the same statement (a UNION ALL).

A new kind of recipient is one more source of `Copy` in `RecipientIndex`.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from queuekeeper.common.schemas import as_uuid


class RecipientsChanged(Exception):
    """The recipients a store planned its copies from changed before its write, which wrote
    nothing: the store reads them again and plans again."""


@dataclass(frozen=True)
class Copy:
    """One outbox copy of an event: a subscription's queue (`queue_uuid`) or a consumer's
    (`consumer_uuid`)."""

    queue_uuid: uuid.UUID | None
    consumer_uuid: uuid.UUID | None
    queue_name: str
    vhost: str


# Why an event made no copy, from what the recipients statement already read (contract §5).
NoCopyReason = Literal["no_registered_queue", "no_agent", "all_recipients_filtered", "duplicate"]


@dataclass
class Recipients:
    copies: list[Copy] = field(default_factory=list)
    skipped: list[uuid.UUID] = field(default_factory=list)  # subscriptions without a queue
    # Subscriptions and consumers of the offering(s) whose owner may receive events now,
    # before the event's type and `user_uuids` narrowed them.
    candidates: int = 0

    @property
    def no_copy_reason(self) -> NoCopyReason | None:
        if self.copies:
            return None
        if self.skipped:
            return "no_registered_queue"
        return "all_recipients_filtered" if self.candidates else "no_agent"


SUBSCRIPTION = "subscription"
CONSUMER = "consumer"


@dataclass(frozen=True)
class _Row:
    """Someone whose owner may receive events of `offering_uuid` now.

    `kind` SUBSCRIPTION: a subscription (`recipient_uuid`) with `filter` = its observable
    objects, and its queue for one of the requested object types (queue fields None when
    it registered none). `kind` CONSUMER: a consumer scoped to the offering, `filter` = its
    object types (empty = all), `queue_name`/`vhost` its one queue, `queue_uuid` None.
    """

    kind: str
    recipient_uuid: uuid.UUID
    owner_uuid: uuid.UUID
    filter: list[Any]
    offering_uuid: uuid.UUID
    queue_uuid: uuid.UUID | None
    object_type: str | None
    queue_name: str | None
    vhost: str | None


def _lists_type(observable_objects: list[Any], offering_uuid: uuid.UUID, object_type: str) -> bool:
    """Whether a subscription asked for this type (an empty list asks for everything)."""
    if not observable_objects:
        return True
    for item in observable_objects:
        if not isinstance(item, dict) or item.get("object_type") != object_type:
            continue
        named = item.get("offering_uuid")
        if named is None or as_uuid(named) == offering_uuid:
            return True
    return False


@dataclass(frozen=True)
class _Consumer:
    owner: uuid.UUID
    object_types: frozenset[str]  # empty: every type
    copy: Copy


class RecipientIndex:
    """The recipients of every event of one request, decided from the query's rows."""

    @classmethod
    def of(cls, found: Iterable[Sequence[Any]]) -> RecipientIndex:
        """From the recipients statement's rows: (offering, kind, recipient, owner, filter,
        queue, object type, queue name, vhost), the recipient None for an offering nobody
        may receive events of."""
        known: set[uuid.UUID] = set()
        rows: list[_Row] = []
        for offering, kind, recipient, *rest in found:
            known.add(offering)
            if recipient is not None:
                owner, filter_, queue, object_type, name, vhost = rest
                rows.append(
                    _Row(kind, recipient, owner, filter_, offering, queue, object_type, name, vhost)
                )
        return cls(known, rows)

    def __init__(self, known: set[uuid.UUID], rows: Sequence[_Row]) -> None:
        self.known = known  # the offerings among those asked for that exist
        self._subscriptions: dict[uuid.UUID, dict[uuid.UUID, tuple[uuid.UUID, list[Any]]]] = (
            defaultdict(dict)
        )
        self._queues: dict[tuple[uuid.UUID, uuid.UUID, str], Copy] = {}
        self._consumers: dict[uuid.UUID, dict[uuid.UUID, _Consumer]] = defaultdict(dict)
        for row in rows:
            if row.kind == CONSUMER:
                if row.queue_name and row.vhost:
                    self._consumers[row.offering_uuid][row.recipient_uuid] = _Consumer(
                        row.owner_uuid,
                        frozenset(str(t) for t in row.filter or []),
                        Copy(None, row.recipient_uuid, row.queue_name, row.vhost),
                    )
                continue
            self._subscriptions[row.offering_uuid][row.recipient_uuid] = (
                row.owner_uuid,
                list(row.filter or []),
            )
            if row.queue_uuid is not None and row.object_type and row.queue_name and row.vhost:
                key = (row.recipient_uuid, row.offering_uuid, row.object_type)
                self._queues[key] = Copy(row.queue_uuid, None, row.queue_name, row.vhost)
        self._cache: dict[tuple[Any, ...], Recipients] = {}

    def recipients(
        self, offering_uuid: uuid.UUID, object_type: str, user_uuids: Sequence[uuid.UUID] | None
    ) -> Recipients:
        users = frozenset(user_uuids) if user_uuids is not None else None
        key = (offering_uuid, object_type, users)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        found = Recipients(
            candidates=len(self._consumers[offering_uuid]) + len(self._subscriptions[offering_uuid])
        )
        served: set[uuid.UUID] = set()  # owners a consumer of theirs receives this for
        for consumer in self._consumers[offering_uuid].values():
            if users is not None and consumer.owner not in users:
                continue
            if not consumer.object_types or object_type in consumer.object_types:
                found.copies.append(consumer.copy)
                served.add(consumer.owner)
        for subscription_uuid, (owner, observable) in self._subscriptions[offering_uuid].items():
            if (users is not None and owner not in users) or owner in served:
                continue
            queue = self._queues.get((subscription_uuid, offering_uuid, object_type))
            if queue is not None:
                found.copies.append(queue)
            elif _lists_type(observable, offering_uuid, object_type):
                found.skipped.append(subscription_uuid)
        self._cache[key] = found
        return found
