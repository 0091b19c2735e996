"""The outbox's statements on PostgreSQL: plain SQL, every write of `deliveries` and `events`.

The only module that talks to the driver itself (docs/decisions/008-driver-path.md): the
store of accepted events and the relay's claim, renew, settle and release, each run per
request or per batch; and parking's writes of a copy (park, unpark, the retention's
give-up and prune, the replay's insert), which the outbox owns as well. The few a request
decides are run by `outbox.py` through the request's session instead, in its transaction
(the block at the end; docs/decisions/032-one-owner-of-copy-state.md). asyncpg prepares each
statement once per connection (its statement cache) and binds lists as arrays, so one
statement serves one row or thousands. The connection is one of SQLAlchemy's pool,
checked out through `AsyncEngine.connect()` and reached with
`get_raw_connection().driver_connection`, so the pool's size, recycling and reset stay
SQLAlchemy's and there is no second pool to size.

A failure is raised as SQLAlchemy would raise it (`DBAPIError`, `IntegrityError` for a
constraint), so the error handlers (errors.py) answer a lost connection or a database
that is down with 503 and the intake retries a conflict, whichever path ran. In the service
`Outbox` (outbox.py) runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from queuekeeper.common.locks import lock_key
from queuekeeper.events.authorization import (
    EPOCH_SQL,
    access_sql,
    authorized_sql,
    binding_allowed_sql,
    offering_keys_sql,
    project_keys_sql,
    subject_keys_sql,
    unchanged_sql,
)
from queuekeeper.events.recipients import RecipientsChanged, webhook_copy_sql

_SQLSTATE_CONSTRAINT = "23"
T = TypeVar("T")


async def send(driver: Any, sql: str, arguments: Sequence[Any]) -> list[Any]:
    """The one place a statement reaches asyncpg (tests count statements here)."""
    return list(await driver.fetch(sql, *arguments))


# Who may receive events of the offerings $1, the projects $4 and the subject users $5, of the
# object types $2, at $3 (contract §12). Per offering: its subscriptions (with their queue
# for a requested type) and the consumers bound to it or to one of its keys
# (`offering_keys_sql`), left-joined so an unknown offering yields no row at all. Then, with
# no offering: a marker per known project and per known user ('known_project',
# 'known_user': an unknown one is refused), the consumers bound to a project's keys
# (`project_keys_sql`: kind 'project', the project in `queue_uuid`) or to a subject user's
# (`subject_keys_sql`: kind 'subject', the user in `queue_uuid`), and the global consumers.
# The keys are the rule's own (authorization.py's functions, which `event_keys_sql` is made
# of), read here for every entity the request names at once: a copy the store hands over
# skips the rule while access is unchanged (docs/decisions/029-judged-as-it-leaves.md), so
# the two must never disagree. Every owner is active, holds a token that has not expired
# and may still hold the binding matched (`binding_allowed_sql`; the rule `authorized_sql`
# applies again when a copy is published). A consumer's `filter` is [its object types, its
# payload filters]. Each part reads through an index on what the event names, so consumers
# bound to entities the request does not name cost nothing (events/recipients.py decides
# from the rows).
_ACTIVE_OWNER = """u.is_active AND u.token_hash IS NOT NULL
        AND (u.token_expires_at IS NULL OR u.token_expires_at > $3)"""
_CONSUMER = "c.uuid, c.user_uuid, json_build_array(c.object_types, c.payload_filters)"
_BOUND = (
    """
    JOIN event_consumer_bindings b ON b.scope_type = k.scope_type AND b.scope_uuid = k.entity
    JOIN event_consumers c ON c.uuid = b.consumer_uuid
    JOIN users u ON u.uuid = c.user_uuid
    WHERE """
    + _ACTIVE_OWNER
    + " AND "
    + binding_allowed_sql("c.user_uuid", "b.scope_type", "b.scope_uuid", "$3")
)
_NO_QUEUE = "NULL::uuid, NULL::varchar"
_MARKER = "NULL::uuid, NULL::json, NULL::uuid, NULL::varchar, NULL::varchar, NULL::varchar"
_BY_OFFERING = (
    """
SELECT o.uuid, r.kind, r.recipient_uuid, r.user_uuid, r.filter, r.queue_uuid,
       r.object_type, r.queue_name, r.vhost
FROM offerings o LEFT JOIN (
    SELECT 'subscription' AS kind, a.offering_uuid, s.uuid AS recipient_uuid, s.user_uuid,
           s.observable_objects AS filter, q.uuid AS queue_uuid, q.object_type,
           q.queue_name, q.vhost
    FROM offering_access a
    JOIN users u ON u.uuid = a.user_uuid
    JOIN event_subscriptions s ON s.user_uuid = a.user_uuid
    LEFT JOIN event_subscription_queues q ON q.subscription_uuid = s.uuid
        AND q.offering_uuid = a.offering_uuid AND q.object_type = ANY($2::varchar[])
    WHERE a.offering_uuid = ANY($1::uuid[]) AND """  # noqa: S608 - the module's constants
    + _ACTIVE_OWNER
    + """
    UNION ALL
    SELECT 'consumer', sc.offering_uuid, """
    + _CONSUMER
    + ", "
    + _NO_QUEUE
    + """, c.queue_name, c.vhost
    FROM event_consumer_scopes sc
    JOIN event_consumers c ON c.uuid = sc.consumer_uuid
    JOIN users u ON u.uuid = c.user_uuid
    WHERE sc.offering_uuid = ANY($1::uuid[]) AND """
    + _ACTIVE_OWNER
    + " AND "
    + binding_allowed_sql("c.user_uuid", "'offering'", "sc.offering_uuid", "$3")
    + """
    UNION ALL
    SELECT 'consumer', k.uuid, """
    + _CONSUMER
    + ", "
    + _NO_QUEUE
    + """, c.queue_name, c.vhost
    FROM ("""
    + offering_keys_sql("ko.uuid = ANY($1::uuid[])", "ko.uuid, ")
    + """
    ) k"""
    + _BOUND
    + """
) r ON r.offering_uuid = o.uuid
WHERE o.uuid = ANY($1::uuid[])
"""
)
_MARKERS = (
    """UNION ALL
SELECT NULL::uuid, 'known_project', kp.uuid, """
    + _MARKER
    + """
FROM projects kp WHERE kp.uuid = ANY($4::uuid[])
UNION ALL
SELECT NULL::uuid, 'known_user', ku.uuid, """
    + _MARKER
    + """
FROM users ku WHERE ku.uuid = ANY($5::uuid[])
"""
)
_PROJECTS = "kp.uuid = ANY(ARRAY(SELECT unnest($4::uuid[])))"
_SUBJECTS = "ku.uuid = ANY(ARRAY(SELECT unnest($5::uuid[])))"
_KEYED = (
    """UNION ALL
SELECT NULL::uuid, k.kind, """
    + _CONSUMER
    + """, k.key_uuid, NULL::varchar, c.queue_name, c.vhost
FROM (
"""
    + project_keys_sql(_PROJECTS, "'project'::varchar AS kind, kp.uuid AS key_uuid, ")
    + "\nUNION ALL"
    + subject_keys_sql(_SUBJECTS, "'subject', ku.uuid, ")
    + """
) k"""
    + _BOUND
    + "\n"
)
_GLOBAL = (
    """UNION ALL
SELECT NULL::uuid, 'global', """
    + _CONSUMER
    + ", "
    + _NO_QUEUE
    + """, c.queue_name, c.vhost
FROM event_consumers c JOIN users u ON u.uuid = c.user_uuid
WHERE c.is_global AND (u.is_staff OR u.is_support) AND """
    + _ACTIVE_OWNER
    + "\n"
)
# Two forms of the one statement, made of the same parts: with the consumers of the
# request's projects and subject users (`_KEYED`), and without them for a request naming
# none. PostgreSQL plans a prepared statement for its parameters (a custom plan) until a
# generic plan is as cheap; with many bindings `_KEYED` would keep every request planned
# anew (milliseconds). So it reads its arrays through `ARRAY(SELECT unnest(..))`, whose
# value no plan sees (custom and generic cost the same, and the generic plan is kept), and a
# request naming neither runs without it at all
# (docs/decisions/025-bindings-authorized-at-delivery.md).
RECIPIENT_ROWS = _BY_OFFERING + _MARKERS + _KEYED + _GLOBAL
RECIPIENT_ROWS_BY_OFFERING = _BY_OFFERING + _MARKERS + _GLOBAL
# The rows, and on each a digest of them all: what a store remembers them by
# (`RecipientCache`), checked again by the write (`INSERT_ACCEPTED`).
_DIGEST = "md5(coalesce(string_agg(r::text, ',' ORDER BY r::text), ''))"
_EMPTY_DIGEST = "d41d8cd98f00b204e9800998ecf8427e"  # md5(''): no rows
# Built from the module's constants alone (no input reaches them), so the rule has one text.
_FORMS = ((True, RECIPIENT_ROWS), (False, RECIPIENT_ROWS_BY_OFFERING))
# Keyed by whether the request names projects or subject users.
RECIPIENTS = {
    keyed: "WITH r AS (" + rows + ")\nSELECT r.*, (SELECT " + _DIGEST + " FROM r) FROM r"  # noqa: S608 - constants
    for keyed, rows in _FORMS
}
EVENT_COUNTS = """
SELECT event_id, queued, skipped_unregistered FROM events WHERE event_id = ANY($1::varchar[])
"""
# The events whose id is new and the copies of those events, in one statement: it commits
# as it runs (atomic, durable when answered), so a store is two round trips (the
# recipients, then this) with no BEGIN and no COMMIT of its own
# (docs/decisions/017-single-event-cost.md), and one when the recipients are remembered
# (docs/decisions/020-recipient-digest.md). The statement reads the recipients of the
# offerings $1, types $2, projects $4 and subject users $5 at $3 again (`RECIPIENT_ROWS`,
# with the same parameters) and writes nothing unless their digest is still $6, the digest
# of the rows the copies were planned from. The copies are inserted in the
# order they are given (acceptance order: ids follow it); a copy of an event that was not
# new is dropped. The foreign key to `events` is checked at the statement's end, when the
# new events are there. Returned: ('g', digest now) once, ('e', event_id, ...) per new
# event, ('d', event_id, id, queue, consumer) per copy. Each copy records the access epoch
# read in the same snapshot as the recipients it was judged by (returned on the 'g' row as
# its id), so whatever publishes it later can prove nothing changed since
# (docs/decisions/029-judged-as-it-leaves.md).
_FRESH = (
    "WITH fresh AS (SELECT "  # noqa: S608 - constants
    + _DIGEST
    + " AS digest, "
    + EPOCH_SQL
    + " AS epoch FROM ({rows}) r"
)
_WRITE = (
    """
), new_events AS (
    INSERT INTO events (event_id, offering_uuid, offering_uuids, object_type, payload,
                        user_uuids, queued, skipped_unregistered, accepted, project_uuid,
                        subject_user_uuid)
    {events}
    WHERE (SELECT digest FROM fresh) = $6
    ON CONFLICT DO NOTHING
    RETURNING event_id
), copies AS (
    INSERT INTO deliveries (event_id, queue_uuid, consumer_uuid, queue_name, vhost,
                            offering_uuid, state, attempts, claimed_by, claimed_until,
                            next_attempt_at, created, judged_epoch, webhook)
    SELECT c.event_id, c.queue_uuid, c.consumer_uuid, c.queue_name, c.vhost,
           c.offering_uuid, c.state, c.attempts, c.claimed_by, c.claimed_until,
           c.next_attempt_at, c.created, (SELECT epoch FROM fresh), """  # noqa: S608 - the module's constants
    + webhook_copy_sql("c.consumer_uuid", "c.queue_name")
    + """
    FROM {copies} AS c(event_id, queue_uuid, consumer_uuid, queue_name, vhost,
                       offering_uuid, state, attempts, claimed_by, claimed_until,
                       next_attempt_at, created, position)
    WHERE c.event_id IN (SELECT event_id FROM new_events)
    ORDER BY c.position
    RETURNING id, event_id, queue_uuid, consumer_uuid
)
SELECT 'g' AS kind, digest AS event_id, epoch AS id, NULL::uuid AS queue_uuid,
       NULL::uuid AS consumer_uuid
FROM fresh
UNION ALL
SELECT 'e', event_id, NULL, NULL, NULL FROM new_events
UNION ALL
SELECT 'd', event_id, id, queue_uuid, consumer_uuid FROM copies
"""
)
# The SQL types of EVENT_COLUMNS ($7 on) and DELIVERY_COLUMNS (after them), in their order.
_EVENT_TYPES: tuple[str, ...] = ("varchar", "uuid", "json", "varchar", "json", "json")
_EVENT_TYPES += ("int", "int", "timestamptz", "uuid", "uuid")
_COPY_TYPES: tuple[str, ...] = ("varchar", "uuid", "uuid", "varchar", "varchar", "uuid")
_COPY_TYPES += ("varchar", "int", "varchar", "timestamptz", "timestamptz", "timestamptz")


def _parameters(first: int, types: Sequence[str], suffix: str) -> str:
    return ", ".join(f"${first + k}::{kind}{suffix}" for k, kind in enumerate(types))


def _insert_accepted(rows: str, one: bool) -> str:
    """INSERT_ACCEPTED's text: the events and copies as one array per column, or, for `one`
    event with one copy, as one value per column: asyncpg's encoding of 23 one-element
    arrays made a single event's write cost 0.19 ms of CPU against 0.14 ms with values
    (docs/decisions/017-single-event-cost.md)."""
    first_copy = 7 + len(_EVENT_TYPES)
    if one:
        events = "SELECT " + _parameters(7, _EVENT_TYPES, "")
        copies = "(SELECT " + _parameters(first_copy, _COPY_TYPES, "") + ", 1)"
    else:
        events = "SELECT * FROM unnest(" + _parameters(7, _EVENT_TYPES, "[]") + ")"  # noqa: S608 - constants
        copies = "unnest(" + _parameters(first_copy, _COPY_TYPES, "[]") + ") WITH ORDINALITY"
    write = _WRITE.replace("{events}", events).replace("{copies}", copies)
    return _FRESH.replace("{rows}", rows) + write


# Keyed by (whether the request names projects or subject users, one event with one copy).
INSERT_ACCEPTED = {
    (keyed, one): _insert_accepted(rows, one) for keyed, rows in _FORMS for one in (False, True)
}

# The access now (`access_sql`): one row, `access ax`, read once per statement.
_ACCESS = "access AS (SELECT " + access_sql("{now}") + ")"
# A copy whose queue row is gone (both uuids set null by the delete) is left to the relay,
# which gives it up for that reason. Every other copy is judged as the statement takes it
# to be published: by the rule, or, where it is proven that nothing the rule reads has
# changed since the copy was last judged, by that judgment (`unchanged_sql`: the epoch it
# was judged under is still the epoch, and no role or token expired since its creation, a
# time no later than any judgment of it). CASE keeps the rule's subqueries from running
# for the copies that need none; `ax.epoch` is what a copy taken records
# (docs/decisions/029-judged-as-it-leaves.md).
_JUDGED = (
    "d.id, ax.epoch, CASE WHEN d.queue_uuid IS NULL AND d.consumer_uuid IS NULL THEN true WHEN "
    + unchanged_sql("d.judged_epoch", "d.created", "ax")
    + " THEN true ELSE "
    + authorized_sql(
        "d.queue_uuid",
        "d.consumer_uuid",
        "coalesce(d.offering_uuid, e.offering_uuid)",
        "{now}",
        "e.project_uuid",
        "e.subject_user_uuid",
    )
    + " END AS ok"
)
# What a copy keeps of its attempts (contract §14; docs/decisions/031-delivery-log.md): the
# last ATTEMPT_LOG_SIZE, oldest first, each appended by the very statement that settles the
# attempt (no statement of its own on the delivery path), with the last one's time and
# status beside them for the list.
ATTEMPT_LOG_SIZE = 20


def attempt_logged(
    at: str, ms: str, status: str, error: str, *, log: str = "d.attempt_log", when: str = ""
) -> str:
    """SET clauses appending one attempt (SQL expressions of the caller's statement) to the
    copy's log, the oldest dropped past ATTEMPT_LOG_SIZE; with `when`, only where it holds
    (else the columns keep their values)."""
    appended = (
        f"(CASE WHEN jsonb_array_length({log}) >= {ATTEMPT_LOG_SIZE} THEN {log} - 0"
        f" ELSE {log} END) || jsonb_build_array(jsonb_build_object('at', {at}, 'duration_ms',"
        f" {ms}, 'status', {status}, 'error', {error}))"
    )
    last = log.rsplit(".", 1)[0] + "." if "." in log else ""
    if not when:
        return (
            f"attempt_log = {appended}, last_attempt_at = {at}, last_status = ({status})::varchar"
        )
    return (
        f"attempt_log = CASE WHEN {when} THEN {appended} ELSE {log} END,"
        f" last_attempt_at = CASE WHEN {when} THEN {at} ELSE {last}last_attempt_at END,"
        f" last_status = CASE WHEN {when} THEN ({status})::varchar ELSE {last}last_status END"
    )


# What a refused copy records as its reason.
REFUSED_REASON = (
    "not authorized when published: the owner had lost access to the offering, the "
    "consumer its scope, or the owner was inactive or without a valid token"
)
# One UPDATE settles what a claim or an unpark took: an authorized copy is claimed (as
# before), a refused one given up, and both are returned with the verdict last (`ok`), so
# a batch made only of refused copies is still seen as progress.
_SETTLE_TAKEN = (
    """
UPDATE deliveries d
SET state = CASE WHEN j.ok THEN 'pending' ELSE 'given_up' END,
    attempts = d.attempts + CASE WHEN j.ok THEN 1 ELSE 0 END,
    claimed_by = CASE WHEN j.ok THEN {relay}::varchar END,
    claimed_until = CASE WHEN j.ok THEN {until}::timestamptz END,
    next_attempt_at = CASE WHEN j.ok THEN {until}::timestamptz ELSE d.next_attempt_at END,
    judged_epoch = CASE WHEN j.ok THEN j.epoch ELSE d.judged_epoch END,
    finished = CASE WHEN j.ok THEN NULL ELSE {now}::timestamptz END,
    last_error = CASE WHEN j.ok THEN d.last_error ELSE '"""
    + REFUSED_REASON
    + """' END,
    given_up_reason = CASE WHEN j.ok THEN d.given_up_reason ELSE 'not_authorized' END
FROM judged j, events e
WHERE d.id = j.id AND d.event_id = e.event_id AND {guard}
"""
)
# 'pending' and `NOT webhook` are written out, not bound: the partial index of pending rows
# is used only when the planner sees the predicate it was defined with (asyncpg plans
# prepared statements); webhook copies are the webhook dispatcher's (migration 0015_webhooks).
# FOR UPDATE SKIP LOCKED lets relays claim side by side without waiting on or
# double-claiming each other's rows; the claim returns what publishing needs.
CLAIM = (
    "\nWITH "  # noqa: S608 - the module's constants
    + _ACCESS.format(now="$1::timestamptz")
    + """, due AS (
    SELECT id FROM deliveries
    WHERE state = 'pending' AND NOT webhook AND next_attempt_at <= $1
    ORDER BY next_attempt_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), judged AS (
    SELECT """
    + _JUDGED.format(now="$1::timestamptz")
    + """
    FROM due JOIN deliveries d ON d.id = due.id JOIN events e ON e.event_id = d.event_id
    CROSS JOIN access ax
)"""
    + _SETTLE_TAKEN.format(relay="$3", until="$4", now="$1", guard="true")
)
# What a claimed copy carries (`outbox.Claimed`, in its fields' order, then the verdict):
# the claim's and the unpark's alike; judged under `judged_epoch` at the statement's time.
_CLAIMED = """
RETURNING d.id, d.event_id, d.queue_uuid, d.consumer_uuid, d.queue_name, d.vhost,
          d.attempts, d.created, d.last_error, d.offering_uuid, e.offering_uuid,
          e.object_type, e.accepted, e.payload::text, d.replay, d.judged_epoch,
          {now}::timestamptz"""
CLAIM += _CLAIMED.format(now="$1") + ", j.ok\n"
# The statements below address copies by id and guard on the state with
# `(state || '') = 'pending'`, which the planner cannot match to the partial index of
# pending copies (as it would `state = 'pending'`): that index's statistics
# lag a burst (taken when nearly every copy was published, they say pending copies are
# few), and with the plain `state = 'pending'` the planner then read the whole backlog
# through that index for every settled batch (a backlog of 20,000 copies: 110-170 us per
# copy settled, against 30-40 us through the primary key; docs/decisions/018-outbox-plans.md).
RENEW = """
UPDATE deliveries SET claimed_until = $3, next_attempt_at = $3
WHERE id = ANY($1::bigint[]) AND (state || '') = 'pending' AND claimed_by = $2
RETURNING id
"""
# Not an attempt: nothing was published. Due again at once, announced on the channel $4
# (outbox.DUE_CHANNEL) as the insert's trigger announces new copies: a relay of another
# process, looking rarely while idle, takes them now (docs/decisions/034-idle-polls.md).
RELEASE = """
WITH released AS (
    UPDATE deliveries
    SET claimed_by = NULL, claimed_until = NULL, next_attempt_at = $3, attempts = attempts - 1
    WHERE id = ANY($1::bigint[]) AND (state || '') = 'pending' AND claimed_by = $2
    RETURNING 1
)
SELECT pg_notify($4, '') FROM (SELECT 1 FROM released LIMIT 1) r
"""
# The broker's answer to each copy ($1), its attempt's duration $6 (per copy; none: null)
# and status $5 (`confirmed`, or `nacked` for a copy it dead-lettered: rejected, given up
# as `queue_full`).
FINISH = (
    """
UPDATE deliveries d
SET state = $2, finished = $3, claimed_by = NULL, claimed_until = NULL,
    last_error = coalesce($4, d.last_error),
    given_up_reason = CASE WHEN $2::varchar = 'rejected' THEN 'queue_full'
                           ELSE d.given_up_reason END,
    """
    + attempt_logged("$3::timestamptz", "r.ms", "$5::varchar", "$4::text")
    + """
FROM unnest($1::bigint[], $6::int[]) AS r(id, ms)
WHERE d.id = r.id AND (d.state || '') = 'pending'
"""
)
# Each copy with its own `finished`: the time the broker confirmed it, after its attempt
# of r.ms milliseconds.
PUBLISHED_AT = (
    """
UPDATE deliveries d
SET state = 'published', finished = r.at, claimed_by = NULL, claimed_until = NULL,
    """
    + attempt_logged("r.at", "r.ms", "'confirmed'::varchar", "NULL::text")
    + """
FROM unnest($1::bigint[], $2::timestamptz[], $3::int[]) AS r(id, at, ms)
WHERE d.id = r.id AND (d.state || '') = 'pending'
"""
)


def given_up_sql(finished: str, error: str, code: str) -> str:
    """The `SET` of a copy given up at `finished` with the reason `error` and the code
    `code` (contract §14's `given_up_reason`): it leaves any lease, and no claim takes it.
    Every statement that gives copies up unconditionally writes it so; the claim's and the
    held copies' judgment give up a refused copy inside their `CASE` (`_SETTLE_TAKEN`,
    `JUDGE_HELD`)."""
    return (
        f"state = 'given_up', finished = {finished}, claimed_by = NULL, claimed_until = NULL,"
        f" last_error = {error}, given_up_reason = {code}"
    )


# Given up (reason r.error, code r.code); a copy whose last attempt failed (r.at set: too
# old to try again) has that attempt recorded.
GIVE_UP = (
    """
UPDATE deliveries d
SET """
    + given_up_sql("$3", "r.error", "r.code")
    + """,
    """
    + attempt_logged("r.at", "r.ms", "r.status", "r.error", when="r.at IS NOT NULL")
    + """
FROM unnest($1::bigint[], $2::text[], $4::varchar[], $5::timestamptz[], $6::int[],
            $7::varchar[]) AS r(id, error, code, at, ms, status)
WHERE d.id = r.id AND (d.state || '') = 'pending'
"""
)
# Unless another relay took the copy since; each a failed attempt (at r.at, r.ms long, the
# broker's answer r.status: `returned`, `nacked`, or none).
RESCHEDULE = (
    """
UPDATE deliveries d
SET next_attempt_at = r.next, last_error = r.error, claimed_by = NULL, claimed_until = NULL,
    """
    + attempt_logged("r.at", "r.ms", "r.status", "r.error")
    + """
FROM unnest($1::bigint[], $2::timestamptz[], $3::text[], $5::timestamptz[], $6::int[],
            $7::varchar[]) AS r(id, next, error, at, ms, status)
WHERE d.id = r.id AND (d.state || '') = 'pending' AND d.claimed_by = $4
"""
)

# --- judged as it leaves (docs/decisions/029-judged-as-it-leaves.md) -----------------------
# The access epoch and the latest expiry passed by $1, in one snapshot: what a holder of
# copies compares with what they were judged under before publishing them (three index
# probes, no table of copies read).
ACCESS = "SELECT " + access_sql("$1::timestamptz")
# The copies $1 that the holder $2 still holds, judged again at $3 (`_JUDGED`): an
# authorized copy stays held and records the epoch; a refused one is given up (the claim's
# reason). Returned: (id, verdict, epoch) of each copy still held.
JUDGE_HELD = (
    "\nWITH "  # noqa: S608 - the module's constants
    + _ACCESS.format(now="$3::timestamptz")
    + """, judged AS (
    SELECT """
    + _JUDGED.format(now="$3::timestamptz")
    + """
    FROM deliveries d JOIN events e ON e.event_id = d.event_id CROSS JOIN access ax
    WHERE d.id = ANY($1::bigint[]) AND (d.state || '') = 'pending' AND d.claimed_by = $2
)
UPDATE deliveries d
SET state = CASE WHEN j.ok THEN d.state ELSE 'given_up' END,
    judged_epoch = CASE WHEN j.ok THEN j.epoch ELSE d.judged_epoch END,
    claimed_by = CASE WHEN j.ok THEN d.claimed_by END,
    claimed_until = CASE WHEN j.ok THEN d.claimed_until END,
    finished = CASE WHEN j.ok THEN d.finished ELSE $3::timestamptz END,
    given_up_reason = CASE WHEN j.ok THEN d.given_up_reason ELSE 'not_authorized' END,
    last_error = CASE WHEN j.ok THEN d.last_error ELSE '"""
    + REFUSED_REASON
    + """' END
FROM judged j
WHERE d.id = j.id AND (d.state || '') = 'pending' AND d.claimed_by = $2
RETURNING d.id, j.ok, j.epoch
"""
)

# --- parking's writes (docs/decisions/015-parking.md) -------------------------------------
# The parked copies' statements spell `ix_deliveries_parked`'s predicate as migration
# 0011_parking defines it (models.PARKED_OR_RELEASING), so the planner uses that index.
# A copy a relay holds (claimed or handed over) parks: not an attempt, nothing was published.
PARK = """
UPDATE deliveries
SET state = 'parked', parked_at = coalesce(parked_at, $3), claimed_by = NULL,
    claimed_until = NULL, attempts = attempts - 1, last_error = $4
WHERE id = ANY($1::bigint[]) AND (state || '') = 'pending' AND claimed_by = $2
"""
# The queue's oldest parked copies, back to pending and claimed as `CLAIM` claims (and
# judged as it judges).
UNPARK = (
    "\nWITH "  # noqa: S608 - the module's constants
    + _ACCESS.format(now="$6::timestamptz")
    + """, oldest AS (
    SELECT id FROM deliveries
    WHERE parked_at IS NOT NULL AND state IN ('parked', 'pending')
        AND state = 'parked' AND vhost = $1 AND queue_name = $2
    ORDER BY id
    LIMIT $3
), judged AS (
    SELECT """
    + _JUDGED.format(now="$6::timestamptz")
    + """
    FROM oldest JOIN deliveries d ON d.id = oldest.id JOIN events e ON e.event_id = d.event_id
    CROSS JOIN access ax
)"""
    + _SETTLE_TAKEN.format(relay="$4", until="$5", now="$6", guard="d.state = 'parked'")
)
UNPARK += _CLAIMED.format(now="$6") + ", j.ok\n"
GIVE_UP_PARKED = (
    """
WITH expired AS (
    SELECT id FROM deliveries
    WHERE parked_at IS NOT NULL AND state IN ('parked', 'pending')
        AND state = 'parked' AND created < $1
    LIMIT $2
), given_up AS (
    UPDATE deliveries d SET """  # noqa: S608 - the module's constants
    + given_up_sql("$3", "$4", "'retention'")
    + """
    FROM expired WHERE d.id = expired.id AND d.state = 'parked'
    RETURNING 1
)
SELECT count(*) FROM given_up
"""
)
# A replay (docs/decisions/021-authorized-when-published.md): under the replay lock
# (`REPLAY_LOCK`, in the same transaction), unless a replay of the queue is still in
# flight (its copies not yet published) and unless the window holds more than $9 copies,
# a new pending copy, marked as a replay, of each event accepted in [$5, $6) (of the
# object types $7, or all for NULL) that had a copy for the queue and that the queue's
# owner may receive now (each recording the epoch it was judged under), in the order of
# each event's first copy (acceptance order). The copies fall due $10 seconds apart,
# behind every replay copy still pending anywhere: all replays together add at most 1/$10
# copies a second to the relay's claims, so live copies (due when accepted) are never
# queued behind a replay. Returned: the copies of a replay
# in flight and its oldest copy's time, the window's copies, the copies added.
REPLAY_LOCK = "SELECT pg_advisory_xact_lock($1)"
ADD_REPLAYS = (
    """
WITH running AS (
    SELECT count(*) AS copies, min(created) AS since FROM deliveries
    WHERE (queue_uuid = $3::uuid OR consumer_uuid = $4::uuid) AND replay
        AND state IN ('pending', 'parked')
), base AS (
    SELECT greatest($8::timestamptz, max(next_attempt_at)) AS at FROM deliveries
    WHERE state = 'pending' AND replay AND claimed_by IS NULL
), firsts AS (
    SELECT min(d.id) AS first_id, d.event_id, coalesce(d.offering_uuid, e.offering_uuid) AS o,
           d.offering_uuid, e.project_uuid AS p, e.subject_user_uuid AS s
    FROM deliveries d JOIN events e ON e.event_id = d.event_id
    WHERE d.vhost = $1 AND d.queue_name = $2 AND NOT d.replay
        AND e.accepted >= $5 AND e.accepted < $6
        AND ($7::varchar[] IS NULL OR e.object_type = ANY($7::varchar[]))
    GROUP BY d.event_id, coalesce(d.offering_uuid, e.offering_uuid), d.offering_uuid,
        e.project_uuid, e.subject_user_uuid
), allowed AS (
    SELECT f.first_id, f.event_id, f.offering_uuid FROM firsts f
    WHERE """  # noqa: S608 - the module's constants
    + authorized_sql("$3::uuid", "$4::uuid", "f.o", "$8::timestamptz", "f.p", "f.s")
    + """
), added AS (
    INSERT INTO deliveries (event_id, queue_uuid, consumer_uuid, queue_name, vhost,
                            offering_uuid, state, attempts, next_attempt_at, created, replay,
                            judged_epoch, webhook)
    SELECT event_id, $3::uuid, $4::uuid, $2::varchar, $1::varchar, offering_uuid, 'pending',
           0,
           (SELECT at FROM base)
               + make_interval(secs => (row_number() OVER (ORDER BY first_id) - 1) * $10::float8),
           $8::timestamptz, true, """
    + EPOCH_SQL
    + ", "
    + webhook_copy_sql("$4::uuid", "$2::varchar")
    + """
    FROM allowed
    WHERE (SELECT copies FROM running) = 0 AND (SELECT count(*) FROM allowed) <= $9
    ORDER BY first_id
    RETURNING 1
)
SELECT (SELECT copies FROM running), (SELECT since FROM running),
       (SELECT count(*) FROM allowed), (SELECT count(*) FROM added)
"""
)

# A resync (contract §13): the role snapshots given ($1 event ids, $3 payloads, one
# `user_role` event each, with its scope keys: the role's offering $2 or project $4, and
# its user $5), written as new events with one pending copy each for the consumer $7
# alone (queue name $8, vhost $9), of those its owner may receive now (the rule of every
# publish, `authorized_sql`, under the epoch recorded): nothing is written for the others.
# The copies are due at
# $6, in the order given, marked `webhook` ($10) when the consumer receives by HTTP; the
# `deliveries` trigger announces them. Event ids are new per resync, so `ON CONFLICT`
# never drops one. Returned: the copies written.
ADD_RESYNC = (
    """
WITH given AS (
    SELECT * FROM unnest($1::varchar[], $2::uuid[], $3::json[], $4::uuid[], $5::uuid[])
        WITH ORDINALITY AS r(event_id, offering_uuid, payload, project_uuid, subject_uuid,
                             position)
), allowed AS (
    SELECT r.* FROM given r
    WHERE """  # noqa: S608 - the module's constants
    + authorized_sql(
        "NULL::uuid",
        "$7::uuid",
        "r.offering_uuid",
        "$6::timestamptz",
        "r.project_uuid",
        "r.subject_uuid",
    )
    + """
), new_events AS (
    INSERT INTO events (event_id, offering_uuid, object_type, payload, queued,
                        skipped_unregistered, accepted, project_uuid, subject_user_uuid)
    SELECT event_id, offering_uuid, 'user_role', payload, 1, 0, $6::timestamptz,
           project_uuid, subject_uuid
    FROM allowed ORDER BY position
    ON CONFLICT DO NOTHING
    RETURNING event_id
), copies AS (
    INSERT INTO deliveries (event_id, consumer_uuid, queue_name, vhost, state, attempts,
                            next_attempt_at, created, judged_epoch, webhook)
    SELECT a.event_id, $7::uuid, $8::varchar, $9::varchar, 'pending', 0, $6::timestamptz,
           $6::timestamptz, """
    + EPOCH_SQL
    + """, $10::boolean
    FROM allowed a WHERE a.event_id IN (SELECT event_id FROM new_events)
    ORDER BY a.position
    RETURNING 1
)
SELECT count(*) FROM copies
"""
)


# --- the webhook dispatcher's (docs/decisions/026-webhooks-on-the-outbox.md) --------------
# Claims run one at a time across every dispatcher (`WEBHOOK_CLAIM_LOCK`, then the claim, in
# one transaction), so two never take one consumer's copies side by side and deliver them
# out of order; each runs with a snapshot taken after the lock. Per webhook consumer not
# gone, by its oldest pending copy (acceptance order), only if that copy is due: a copy held
# by a dispatcher (its lease) or waiting for its retry holds back the consumer's later ones.
# Up to $2 of each consumer's pending copies, the run of due ones from its oldest; up to
# $5 consumers, those waiting longest first, none of $6 (those whose destination is busy).
# Judged (`_JUDGED`) and leased as `CLAIM` does; the consumer's URL and secret come with
# each copy.
# BEGIN and the lock in one round trip (a simple query; the key is the module's constant).
# The claim's plan is generic from its first execution: planned for its parameters (the
# first five executions on each connection, or for good if PostgreSQL keeps judging a
# custom plan cheaper) it took 30 ms to plan, against 1.8 ms to run generic (measured in
# the test harness, a few consumers; docs/decisions/026-webhooks-on-the-outbox.md).
WEBHOOK_CLAIM_LOCK = (
    "BEGIN; SET LOCAL plan_cache_mode = force_generic_plan;"
    f" SELECT pg_advisory_xact_lock({lock_key('webhook-claims')})"
)
COMMIT = "COMMIT"
_WEBHOOK_PENDING = "state = 'pending' AND webhook"
# A copy the claim may take without the rule in its plan: proven judged under the directory
# as it stands (`unchanged_sql` against the statement's own `access` row).
_HEAD_UNCHANGED = unchanged_sql("h.judged_epoch", "h.created", "ax")
_ROW_UNCHANGED = unchanged_sql("f.judged_epoch", "f.created", "ax")


def _webhook_claim(unchanged_only: bool) -> str:
    """The claim; with `unchanged_only`, of consumers whose due copies are all proven
    unchanged since their last judgment (the run stops at the first that is not), so the
    statement leaves the rule out of its plan altogether: starting the executor on the
    rule's plan (hundreds of subplan nodes) took 1.5-3 ms a claim, the claim's own work
    0.15 ms. The proof is the statement's own (its snapshot's epoch and expiries), never the
    read of due heads before it (docs/decisions/029-judged-as-it-leaves.md)."""
    head_unchanged = f" AND {_HEAD_UNCHANGED}" if unchanged_only else ""
    row_unchanged = f" AND {_ROW_UNCHANGED}" if unchanged_only else ""
    judged = _JUDGED.format(now="$1::timestamptz")
    if unchanged_only:
        judged = "d.id, ax.epoch, true AS ok"
    return (
        "\nWITH "  # noqa: S608 - the module's constants
        + _ACCESS.format(now="$1::timestamptz")
        + """, heads AS (
    SELECT c.uuid, h.id FROM event_consumers c
    CROSS JOIN LATERAL (
        SELECT id, next_attempt_at, judged_epoch, created FROM deliveries
        WHERE """
        + _WEBHOOK_PENDING
        + """ AND consumer_uuid = c.uuid
        ORDER BY id LIMIT 1
    ) h
    CROSS JOIN access ax
    WHERE c.delivery = 'webhook' AND c.webhook_gone_at IS NULL AND h.next_attempt_at <= $1
        AND NOT (c.uuid = ANY($6::uuid[]))"""
        + head_unchanged
        + """
    ORDER BY h.id
    LIMIT $5
), due AS (
    SELECT r.id FROM heads
    CROSS JOIN LATERAL (
        SELECT w.id FROM (
            SELECT id, bool_and(next_attempt_at <= $1"""
        + row_unchanged
        + """) OVER (ORDER BY id) AS ready
            FROM (
                SELECT id, next_attempt_at, judged_epoch, created FROM deliveries
                WHERE """
        + _WEBHOOK_PENDING
        + """ AND consumer_uuid = heads.uuid
                ORDER BY id LIMIT $2
            ) f CROSS JOIN access ax
        ) w WHERE w.ready
    ) r
), judged AS (
    SELECT """
        + judged
        + """, c.webhook_url,
        -- Both secrets while a rotation's window lasts, the new one first (contract §14).
        concat_ws(' ', c.webhook_secret, CASE WHEN c.webhook_previous_until > $1
                  THEN c.webhook_previous_secret END) AS webhook_secret
    FROM due JOIN deliveries d ON d.id = due.id JOIN events e ON e.event_id = d.event_id
    JOIN event_consumers c ON c.uuid = d.consumer_uuid
    CROSS JOIN access ax
)"""
        + _SETTLE_TAKEN.format(relay="$3", until="$4", now="$1", guard="true")
        + """
RETURNING d.id, d.event_id, d.queue_uuid, d.consumer_uuid, d.queue_name, d.vhost,
          d.attempts, d.created, d.last_error, d.offering_uuid, e.offering_uuid,
          e.object_type, e.accepted, e.payload::text, d.replay, d.judged_epoch,
          $1::timestamptz, j.webhook_url, j.webhook_secret, j.ok
"""
    )


# Keyed by whether every due head is proven unchanged (`WEBHOOK_DUE_HEADS`).
WEBHOOK_CLAIM = {only: _webhook_claim(only) for only in (True, False)}
# Before a claim, outside its transaction: how many consumers (not gone, none of $2) have
# a due head at $1 proven unchanged since its judgment, and how many have one that is not.
# Neither: no claim at all (a copy committed after this read is announced, and claimed
# then). Only a hint of which form of the claim to run: the claim proves it again.
WEBHOOK_DUE_HEADS = (
    "\nWITH "  # noqa: S608 - the module's constants
    + _ACCESS.format(now="$1::timestamptz")
    + """
SELECT count(*) FILTER (WHERE x.unchanged), count(*) FILTER (WHERE NOT x.unchanged) FROM (
    SELECT """
    + _HEAD_UNCHANGED
    + """ AS unchanged
    FROM event_consumers c
    CROSS JOIN LATERAL (
        SELECT next_attempt_at, judged_epoch, created FROM deliveries
        WHERE """
    + _WEBHOOK_PENDING
    + """ AND consumer_uuid = c.uuid
        ORDER BY id LIMIT 1
    ) h
    CROSS JOIN access ax
    WHERE c.delivery = 'webhook' AND c.webhook_gone_at IS NULL AND h.next_attempt_at <= $1
        AND NOT (c.uuid = ANY($2::uuid[]))
) x
"""
)
# What one consumer's run of attempts came to, in one statement: the copies delivered
# ($1, published at $2), the one that failed ($4: due again at $5, its error $6), those
# claimed behind it and not attempted ($7: released, not an attempt), each only while this
# dispatcher ($3) still holds it; and the consumer's own facts (contract §13): delivered
# at, failing since the first failure of a run, the last error, gone ($9, a 410).
# Each attempt is recorded on its copy (contract §14): its time, duration and HTTP status
# ($10 ids, $11, $12, $13; a copy missing there is recorded at $2 without them).
WEBHOOK_SETTLE = (
    """
WITH tried AS (
    SELECT * FROM unnest($10::bigint[], $11::timestamptz[], $12::int[], $13::int[])
        AS t(id, at, ms, status)
), delivered AS (
    UPDATE deliveries d SET state = 'published', finished = t.at, claimed_by = NULL,
                            claimed_until = NULL,
        """  # noqa: S608 - the module's constants
    + attempt_logged("t.at", "t.ms", "t.status", "NULL::text")
    + """
    FROM (SELECT x.id, coalesce(t.at, $2) AS at, t.ms, t.status
          FROM unnest($1::bigint[]) AS x(id) LEFT JOIN tried t ON t.id = x.id) t
    WHERE d.id = t.id AND (d.state || '') = 'pending' AND d.claimed_by = $3
    RETURNING d.id
), failed AS (
    UPDATE deliveries d SET next_attempt_at = $5, last_error = $6, claimed_by = NULL,
                            claimed_until = NULL,
        """
    + attempt_logged("t.at", "t.ms", "t.status", "$6::text")
    + """
    FROM (SELECT f.id, coalesce(t.at, $2) AS at, t.ms, t.status
          FROM (SELECT $4::bigint AS id) f LEFT JOIN tried t ON t.id = f.id) t
    WHERE d.id = t.id AND (d.state || '') = 'pending' AND d.claimed_by = $3
    RETURNING d.id
), released AS (
    UPDATE deliveries SET claimed_by = NULL, claimed_until = NULL, next_attempt_at = $2,
                          attempts = attempts - 1
    WHERE id = ANY($7::bigint[]) AND (state || '') = 'pending' AND claimed_by = $3
    RETURNING id
), facts AS (
    UPDATE event_consumers SET
        last_delivered_at = CASE WHEN cardinality($1::bigint[]) > 0 THEN $2
                                 ELSE last_delivered_at END,
        webhook_failing_since = CASE
            WHEN $4::bigint IS NULL AND cardinality($1::bigint[]) > 0 THEN NULL
            WHEN $4::bigint IS NULL THEN webhook_failing_since
            WHEN cardinality($1::bigint[]) > 0 THEN $2
            ELSE coalesce(webhook_failing_since, $2) END,
        last_error = CASE WHEN $4::bigint IS NULL THEN last_error ELSE $6 END,
        last_error_at = CASE WHEN $4::bigint IS NULL THEN last_error_at ELSE $2 END,
        webhook_gone_at = CASE WHEN $9::boolean THEN $2 ELSE webhook_gone_at END
    WHERE uuid = $8 AND (cardinality($1::bigint[]) > 0 OR $4::bigint IS NOT NULL)
    RETURNING 1
)
SELECT (SELECT count(*) FROM delivered), (SELECT count(*) FROM failed),
       (SELECT count(*) FROM released), (SELECT count(*) FROM facts)
"""
)
# Webhook copies no claim will take: those of a deleted consumer (its uuid set null), and
# those past retention ($1) that wait unclaimed (a consumer disabled by a 410), or held by a
# lease that ran out (a dispatcher that died holding a deleted consumer's copy): up to $2,
# given up at $3 with the reason $4 or $5. A copy a dispatcher holds is left to it (the
# guard is read again on the row as the claim left it).
WEBHOOK_GIVE_UP_STRANDED = (
    """
WITH stranded AS (
    SELECT id FROM deliveries
    WHERE state = 'pending' AND webhook AND (claimed_by IS NULL OR claimed_until < $3)
        AND (consumer_uuid IS NULL OR created < $1)
    LIMIT $2
), given_up AS (
    UPDATE deliveries d
    SET """  # noqa: S608 - the module's constants
    + given_up_sql(
        "$3",
        "CASE WHEN d.consumer_uuid IS NULL THEN $4 ELSE $5 END",
        """CASE
            WHEN d.consumer_uuid IS NULL THEN 'consumer_deleted'
            WHEN EXISTS (SELECT 1 FROM event_consumers g
                         WHERE g.uuid = d.consumer_uuid AND g.webhook_gone_at IS NOT NULL)
                THEN 'webhook_gone'
            ELSE 'retention' END""",
    )
    + """
    FROM stranded s
    WHERE d.id = s.id AND (d.state || '') = 'pending'
        AND (d.claimed_by IS NULL OR d.claimed_until < $3)
    RETURNING 1
)
SELECT count(*) FROM given_up
"""
)
# The gauges (contract §13): pending copies and the oldest one's acceptance, per kind of
# consumer (each through its partial index, its predicate written out); the webhook
# consumers failing now and the longest-failing one's start.
WEBHOOK_GAUGES = """
SELECT false, count(*), min(created) FROM deliveries WHERE state = 'pending' AND NOT webhook
UNION ALL
SELECT true, count(*), min(created) FROM deliveries WHERE state = 'pending' AND webhook
UNION ALL
SELECT NULL, count(*), min(webhook_failing_since) FROM event_consumers
WHERE delivery = 'webhook' AND webhook_failing_since IS NOT NULL AND webhook_gone_at IS NULL
"""


def _database_error(sql: str, exc: BaseException, lost: bool) -> DBAPIError:
    """The driver's error as SQLAlchemy would raise it (SQLSTATE class 23: a constraint)."""
    sqlstate = str(getattr(exc, "sqlstate", ""))
    kind = IntegrityError if sqlstate.startswith(_SQLSTATE_CONSTRAINT) else DBAPIError
    return kind(sql, None, exc, hide_parameters=True, connection_invalidated=lost)


class Driver:
    """One pooled connection's asyncpg connection, each statement's failure translated."""

    def __init__(self, connection: AsyncConnection, driver: Any) -> None:
        self.connection = connection
        self.driver = driver

    async def fetch(self, sql: str, *arguments: Any) -> list[Any]:
        return await self.call(send(self.driver, sql, arguments), sql)

    async def execute(self, sql: str) -> None:
        """A simple query without parameters (it may hold several statements)."""
        await self.call(self.driver.execute(sql), sql)

    async def call(self, step: Awaitable[T], sql: str) -> T:
        try:
            return await step
        except Exception as exc:
            lost = self.driver.is_closed()
            if lost:
                await self.lost()
            raise _database_error(sql, exc, lost) from exc
        except BaseException:
            await self.connection.invalidate()  # cancelled mid-statement: its state is unknown
            raise

    async def lost(self) -> None:
        """Let SQLAlchemy see the disconnect itself, on a statement of its own: its handling
        invalidates this connection and every pooled one as old (a server restart killed
        them all), so one request fails, not one per pooled connection."""
        with contextlib.suppress(DBAPIError):
            await self.connection.exec_driver_sql("SELECT 1")
        if not self.connection.invalidated:
            await self.connection.invalidate()


@asynccontextmanager
async def checked_out(engine: AsyncEngine) -> AsyncIterator[Driver]:
    """A connection of `engine`'s pool, on the driver. No transaction around what runs on
    it: each statement stands alone (guarded by the row's state) and commits as it runs."""
    async with engine.connect() as connection:
        pooled = await connection.get_raw_connection()
        driver = Driver(connection, pooled.driver_connection)
        try:
            yield driver
        finally:
            # SQLAlchemy's reset on return rolls back only what it began: a connection left
            # in a transaction (a statement cut off half-way) or closed never goes back.
            raw = driver.driver
            if not connection.invalidated and (raw.is_closed() or raw.is_in_transaction()):
                await connection.invalidate()


class KeptConnection:
    """One connection of `engine`'s pool kept checked out from one use to the next, for a
    caller that uses it one statement at a time (the intake's stores, one group after the
    other): at a backend's pace each event is its own store, and a checkout and return
    through SQLAlchemy's pool per store cost a third of the store's CPU
    (docs/decisions/033-intake-keeps-its-connection.md). The same `checked_out` connection as
    everywhere: a failed use, a connection left closed or inside a transaction, one unused
    for `idle_seconds` or held for `held_seconds` goes back to the pool (which recycles it
    as its own rules say) and the next use checks out another."""

    def __init__(
        self, engine: AsyncEngine, *, idle_seconds: float = 5.0, held_seconds: float = 300.0
    ) -> None:
        self.engine = engine
        self.idle_seconds = idle_seconds
        self.held_seconds = held_seconds
        self._stack: AsyncExitStack | None = None
        self._driver: Driver | None = None
        self._since = self._used = 0.0

    @asynccontextmanager
    async def use(self) -> AsyncIterator[Driver]:
        now = time.monotonic()
        if self._driver is not None and (
            now - self._used > self.idle_seconds or now - self._since > self.held_seconds
        ):
            await self.release()
        if self._driver is None:
            stack = AsyncExitStack()
            self._driver = await stack.enter_async_context(checked_out(self.engine))
            self._stack, self._since = stack, now
        driver, kept = self._driver, False
        try:
            yield driver
            raw = driver.driver
            kept = not (driver.connection.invalidated or raw.is_closed() or raw.is_in_transaction())
        finally:
            if kept:
                self._used = time.monotonic()
            else:
                await self.release()

    async def release(self) -> None:
        """Give the connection back to the pool (at once: the process is stopping, or the
        connection failed)."""
        stack, self._stack, self._driver = self._stack, None, None
        if stack is not None:
            await stack.aclose()


class KeptAccess:
    """`ACCESS` on a `KeptConnection`: for a holder that reads the epoch before every post
    of a run (the webhook dispatcher, docs/decisions/029-judged-as-it-leaves.md), a pool
    checkout per read cost more than the read; on a kept connection the statement is
    prepared once (asyncpg's statement cache). `release` gives it back (the dispatcher,
    when it has no run left). One read at a time."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._connection = KeptConnection(engine)
        self._lock = asyncio.Lock()

    async def read(self, now: datetime) -> tuple[int, datetime | None]:
        async with self._lock, self._connection.use() as driver:
            ((epoch, expired),) = await driver.fetch(ACCESS, now)
        return int(epoch), expired

    async def release(self) -> None:
        async with self._lock:
            await self._connection.release()


EVENT_COLUMNS = (
    "event_id",
    "offering_uuid",
    "offering_uuids",
    "object_type",
    "payload",
    "user_uuids",
    "queued",
    "skipped_unregistered",
    "accepted",
    "project_uuid",
    "subject_user_uuid",
)
# Encoded here; `payload` comes encoded already (the store sends the same text on).
_JSON_COLUMNS = frozenset({"offering_uuids", "user_uuids"})
DELIVERY_COLUMNS = (
    "event_id",
    "queue_uuid",
    "consumer_uuid",
    "queue_name",
    "vhost",
    "offering_uuid",
    "state",
    "attempts",
    "claimed_by",
    "claimed_until",
    "next_attempt_at",
    "created",
)


def _json_text(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def column_values(row: Mapping[str, Any], columns: Sequence[str]) -> list[Any]:
    """The row's values in the INSERT's order; json columns as text (`payload` is given as
    its JSON text)."""
    return [_json_text(row[name]) if name in _JSON_COLUMNS else row[name] for name in columns]


def column_arrays(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> list[list[Any]]:
    """The rows as one array per column, in the INSERT's order; json columns as text."""
    return [
        [_json_text(row[name]) for row in rows]
        if name in _JSON_COLUMNS
        else [row[name] for row in rows]
        for name in columns
    ]


def _decoded(value: Any) -> Any:
    # SQLAlchemy's asyncpg dialect installs a json codec on its connections (text in,
    # objects out); asyncpg's own hands json back as text.
    return json.loads(value) if isinstance(value, str) else value


# (offerings, object types, projects, subject users)
_Key = tuple[frozenset[Any], frozenset[str], frozenset[Any], frozenset[Any]]
_NO_KEY: _Key = (frozenset(), frozenset(), frozenset(), frozenset())
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class RecipientCache:
    """The recipients' rows of recent stores by (offerings, object types), with their digest
    (docs/decisions/020-recipient-digest.md). Remembered rows are never trusted alone: the
    write that uses them reads the recipients again in the same statement and writes nothing
    unless their digest is unchanged, so a revoked token, access or queue stops receiving as
    at once as when every store read them first. Only rows that name every offering asked
    about are kept (an unknown offering is refused from a fresh read, never a remembered one)."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._entries: dict[_Key, tuple[str, list[tuple[Any, ...]]]] = {}

    def get(self, key: _Key) -> tuple[str, list[tuple[Any, ...]]] | None:
        return self._entries.get(key)

    def put(self, key: _Key, digest: str, rows: list[tuple[Any, ...]]) -> None:
        if len(self._entries) >= self.size:
            del self._entries[next(iter(self._entries))]  # the oldest
        self._entries[key] = (digest, rows)

    def drop(self, key: _Key) -> None:
        self._entries.pop(key, None)


class StoreUnit:
    """The store's statements, on one connection: read the recipients (or remember them),
    then write."""

    def __init__(self, driver: Driver, cache: RecipientCache) -> None:
        self.driver = driver
        self.cache = cache
        self._read: (
            tuple[_Key, list[Any], list[str], list[Any], list[Any], datetime, str] | None
        ) = None
        # The access epoch the last insert's copies were judged under (its own snapshot's).
        self.judged_epoch: int | None = None

    async def recipients(
        self,
        offerings: Collection[Any],
        object_types: Collection[str],
        now: datetime,
        projects: Collection[Any] = (),
        subjects: Collection[Any] = (),
    ) -> list[tuple[Any, ...]]:
        """(offering, kind, recipient, owner, filter, queue, object type, name, vhost)."""
        key = (
            frozenset(offerings),
            frozenset(object_types),
            frozenset(projects),
            frozenset(subjects),
        )
        asked, types, in_projects, about = list(key[0]), list(key[1]), list(key[2]), list(key[3])
        remembered = self.cache.get(key)
        if remembered is None:
            records = await self.driver.fetch(
                RECIPIENTS[bool(in_projects or about)], asked, types, now, in_projects, about
            )
            rows = [(*r[:4], _decoded(r[4]), *r[5:9]) for r in records]
            digest = records[0][9] if records else _EMPTY_DIGEST
            # Only rows that know every entity asked about are remembered.
            if (
                {row[0] for row in rows if row[0] is not None} == key[0]
                and {row[2] for row in rows if row[1] == "known_project"} == key[2]
                and {row[2] for row in rows if row[1] == "known_user"} == key[3]
            ):
                self.cache.put(key, digest, rows)
        else:
            digest, rows = remembered
        self._read = (key, asked, types, in_projects, about, now, digest)
        return rows

    async def event_counts(self, event_ids: Collection[str]) -> dict[str, tuple[int, int]]:
        records = await self.driver.fetch(EVENT_COUNTS, list(event_ids))
        return {record[0]: (record[1], record[2]) for record in records}

    async def insert(
        self,
        events: Sequence[Mapping[str, Any]],
        copies: Sequence[Mapping[str, Any]],
    ) -> tuple[set[str], list[tuple[Any, ...]]]:
        """Insert the events whose id is new and the copies of those (the others' copies
        are dropped), in one statement, if the recipients read by `recipients` are still
        the recipients (else `RecipientsChanged`, nothing written); returns the new event
        ids and (id, event_id, queue_uuid, consumer_uuid) of each copy inserted."""
        # Without a read first (a test's own rows) nothing is checked: no offerings asked.
        key, asked, types, in_projects, about, now, digest = self._read or (
            _NO_KEY,
            [],
            [],
            [],
            [],
            _EPOCH,
            _EMPTY_DIGEST,
        )
        one = len(events) == 1 and len(copies) == 1
        rows = (
            column_values(events[0], EVENT_COLUMNS) + column_values(copies[0], DELIVERY_COLUMNS)
            if one
            else column_arrays(events, EVENT_COLUMNS) + column_arrays(copies, DELIVERY_COLUMNS)
        )
        records = await self.driver.fetch(
            INSERT_ACCEPTED[bool(in_projects or about), one],
            asked,
            types,
            now,
            in_projects,
            about,
            digest,
            *rows,
        )
        found = next(record for record in records if record[0] == "g")
        if found[1] != digest:
            self.cache.drop(key)
            raise RecipientsChanged
        self.judged_epoch = found[2]
        inserted = {record[1] for record in records if record[0] == "e"}
        copied = [(r[2], r[1], r[3], r[4]) for r in records if r[0] == "d"]
        return inserted, copied


async def listen(
    engine: AsyncEngine,
    channel: str,
    callback: Callable[[], None],
    until: asyncio.Event,
    payloads: Callable[[str], None] | None = None,
    ready: Callable[[], None] | None = None,
) -> None:
    """Call `callback` (after `payloads` with the payload) on every NOTIFY on `channel`
    until `until` is set (`ready` once listening), holding one
    connection of `engine`'s pool. Returns when the connection is lost (the caller listens
    again) or at `until`. asyncpg does the LISTEN; SQLAlchemy has no API for it."""
    lost = asyncio.Event()
    async with engine.connect() as connection:
        raw = await connection.get_raw_connection()
        driver: Any = raw.driver_connection

        def on_notify(*args: object) -> None:
            if payloads is not None:  # asyncpg: (connection, pid, channel, payload)
                payloads(str(args[3]) if len(args) > 3 else "")
            callback()

        def on_lost(*_args: object) -> None:
            lost.set()

        await driver.add_listener(channel, on_notify)
        driver.add_termination_listener(on_lost)
        if ready is not None:
            ready()
        try:
            stop, gone = asyncio.ensure_future(until.wait()), asyncio.ensure_future(lost.wait())
            try:
                await asyncio.wait({stop, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                gone.cancel()
        finally:
            driver.remove_termination_listener(on_lost)
            if not lost.is_set() and not driver.is_closed():
                await driver.remove_listener(channel, on_notify)


# --- a request's writes of copies, in its own transaction -----------------------------------
# A service that decides a copy's fate (a revocation, a consumer deleted or narrowed, a webhook
# fixed) writes it in the unit of work that decided it: `outbox.py` runs these through the
# caller's session, so they commit or roll back with the rest of it
# (docs/decisions/032-one-owner-of-copy-state.md). Not hot: one per request, not per copy.


# The copies not yet on the broker (pending or parked) of the consumers $1 and the
# subscription queues $2, given up at $3 with the reason $4 and the code $5: of the offering
# $6 alone (a fan-out copy names its own offering, any other is its event's; NULL: of any
# offering), and with $7 only those whose owner may no longer receive them by the rule of
# every publish (`authorized_sql`, docs/decisions/021-authorized-when-published.md).
# Returned: how many.
GIVE_UP_WAITING = (
    """
WITH given_up AS (
    UPDATE deliveries d SET """  # noqa: S608 - the module's constants
    + given_up_sql("$3::timestamptz", "$4::text", "$5::varchar")
    + """
    FROM events e
    WHERE (d.consumer_uuid = ANY($1::uuid[]) OR d.queue_uuid = ANY($2::uuid[]))
        AND d.state IN ('pending', 'parked') AND e.event_id = d.event_id
        AND ($6::uuid IS NULL OR coalesce(d.offering_uuid, e.offering_uuid) = $6::uuid)
        AND NOT ($7::boolean AND """
    + authorized_sql(
        "d.queue_uuid",
        "d.consumer_uuid",
        "coalesce(d.offering_uuid, e.offering_uuid)",
        "$3::timestamptz",
        "e.project_uuid",
        "e.subject_user_uuid",
    )
    + """)
    RETURNING 1
)
SELECT count(*) FROM given_up
"""
)
# A webhook consumer's ($1) pending copies fall due at $2. Not those a dispatcher holds:
# their due time is their lease's end (docs/decisions/026-webhooks-on-the-outbox.md).
# `state = 'pending' AND webhook` written out: ix_deliveries_webhook_pending's predicate.
# Announced on the channel $3 (outbox.WEBHOOKS_DUE_CHANNEL) with the consumer, as the
# insert's trigger announces new copies, at the commit (docs/decisions/034-idle-polls.md),
# whenever it has such copies: those accepted while it was gone are due already, and it is
# the update (the block lifted) that makes them deliverable, not a due time moved. The
# outer query reads the statement's snapshot: the copies `due` moves are among them.
WEBHOOK_DUE_NOW = """
WITH due AS (
    UPDATE deliveries SET next_attempt_at = $2
    WHERE consumer_uuid = $1 AND state = 'pending' AND webhook AND claimed_by IS NULL
        AND next_attempt_at > $2
    RETURNING 1
)
SELECT pg_notify($3, $1::text)
WHERE EXISTS (
    SELECT 1 FROM deliveries
    WHERE consumer_uuid = $1 AND state = 'pending' AND webhook AND claimed_by IS NULL
)
"""
# Retention (contract §11), on the outbox's own connection, each page committed as it runs:
# up to $2 events accepted before $1 whose copies all settled before it, deleted (their copies
# go with them: the foreign key cascades). A copy settled since, such as one given up for
# retention just now, keeps its event listed for another period. Returned: how many.
PRUNE_EVENTS = """
WITH old AS (
    SELECT ev.event_id FROM events ev
    WHERE ev.accepted < $1 AND NOT EXISTS (
        SELECT 1 FROM deliveries d
        WHERE d.event_id = ev.event_id
            AND (d.state IN ('pending', 'parked') OR d.finished >= $1))
    LIMIT $2
), pruned AS (
    DELETE FROM events WHERE event_id IN (SELECT event_id FROM old)
    RETURNING 1
)
SELECT count(*) FROM pruned
"""
