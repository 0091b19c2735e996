"""The `sweep_access` job: copies already in a broker queue leave it when access ends
(contract §14; docs/decisions/030-queued-copies-on-every-access-loss.md).

Whatever ends access (a role deleted, moved or expired, a user demoted, deactivated or
without a token, a grant removed, an offering, customer or project deleted, a consumer's
bindings narrowed), a trigger of migration 0016_access_changes records in the same
transaction whose queued copies to judge again (`access_sweeps`) and announces it on
`ACCESS_CHANNEL`. Expiries that arrive by time alone change no row: the job finds them
itself, as the roles and tokens whose `expires_at` passed since its last run. Every path
ends in the one sieve (`service.remove_unauthorized_copies`), judged by the rule copies
are published by.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta

from queuekeeper.consumers import repository, service
from queuekeeper.events.outbox_postgres import listen
from queuekeeper.jobs.runs import JobContext, Run
from queuekeeper.models import utcnow

# NOTIFYed by the triggers of migration 0016_access_changes.
ACCESS_CHANNEL = "queuekeeper_access"


def _oldest_expiry(context: JobContext, now: datetime) -> datetime:
    """Before any watermark (a new installation): expiries within a queue's message time to
    live, the oldest whose copies can still be in a queue."""
    return now - timedelta(milliseconds=context.settings.queue_message_ttl_ms)


async def nothing_to_sweep(context: JobContext) -> bool:
    """The scheduled run's look first: True when a run would find no change and no expiry.
    One read, where a run takes the job's lock, writes its record and deletes it again and
    moves the watermark (docs/decisions/030-queued-copies-on-every-access-loss.md)."""
    async with context.sessions() as session:
        now = utcnow()
        return await repository.nothing_to_sweep(session, now, _oldest_expiry(context, now))


async def sweep_access(context: JobContext, run: Run) -> None:
    """Take the pending access changes and the expiries passed since the last run, sieve
    the queues of their owners (every owner's for a change of an offering, customer or
    project), then forget the changes handled. A queue that could not be read through
    leaves a row for its owner, so the next run tries it again; nothing is forgotten
    before its sieve ran."""
    async with context.sessions() as session:
        now = utcnow()
        pending = await repository.pending_sweeps(session)
        after = await repository.expiry_watermark(session) or _oldest_expiry(context, now)
        expired = await repository.expired_between(session, after, now)
        await session.commit()
        owners = None if pending.every else pending.owners | expired
        if owners is None:
            run.find("every_owner")
        else:
            run.find("owners", len(owners))
        run.find("expired_owners", len(expired))
        swept = await service.remove_unauthorized_copies(
            session, context.provisioner, owners, on_failure=run.fail
        )
        run.find("queues_holding_refused_copies", swept.queues)
        if swept.removed:
            run.changed["copies_removed"] += swept.removed
        await repository.sweeps_done(session, pending.ids, now, swept.failed_owners)
        await session.commit()


async def on_access_change(
    context: JobContext, wake: Callable[[], None], until: asyncio.Event
) -> None:
    """The job's wake source: a NOTIFY on `ACCESS_CHANNEL`, so a revocation's queued copies
    usually go within a second, not an interval later."""
    await listen(context.engine, ACCESS_CHANNEL, wake, until)
