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

Consumers of other scopes (contract §12) come from the same statement: those bound to an
offering's chain (its customer, its project, that project's customer) are consumers of the
offering; those bound to an event's project (or its customer) or to its subject user, and
global ones, are keyed by that project or user. An event's consumers are the union, each
once however many of its bindings match, narrowed by its object types and then by its
payload filters (`{field: [values]}` over the top-level fields of the body the consumer
receives, `schema_version` and a fan-out copy's own `offering_uuid` among them), compared
by JSON type (`_typed`).

A new kind of recipient is one more source of `Copy` in `RecipientIndex`.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from queuekeeper.broker.topology import WEBHOOK_QUEUE_PREFIX, webhook_queue_name
from queuekeeper.common.schemas import as_uuid
from queuekeeper.events.message import CONSUMER_SCHEMA_VERSION


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

    @property
    def webhook(self) -> bool:
        """A webhook consumer's copy (contract §13): delivered by HTTP, not by a queue. The
        store's write derives the same from the same rule (`webhook_copy_sql`), so the hot
        path binds nothing more (docs/decisions/026-webhooks-on-the-outbox.md)."""
        return self.consumer_uuid is not None and self.queue_name == webhook_queue_name(
            self.consumer_uuid
        )


def webhook_copy_sql(consumer_uuid: str, queue_name: str) -> str:
    """`Copy.webhook` in SQL, over these expressions (the module's constants only)."""
    return (
        f"({consumer_uuid} IS NOT NULL AND {queue_name} = '{WEBHOOK_QUEUE_PREFIX}'"
        f" || replace({consumer_uuid}::text, '-', ''))"
    )


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


_ABSENT = object()


def _typed(value: Any) -> Any:
    """A JSON value as a key that equals another's only when they are the same JSON value:
    Python's `==` takes `True` for `1` and `1.0` (so `[1]` matched `true`, and `[false]`
    matched `0`). Numbers keep Python's equality (`1` and `1.0` are one JSON number, as
    JSON Schema's `enum` has them); `null` is only an explicit null. A scalar's key costs a
    type check, so a filter is a set lookup per field on the accept path."""
    kind = type(value)
    if kind is str:
        return value
    if kind is bool:
        return (bool, value)
    if kind is int or kind is float:
        return (float, value)
    if value is None:
        return (None,)
    if isinstance(value, list):
        return (list, tuple(_typed(item) for item in value))
    if isinstance(value, dict):
        return (dict, frozenset((key, _typed(item)) for key, item in value.items()))
    return (object, value)  # anything else JSON cannot hold: equal only to itself


_NEVER: frozenset[Any] = frozenset()


@dataclass(frozen=True)
class _Consumer:
    owner: uuid.UUID
    object_types: frozenset[str]  # empty: every type
    copy: Copy
    # (field, the typed keys of its values); a field no body can satisfy holds _NEVER.
    payload_filters: tuple[tuple[str, frozenset[Any]], ...] = ()

    def takes(self, object_type: str, body: dict[str, Any] | None) -> bool:
        """Its filters hold the type and (given the body) every field it filters on."""
        if self.object_types and object_type not in self.object_types:
            return False
        if body is None or not self.payload_filters:
            return True
        for name, values in self.payload_filters:
            value = body.get(name, _ABSENT)
            if value is _ABSENT or _typed(value) not in values:
                return False
        return True


def _filters(payload: dict[Any, Any]) -> tuple[tuple[str, frozenset[Any]], ...]:
    """A consumer's stored payload filters, each field's values as typed keys; the body's
    `schema_version` (the same in every consumer's copy) is decided here: a filter it holds
    is dropped, one it does not hold matches nothing."""
    found: list[tuple[str, frozenset[Any]]] = []
    for name, values in sorted(payload.items()):
        if not isinstance(values, list):
            continue
        typed = frozenset(_typed(value) for value in values)
        if name == "schema_version":
            if _typed(CONSUMER_SCHEMA_VERSION) in typed:
                continue
            typed = _NEVER
        found.append((str(name), typed))
    return tuple(found)


def _consumer(owner: uuid.UUID, filter_: Any, copy: Copy) -> _Consumer:
    """A consumer row's `filter`: [object types, payload filters]."""
    types, payload = (filter_ or [[], {}]) if isinstance(filter_, list) else ([], {})
    if not isinstance(payload, dict):
        payload = {}
    return _Consumer(owner, frozenset(str(t) for t in types or []), copy, _filters(payload))


# An event's keys other than its offering: (kind, uuid) of the recipients statement's rows.
_PROJECT = "project"
_SUBJECT = "subject"
_GLOBAL = "global"
_KEYED = frozenset({_PROJECT, _SUBJECT, _GLOBAL})


class RecipientIndex:
    """The recipients of every event of one request, decided from the query's rows."""

    @classmethod
    def of(cls, found: Iterable[Sequence[Any]]) -> RecipientIndex:
        """From the recipients statement's rows: (offering, kind, recipient, owner, filter,
        queue, object type, queue name, vhost), the recipient None for an offering nobody
        may receive events of."""
        known: set[uuid.UUID] = set()
        rows: list[_Row] = []
        index = cls(known, [])
        for offering, kind, recipient, *rest in found:
            if offering is None:
                index._add_keyed(kind, recipient, rest)
                continue
            known.add(offering)
            if recipient is not None:
                owner, filter_, queue, object_type, name, vhost = rest
                rows.append(
                    _Row(kind, recipient, owner, filter_, offering, queue, object_type, name, vhost)
                )
        index._add_rows(rows)
        return index

    def _add_keyed(self, kind: str, recipient: uuid.UUID, rest: Sequence[Any]) -> None:
        if kind == "known_project":
            self.known_projects.add(recipient)
        elif kind == "known_user":
            self.known_users.add(recipient)
        elif kind in _KEYED:
            owner, filter_, key, _type, name, vhost = rest
            if name and vhost:
                consumer = _consumer(owner, filter_, Copy(None, recipient, name, vhost))
                self._keyed[(kind, None if kind == _GLOBAL else key)][recipient] = consumer
                self._filtered |= bool(consumer.payload_filters)

    def __init__(self, known: set[uuid.UUID], rows: Sequence[_Row]) -> None:
        self.known = known  # the offerings among those asked for that exist
        self.known_projects: set[uuid.UUID] = set()
        self.known_users: set[uuid.UUID] = set()
        self._keyed: dict[tuple[str, uuid.UUID | None], dict[uuid.UUID, _Consumer]] = defaultdict(
            dict
        )
        self._filtered = False  # a consumer filters on the payload: answers are per body
        self._subscriptions: dict[uuid.UUID, dict[uuid.UUID, tuple[uuid.UUID, list[Any]]]] = (
            defaultdict(dict)
        )
        self._queues: dict[tuple[uuid.UUID, uuid.UUID, str], Copy] = {}
        self._consumers: dict[uuid.UUID, dict[uuid.UUID, _Consumer]] = defaultdict(dict)
        self._cache: dict[tuple[Any, ...], Recipients] = {}
        self._add_rows(rows)

    def _add_rows(self, rows: Sequence[_Row]) -> None:
        for row in rows:
            if row.kind == CONSUMER:
                if row.queue_name and row.vhost:
                    consumer = _consumer(
                        row.owner_uuid,
                        row.filter,
                        Copy(None, row.recipient_uuid, row.queue_name, row.vhost),
                    )
                    self._consumers[row.offering_uuid][row.recipient_uuid] = consumer
                    self._filtered |= bool(consumer.payload_filters)
                continue
            self._subscriptions[row.offering_uuid][row.recipient_uuid] = (
                row.owner_uuid,
                list(row.filter or []),
            )
            if row.queue_uuid is not None and row.object_type and row.queue_name and row.vhost:
                key = (row.recipient_uuid, row.offering_uuid, row.object_type)
                self._queues[key] = Copy(row.queue_uuid, None, row.queue_name, row.vhost)

    @property
    def filtered(self) -> bool:
        """Whether a consumer filters on the payload (the answers are then per body)."""
        return self._filtered

    def recipients(
        self,
        offering_uuid: uuid.UUID | None,
        object_type: str,
        user_uuids: Sequence[uuid.UUID] | None,
        project_uuid: uuid.UUID | None = None,
        subject_uuid: uuid.UUID | None = None,
        body: dict[str, Any] | None = None,
    ) -> Recipients:
        users = frozenset(user_uuids) if user_uuids is not None else None
        key = (offering_uuid, object_type, users, project_uuid, subject_uuid)
        cached = None if self._filtered else self._cache.get(key)
        if cached is not None:
            return cached
        served: set[uuid.UUID] = set()  # owners a consumer of theirs receives this for
        candidates: dict[uuid.UUID, _Consumer] = {}
        subscriptions: dict[uuid.UUID, tuple[uuid.UUID, list[Any]]] = {}
        if offering_uuid is not None:
            candidates.update(self._consumers[offering_uuid])
            subscriptions = self._subscriptions[offering_uuid]
        if project_uuid is not None:
            candidates.update(self._keyed.get((_PROJECT, project_uuid), {}))
        if subject_uuid is not None:
            candidates.update(self._keyed.get((_SUBJECT, subject_uuid), {}))
        candidates.update(self._keyed.get((_GLOBAL, None), {}))
        # Who could have received it before the filters (no_copy_reason tells them apart).
        found = Recipients(candidates=len(candidates) + len(subscriptions))
        for consumer in candidates.values():  # each once, however many bindings matched
            if users is not None and consumer.owner not in users:
                continue
            if consumer.takes(object_type, body):
                found.copies.append(consumer.copy)
                served.add(consumer.owner)
        if offering_uuid is None:
            return found  # an identity event: consumers only
        for subscription_uuid, (owner, observable) in subscriptions.items():
            if (users is not None and owner not in users) or owner in served:
                continue
            queue = self._queues.get((subscription_uuid, offering_uuid, object_type))
            if queue is not None:
                found.copies.append(queue)
            elif _lists_type(observable, offering_uuid, object_type):
                found.skipped.append(subscription_uuid)
        if not self._filtered:
            self._cache[key] = found
        return found
