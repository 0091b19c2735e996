"""Retention (contract §11): what is older than `event_retention_days` goes, page by page.

A parked copy past retention is given up with the reason `retention` (counted, and listed
with the event's copies while the event is kept); then events past retention whose copies
are all settled are deleted with their copies. Each page is its own statement, committed
at once: a run cut short keeps what it did, and the next run goes on.
"""

from __future__ import annotations

from queuekeeper.events.outbox import Outbox
from queuekeeper.jobs.runs import JobContext, Run
from queuekeeper.models import utcnow
from queuekeeper.observability.metrics import COPIES_GIVEN_UP_RETENTION

PAGE = 1000


def count_change(counter: str) -> None:
    if counter == "given_up_retention":
        COPIES_GIVEN_UP_RETENTION.inc()


async def apply_retention(context: JobContext, run: Run) -> None:
    now = utcnow()
    cutoff = now - context.settings.event_retention
    outbox = Outbox(context.engine, context.settings)
    given_up = pruned = 0
    while True:
        page = await outbox.give_up_parked(cutoff, PAGE, now)
        given_up += page
        COPIES_GIVEN_UP_RETENTION.inc(page)
        if page < PAGE:
            break
    while True:
        page = await outbox.prune_events(cutoff, PAGE)
        pruned += page
        if page < PAGE:
            break
    run.find("parked_given_up_retention", given_up)
    run.find("events_pruned", pruned)
