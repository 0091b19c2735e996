"""A vhost's queues as the broker lists them, joined with the rows that registered them.

Two streams sorted by name (RabbitMQ compares names byte by byte; the database
is asked to do the same) are merged like a sort-merge join: the broker's
queues, a page of 500 at a time, and the registered rows, 500 at a time by
keyset. A name in both is a registered queue present on the broker; only in
the broker's stream, a queue nobody registered; only in the database's, a
registered queue the broker lacks. The database is asked once per 500 rows,
memory holds a page of each, and the first database query runs while the
broker prepares its first page.

Pages are offsets into a list that can change between two calls (queues
created or deleted meanwhile), so a queue may be listed twice (the repeat is
dropped), not at all (the next run sees it), or a registered queue may look
absent: callers confirm an absence before acting on it, and re-check an orphan
against the database before deleting it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from itertools import pairwise

from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.broker.management import ManagementClient, QueueInfo
from queuekeeper.reconcile import repository
from queuekeeper.reconcile.repository import QueueRow

# What reconcile needs; no statistics, so the broker can skip computing them.
RECONCILE_COLUMNS = "name,arguments,durable,auto_delete"
VIEW_COLUMNS = (
    "name,arguments,durable,auto_delete,messages,messages_ready,messages_unacknowledged,consumers"
)


class UnsortedListing(Exception):
    """The broker's page was not in byte order of names: the merge would be wrong."""


@dataclass(frozen=True)
class ListedQueue:
    name: str
    broker: QueueInfo | None  # the broker's entry; None: registered but not listed
    row: QueueRow | None  # the registration; None: on the broker, not registered


async def _row_chunks(
    reader: AsyncSession, vhost: str, chunk: int
) -> AsyncGenerator[list[QueueRow], None]:
    """The vhost's registered queues in name order, `chunk` at a time."""
    after: str | None = None
    while True:
        rows = await repository.rows_in_range(reader, vhost, after, chunk)
        if rows:
            yield rows
        if len(rows) < chunk:
            return
        after = rows[-1].name


async def _broker_pages(
    management: ManagementClient, vhost: str, page_size: int, columns: str
) -> AsyncGenerator[list[QueueInfo], None]:
    """The vhost's queues in name order, a page at a time, each name once."""
    last: str | None = None
    page = 1
    while True:
        body = await management.list_queues_page(
            vhost,
            page=page,
            page_size=page_size,
            columns=columns,
            sort="name",
        )
        entries = [
            item
            for item in body.items
            if last is None or item.name > last  # else: listed again after a shift
        ]
        names = [entry.name for entry in entries]
        if any(a >= b for a, b in pairwise(names)):
            raise UnsortedListing(
                f"the broker listed the queues of vhost {vhost!r} out of name order; "
                "reconcile cannot join them with the database safely"
            )
        if entries:
            last = names[-1]
            yield entries
        if page >= body.page_count:
            return
        page += 1


async def vhost_queues(
    management: ManagementClient,
    reader: AsyncSession,
    vhost: str,
    *,
    page_size: int,
    columns: str = RECONCILE_COLUMNS,
) -> AsyncIterator[list[ListedQueue]]:
    """Yield the vhost's queues, joined with their registrations, up to a page at a time."""
    async with (
        aclosing(_broker_pages(management, vhost, page_size, columns)) as pages,
        aclosing(_row_chunks(reader, vhost, page_size)) as chunks,
    ):
        async for batch in _merge(pages, chunks, page_size):
            yield batch


async def _merge(
    pages: AsyncIterator[list[QueueInfo]],
    chunks: AsyncIterator[list[QueueRow]],
    page_size: int,
) -> AsyncIterator[list[ListedQueue]]:
    # The first of each at once: the database answers while the broker lists. Both are
    # awaited to the end before an error is raised, so neither is left running.
    first_page, first_rows = await asyncio.gather(
        anext(pages, None), anext(chunks, None), return_exceptions=True
    )
    for outcome in (first_page, first_rows):
        if isinstance(outcome, BaseException):
            raise outcome
    assert not isinstance(first_page, BaseException)
    assert not isinstance(first_rows, BaseException)
    entries: deque[QueueInfo] = deque(first_page or [])
    rows: deque[QueueRow] = deque(first_rows or [])
    pages_done, rows_done = first_page is None, first_rows is None
    batch: list[ListedQueue] = []
    while True:
        if not entries and not pages_done:
            page = await anext(pages, None)
            pages_done = page is None
            entries.extend(page or [])
        if not rows and not rows_done:
            chunk = await anext(chunks, None)
            rows_done = chunk is None
            rows.extend(chunk or [])
        if not entries and not rows:
            break
        if rows and (not entries or rows[0].name < entries[0].name):
            row = rows.popleft()
            batch.append(ListedQueue(row.name, None, row))
        elif entries and (not rows or entries[0].name < rows[0].name):
            entry = entries.popleft()
            batch.append(ListedQueue(entry.name, entry, None))
        else:
            row, entry = rows.popleft(), entries.popleft()
            batch.append(ListedQueue(row.name, entry, row))
        if len(batch) >= page_size:
            yield batch
            batch = []
    if batch:
        yield batch
