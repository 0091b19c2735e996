"""The operator's view of the queues: every registered queue (subscriptions' and consumers')
joined with the broker's view, plus the `subscription_*` and `consumer_*` queues nobody
registered. Read-only; the same page-by-page
join as reconcile, so memory holds one page whatever the size."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.broker import topology
from queuekeeper.common.schemas import parse_path_uuid
from queuekeeper.exceptions import BadRequest, shown
from queuekeeper.jobs.runs import JobContext
from queuekeeper.presence import service as presence
from queuekeeper.presence.schemas import QueueStatusFields
from queuekeeper.reconcile import repository
from queuekeeper.reconcile.listing import VIEW_COLUMNS, ListedQueue, vhost_queues
from queuekeeper.reconcile.schemas import QueueState, QueueStateOut


@dataclass(frozen=True)
class QueueFilter:
    vhost: str | None = None
    state: QueueState | None = None
    subscription_uuid: str | None = None  # hex
    offering_uuid: str | None = None  # hex
    object_type: str | None = None

    def accepts(self, entry: QueueStateOut) -> bool:
        if self.state is not None and entry.state is not self.state:
            return False
        if self.subscription_uuid and _hex(entry.event_subscription_uuid) != self.subscription_uuid:
            return False
        if self.offering_uuid and _hex(entry.offering_uuid) != self.offering_uuid:
            return False
        return not (self.object_type and entry.object_type != self.object_type)


def _hex(value: object) -> str | None:
    return getattr(value, "hex", None) if value is not None else None


def _entry(context: JobContext, vhost: str, queue: ListedQueue) -> QueueStateOut | None:
    row, broker = queue.row, queue.broker
    if row is None and not topology.is_registered_kind(queue.name):
        return None  # the dead-letter queue (see /api/admin/dead-letters/) or not ours
    found = context.provisioner.differences(broker) if broker else []
    if row is None:
        status = QueueState.UNREGISTERED
    elif broker is None:
        status = QueueState.MISSING
    else:
        status = QueueState.DRIFTED if found else QueueState.OK
    return QueueStateOut.from_row(vhost, queue.name, status, row, broker, found)


async def queue_states(context: JobContext, wanted: QueueFilter) -> AsyncIterator[QueueStateOut]:
    """Every queue, vhost by vhost in name order, then queue name order."""
    await context.provisioner.identify()
    broker_vhosts = {info.name: info for info in await context.management.list_vhosts()}
    owned = {name for name, info in broker_vhosts.items() if context.provisioner.owns(info)}
    async with repository.reader(context.engine) as reader:
        registered_in = await repository.queue_vhosts(reader)
        vhosts = sorted(owned | registered_in)
        if wanted.vhost is not None:
            vhosts = [vhost for vhost in vhosts if vhost == wanted.vhost]
        for vhost in vhosts:
            if vhost in broker_vhosts and vhost not in owned:
                async for entry in _foreign(reader, context.settings.reconcile_page_size, vhost):
                    if wanted.accepts(entry):
                        yield entry
                continue
            async for batch in vhost_queues(
                context.management,
                reader,
                vhost,
                page_size=context.settings.reconcile_page_size,
                columns=VIEW_COLUMNS,
            ):
                for queue in batch:
                    listed = _entry(context, vhost, queue)
                    if listed is not None and wanted.accepts(listed):
                        yield listed


async def _foreign(reader: AsyncSession, page: int, vhost: str) -> AsyncIterator[QueueStateOut]:
    after: str | None = None
    while True:
        rows = await repository.rows_in_range(reader, vhost, after, page)
        for row in rows:
            yield QueueStateOut.from_row(vhost, row.name, QueueState.FOREIGN_VHOST, row, None, [])
        if len(rows) < page:
            return
        after = rows[-1].name


def _hex_filter(value: str | None, name: str) -> str | None:
    """A uuid filter as hex; absent is no filter, and empty is a 400 like any other
    malformed uuid (it once listed every row)."""
    if value is None:
        return None
    parsed = parse_path_uuid(value)
    if parsed is None:
        raise BadRequest(f"{name} {shown(value)} is not a uuid (hex or dashed form).", field=name)
    return parsed.hex


async def queue_page(
    context: JobContext,
    offset: int,
    limit: int,
    *,
    vhost: str | None = None,
    state: QueueState | None = None,
    event_subscription_uuid: str | None = None,
    offering_uuid: str | None = None,
    object_type: str | None = None,
) -> tuple[int, list[QueueStateOut]]:
    """The total that match, and the entries [offset, offset + limit)."""
    wanted = QueueFilter(
        vhost=_hex_filter(vhost, "vhost"),
        state=state,
        subscription_uuid=_hex_filter(event_subscription_uuid, "event_subscription_uuid"),
        offering_uuid=_hex_filter(offering_uuid, "offering_uuid"),
        object_type=object_type,
    )
    total, page = 0, []
    async for entry in queue_states(context, wanted):
        if offset <= total < offset + limit:
            page.append(entry)
        total += 1
    return total, await with_status(context, page)


async def with_status(context: JobContext, page: list[QueueStateOut]) -> list[QueueStateOut]:
    """The page's registered queues with why each is silent (contract §11): asked for the
    page only, so the cost follows the page size, not the number of queues."""
    keys = [
        (entry.vhost, entry.queue_name)
        for entry in page
        if entry.registered and entry.state is not QueueState.FOREIGN_VHOST
    ]
    if not keys:
        return page
    async with context.sessions() as session:
        found = await presence.statuses_of(session, context.provisioner, context.settings, keys)
    fields = list(QueueStatusFields.model_fields)
    return [
        entry.model_copy(update={name: getattr(status, name) for name in fields})
        if (status := found.get((entry.vhost, entry.queue_name))) is not None
        else entry
        for entry in page
    ]
