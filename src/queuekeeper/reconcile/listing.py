"""A vhost's queues as the broker lists them, joined with the rows that registered them.

The broker is read page by page, sorted by name (RabbitMQ compares names byte
by byte). Each page covers the name range (end of the previous page, last name
of this page]; the database is asked for the registered queues in exactly that
range, in name order, so one query per page finds both the broker queues nobody
registered and the registered queues the broker lacks, and memory stays at one
page however many queues a vhost holds.

Pages are offsets into a list that can change between two calls (queues
created or deleted meanwhile), so a queue may be seen twice (skipped: its range
is done) or not at all (picked up by the next run), or a registered queue may
look absent: callers confirm an absence before acting on it, and re-check an
orphan against the database before deleting it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from queuekeeper.reconcile import repository
from queuekeeper.reconcile.repository import QueueRow

# What reconcile needs; no statistics, so the broker can skip computing them.
RECONCILE_COLUMNS = "name,arguments,durable,auto_delete"
VIEW_COLUMNS = "name,arguments,durable,auto_delete,messages,consumers"


class UnsortedListing(Exception):
    """The broker's page was not in byte order of names: the range join would be wrong."""


@dataclass(frozen=True)
class ListedQueue:
    name: str
    broker: dict[str, Any] | None  # the broker's entry; None: registered but not listed
    row: QueueRow | None  # the registration; None: on the broker, not registered


def differences(expected_arguments: dict[str, Any], entry: dict[str, Any]) -> list[str]:
    """How a broker entry differs from what a registered queue must be."""
    found = topology.argument_differences(expected_arguments, dict(entry.get("arguments") or {}))
    if entry.get("durable") is not True:
        found.append("durable: expected True")
    if entry.get("auto_delete") is not False:
        found.append("auto_delete: expected False")
    return found


async def _rows(
    sessions: async_sessionmaker[AsyncSession],
    vhost: str,
    after: str | None,
    upto: str | None,
    chunk: int,
) -> AsyncIterator[list[QueueRow]]:
    """Registered queues in (after, upto], `chunk` at a time (more only when many are missing)."""
    while True:
        async with sessions() as session:
            rows = await repository.rows_in_range(session, vhost, after, upto, chunk)
        yield rows
        if len(rows) < chunk:
            return
        after = rows[-1].name


async def vhost_queues(
    management: ManagementClient,
    sessions: async_sessionmaker[AsyncSession],
    vhost: str,
    *,
    page_size: int,
    columns: str = RECONCILE_COLUMNS,
) -> AsyncIterator[list[ListedQueue]]:
    """Yield the vhost's queues, a page at a time, each joined with its registration."""
    covered: str | None = None  # every name <= covered has been yielded
    page = 1
    disable_stats = "messages" not in columns and "consumers" not in columns
    while True:
        body = await management.list_queues_page(
            vhost,
            page=page,
            page_size=page_size,
            columns=columns,
            sort="name",
            disable_stats=disable_stats,
        )
        last = page >= int(body.get("page_count") or 0)
        entries = [
            item
            for item in body.get("items") or []
            if isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and (covered is None or item["name"] > covered)
        ]
        names = [entry["name"] for entry in entries]
        if any(a >= b for a, b in pairwise(names)):
            raise UnsortedListing(
                f"the broker listed the queues of vhost {vhost!r} out of name order; "
                "reconcile cannot join them with the database safely"
            )
        if not last and not names:
            page += 1  # nothing new on this page: its range is empty
            continue
        upto = None if last else names[-1]
        pending = deque(entries)
        async for rows in _rows(sessions, vhost, covered, upto, page_size):
            batch: list[ListedQueue] = []
            for row in rows:
                while pending and pending[0]["name"] < row.name:
                    entry = pending.popleft()
                    batch.append(ListedQueue(entry["name"], entry, None))
                if pending and pending[0]["name"] == row.name:
                    batch.append(ListedQueue(row.name, pending.popleft(), row))
                else:
                    batch.append(ListedQueue(row.name, None, row))
            if len(rows) < page_size:  # the last chunk: what is left was not registered
                batch.extend(ListedQueue(entry["name"], entry, None) for entry in pending)
                pending.clear()
            if batch:
                yield batch
        if last:
            return
        covered = upto
        page += 1
