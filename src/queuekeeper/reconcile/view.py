"""The operator's view of the queues: every registered queue (subscriptions' and consumers')
joined with the broker's view, plus the `subscription_*` and `consumer_*` queues nobody
registered. Read-only; the same page-by-page
join as reconcile, so memory holds one page whatever the size."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.broker import topology
from queuekeeper.reconcile import repository
from queuekeeper.reconcile.listing import VIEW_COLUMNS, ListedQueue, differences, vhost_queues
from queuekeeper.reconcile.schemas import QueueStateOut
from queuekeeper.state import AppState


class QueueState(enum.StrEnum):
    OK = "ok"  # registered, present, arguments right
    MISSING = "missing"  # registered, not on the broker
    DRIFTED = "drifted"  # registered, present with other arguments
    UNREGISTERED = "unregistered"  # a `subscription_*` queue on the broker with no row
    FOREIGN_VHOST = "foreign_vhost"  # registered, but its vhost is not ours to look into


@dataclass(frozen=True)
class QueueFilter:
    vhost: str | None = None
    state: QueueState | None = None
    subscription_uuid: str | None = None  # hex
    offering_uuid: str | None = None  # hex
    object_type: str | None = None

    def accepts(self, entry: QueueStateOut) -> bool:
        if self.state is not None and entry.state != self.state.value:
            return False
        if self.subscription_uuid and _hex(entry.event_subscription_uuid) != self.subscription_uuid:
            return False
        if self.offering_uuid and _hex(entry.offering_uuid) != self.offering_uuid:
            return False
        return not (self.object_type and entry.object_type != self.object_type)


def _hex(value: object) -> str | None:
    return getattr(value, "hex", None) if value is not None else None


def _entry(state: AppState, vhost: str, queue: ListedQueue) -> QueueStateOut | None:
    row, broker = queue.row, queue.broker
    if row is None and not topology.is_registered_kind(queue.name):
        return None  # the dead-letter queue (see /api/admin/dead-letters/) or not ours
    found = differences(state.provisioner.queue_arguments, broker) if broker else []
    if row is None:
        status = QueueState.UNREGISTERED
    elif broker is None:
        status = QueueState.MISSING
    else:
        status = QueueState.DRIFTED if found else QueueState.OK
    return QueueStateOut(
        queue_name=queue.name,
        vhost=vhost,
        state=status.value,
        registered=row is not None,
        uuid=row.uuid if row else None,
        event_subscription_uuid=row.subscription_uuid if row else None,
        offering_uuid=row.offering_uuid if row else None,
        object_type=row.object_type if row else None,
        consumer_uuid=row.uuid if row and row.consumer else topology.consumer_of(queue.name),
        present=broker is not None,
        arguments_ok=(not found) if broker is not None else None,
        differences=found,
        messages=broker.get("messages") if broker else None,
        consumers=broker.get("consumers") if broker else None,
    )


async def queue_states(state: AppState, wanted: QueueFilter) -> AsyncIterator[QueueStateOut]:
    """Every queue, vhost by vhost in name order, then queue name order."""
    broker_vhosts = {str(v.get("name")): v for v in await state.management.list_vhosts()}
    owned = {name for name, info in broker_vhosts.items() if state.provisioner.owns(info)}
    async with repository.reader(state.engine) as reader:
        registered_in = await repository.queue_vhosts(reader)
        vhosts = sorted(owned | registered_in)
        if wanted.vhost is not None:
            vhosts = [vhost for vhost in vhosts if vhost == wanted.vhost]
        for vhost in vhosts:
            if vhost in broker_vhosts and vhost not in owned:
                async for entry in _foreign(reader, state.settings.reconcile_page_size, vhost):
                    if wanted.accepts(entry):
                        yield entry
                continue
            async for batch in vhost_queues(
                state.management,
                reader,
                vhost,
                page_size=state.settings.reconcile_page_size,
                columns=VIEW_COLUMNS,
            ):
                for queue in batch:
                    listed = _entry(state, vhost, queue)
                    if listed is not None and wanted.accepts(listed):
                        yield listed


async def _foreign(reader: AsyncSession, page: int, vhost: str) -> AsyncIterator[QueueStateOut]:
    after: str | None = None
    while True:
        rows = await repository.rows_in_range(reader, vhost, after, None, page)
        for row in rows:
            yield QueueStateOut(
                queue_name=row.name,
                vhost=vhost,
                state=QueueState.FOREIGN_VHOST.value,
                registered=True,
                uuid=row.uuid,
                event_subscription_uuid=row.subscription_uuid,
                offering_uuid=row.offering_uuid,
                object_type=row.object_type,
                consumer_uuid=row.uuid if row.consumer else None,
                present=None,
                arguments_ok=None,
                differences=[],
                messages=None,
                consumers=None,
            )
        if len(rows) < page:
            return
        after = rows[-1].name


async def queue_page(
    state: AppState, wanted: QueueFilter, offset: int, limit: int
) -> tuple[int, list[QueueStateOut]]:
    """The total that match, and the entries [offset, offset + limit)."""
    total, page = 0, []
    async for entry in queue_states(state, wanted):
        if offset <= total < offset + limit:
            page.append(entry)
        total += 1
    return total, page
