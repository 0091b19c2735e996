"""The deletion guard: a run that would delete much of what this installation owns stops.

A database restored from an older backup, or pointed at the wrong broker, makes
everything registered since look like an orphan; deleting it would lose queues and
their messages. So a run first adds up what it would delete, and deletes nothing when
that is more than `reconcile_max_deletions` objects or more than
`reconcile_max_delete_share` of what it owns, unless it was started with `force`
(docs/reconcile.md, "The deletion guard"; docs/decisions/001-installation-identity.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import structlog

from queuekeeper.broker.management import ManagementClient
from queuekeeper.jobs.runs import JobContext, Run
from queuekeeper.observability.metrics import RECONCILE_ITEMS

log = structlog.get_logger(__name__)

GUARD_ITEM = "deletion guard"


async def queues_in(management: ManagementClient, vhosts: Iterable[str]) -> dict[str, int]:
    """How many queues each vhost holds (deleting a vhost deletes them all): one call each,
    a page of one queue, whose page count is the number of queues."""
    counts = {}
    for vhost in vhosts:
        page = await management.list_queues_page(vhost, page=1, page_size=1, columns="name")
        counts[vhost] = page.page_count
    return counts


def allows(
    context: JobContext,
    run: Run,
    *,
    owned: int,
    orphan_queues: int = 0,
    vhosts: Mapping[str, int],
    users: int,
) -> bool:
    """True when the run may delete what it planned; otherwise the run is told why not.

    `owned`: every vhost, broker user and registered-kind queue of this installation the
    run saw (those to delete included); `vhosts`: the vhosts to delete and how many queues
    each holds.
    """
    planned = orphan_queues + len(vhosts) + sum(vhosts.values()) + users
    if not planned:
        return True
    settings = context.settings
    share = planned / owned if owned else 1.0
    over = planned > settings.reconcile_max_deletions or (
        share > settings.reconcile_max_delete_share
        and planned > settings.reconcile_deletions_always_allowed
    )
    if not over or run.force:
        if over:
            log.warning("deletion_guard_forced", job=run.job.value, planned=planned, owned=owned)
        return True
    run.find("deletions_held", planned)
    if not run.dry_run:
        RECONCILE_ITEMS.labels(action="deletions_held").inc()
    what = (
        f"{orphan_queues} orphan queues, {len(vhosts)} vhosts holding "
        f"{sum(vhosts.values())} queues, {users} broker users"
    )
    run.fail(
        GUARD_ITEM,
        f"{'a real run would stop: ' if run.dry_run else ''}this run would delete {planned} "
        f"of the {owned} broker objects this installation owns ({what}), more than "
        f"QUEUEKEEPER_RECONCILE_MAX_DELETIONS={settings.reconcile_max_deletions} or "
        f"QUEUEKEEPER_RECONCILE_MAX_DELETE_SHARE={settings.reconcile_max_delete_share:g}"
        f"{'' if run.dry_run else ', so nothing was deleted'}. A database restored from an "
        "older backup, or another installation with the same instance name, looks like "
        "this: see docs/howto/backup-and-restore.md. When these deletions are "
        "intended, run `queuekeeper reconcile --force` (API: ?force=true).",
    )
    return run.dry_run  # a dry run still lists each deletion it would make
