"""Reconcile benchmark: a reconcile run against a raw listing of the same vhosts.

Populates, in one run, 10,000 registered queues over 100 vhosts (100 users, 10
subscriptions each, 10 queues per subscription) plus 1,000 orphans (10 per
vhost), in a PostgreSQL database and under an instance name of its own; then
times

  (a) a raw listing of those vhosts through the Management API: the same
      paginated calls with the same columns, nothing done with the answer;
  (b) a full reconcile run (deletes the 1,000 orphans, nothing else to do) and
      a no-op run (nothing to do at all),

and prints the ratios b/a, the database statements and Management API calls
per run, and the peak memory (tracemalloc) of a no-op run with 1,000 and with
10,000 queues (same users, subscriptions and vhosts: only the number of queues
changes) and of the full run. Removes everything it created.

Run: `make bench` or `python -m bench reconcile`. Takes two to three minutes.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
import tracemalloc
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aio_pika
import httpx
from sqlalchemy import event

from bench._support import bench_database, instance_objects
from queuekeeper.app import JOBS
from queuekeeper.auth.tokens import token_digest
from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.passwords import rabbit_password_hash
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.config import Settings
from queuekeeper.db import create_engine, create_sessionmaker
from queuekeeper.events.payloads import OBJECT_TYPES
from queuekeeper.installation import service as installation
from queuekeeper.jobs.runs import Job, JobContext, JobRunner, Trigger
from queuekeeper.logging import configure_logging
from queuekeeper.models import (
    EventSubscription,
    EventSubscriptionQueue,
    Offering,
    OfferingAccess,
    User,
)
from queuekeeper.reconcile.listing import RECONCILE_COLUMNS
from queuekeeper.state import AppState

VHOSTS = 100
SUBSCRIPTIONS_PER_VHOST = 10
QUEUES_PER_SUBSCRIPTION = 10
ORPHANS_PER_VHOST = 10
PAIRS = 5  # raw listing / no-op run pairs: the broker is shared, so timings wander
ROOT = Path(__file__).resolve().parents[1]


class Counts:
    def __init__(self) -> None:
        self.statements = 0
        self.management = Counter[str]()


@dataclass(kw_only=True)
class BenchState(AppState):
    jobs: JobRunner


def _state(settings: Settings, counts: Counts) -> BenchState:
    engine = create_engine(settings)

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _count(*_args: Any) -> None:
        counts.statements += 1

    def observe(kind: str, status: str, seconds: float) -> None:
        counts.management[kind] += 1

    management = ManagementClient(settings, observer=observe)
    sessions = create_sessionmaker(engine)
    provisioner = Provisioner(management, settings, partial(installation.identity, sessions))
    return BenchState(
        settings=settings,
        engine=engine,
        sessions=sessions,
        management=management,
        provisioner=provisioner,
        jobs=JobRunner(JobContext(settings, engine, sessions, management, provisioner), JOBS),
    )


async def _gather_limited(limit: int, calls: Sequence[Callable[[], Awaitable[Any]]]) -> None:
    semaphore = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        async with semaphore:
            await call()

    await asyncio.gather(*(one(call) for call in calls))


Plan = dict[uuid.UUID, list[uuid.UUID]]  # owner -> its subscriptions


async def populate_subscriptions(
    state: BenchState, offering: uuid.UUID, owners: list[uuid.UUID]
) -> Plan:
    """Users, subscriptions, vhosts and broker users, as queuekeeper would have made them."""
    provisioner = state.provisioner
    plan: Plan = {}
    hashes: dict[uuid.UUID, str] = {}
    users: list[User] = []
    grants: list[OfferingAccess] = []
    subscriptions: list[EventSubscription] = []
    for owner in owners:
        token = secrets.token_hex(20)
        hashes[owner] = rabbit_password_hash(token)
        users.append(
            User(
                uuid=owner,
                username=f"bench-{owner.hex[:8]}",
                token_hash=token_digest(token),
                broker_password_hash=hashes[owner],
            )
        )
        grants.append(OfferingAccess(user_uuid=owner, offering_uuid=offering))
        plan[owner] = [uuid.uuid4() for _ in range(SUBSCRIPTIONS_PER_VHOST)]
        subscriptions.extend(
            EventSubscription(uuid=s, user_uuid=owner, broker_password_hash=hashes[owner])
            for s in plan[owner]
        )
    async with state.sessions() as session:
        # No ORM relationships order the inserts: parents first, by hand.
        for rows in (users, grants, subscriptions):
            session.add_all(rows)
            await session.flush()
        await session.commit()
    await _gather_limited(8, [partial(provisioner.ensure_vhost, owner.hex) for owner in owners])
    await _gather_limited(
        16,
        [
            partial(provisioner.ensure_subscription_user, owner.hex, subscription, hashes[owner])
            for owner, owned in plan.items()
            for subscription in owned
        ],
    )
    return plan


async def populate_queues(
    state: BenchState, offering: uuid.UUID, plan: Plan, object_types: Sequence[str]
) -> None:
    """One registered queue per subscription and object type: rows, then AMQP declares
    (far faster than Management PUTs)."""
    rows = [
        EventSubscriptionQueue(
            uuid=uuid.uuid4(),
            subscription_uuid=subscription,
            offering_uuid=offering,
            object_type=object_type,
            queue_name=topology.queue_name(subscription, offering, object_type),
            vhost=owner.hex,
        )
        for owner, subscriptions in plan.items()
        for subscription in subscriptions
        for object_type in object_types
    ]
    async with state.sessions() as session:
        session.add_all(rows)
        await session.commit()
    arguments = state.provisioner.queue_arguments

    async def declare(owner: uuid.UUID) -> None:
        url = state.settings.amqp_url.rstrip("/") + "/" + quote(owner.hex, safe="")
        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel()
            await asyncio.gather(
                *(
                    channel.declare_queue(
                        topology.queue_name(subscription, offering, object_type),
                        durable=True,
                        arguments=arguments,
                    )
                    for subscription in plan[owner]
                    for object_type in object_types
                )
            )

    await _gather_limited(4, [partial(declare, owner) for owner in plan])


async def add_orphans(state: BenchState, owners: list[uuid.UUID]) -> dict[str, list[str]]:
    """ORPHANS_PER_VHOST unregistered queues in each owner's vhost; their names by vhost."""
    made: dict[str, list[str]] = {}

    async def declare(owner: uuid.UUID) -> None:
        url = state.settings.amqp_url.rstrip("/") + "/" + quote(owner.hex, safe="")
        names = [
            topology.queue_name(uuid.uuid4(), uuid.uuid4(), "order")
            for _ in range(ORPHANS_PER_VHOST)
        ]
        made[owner.hex] = names
        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel()
            await asyncio.gather(
                *(
                    channel.declare_queue(
                        name, durable=True, arguments=state.provisioner.queue_arguments
                    )
                    for name in names
                )
            )

    await _gather_limited(4, [partial(declare, owner) for owner in owners])
    return made


async def raw_deletes(settings: Settings, orphans: dict[str, list[str]]) -> float:
    """The same deletes a reconcile run issues, raw: vhost after vhost, each vhost's
    orphans `reconcile_delete_concurrency` at a time."""
    async with httpx.AsyncClient(
        base_url=settings.management_url.rstrip("/") + "/api",
        auth=(settings.management_user, settings.management_password),
        timeout=60,
    ) as http:

        async def delete(vhost: str, name: str) -> None:
            response = await http.delete(f"/queues/{quote(vhost, safe='')}/{quote(name)}")
            response.raise_for_status()

        started = time.perf_counter()
        for vhost in sorted(orphans):
            await _gather_limited(
                settings.reconcile_delete_concurrency,
                [partial(delete, vhost, name) for name in orphans[vhost]],
            )
        return time.perf_counter() - started


async def raw_listing(settings: Settings, vhosts: list[str]) -> tuple[float, int]:
    """The baseline: the same paginated listing reconcile makes, and nothing else."""
    async with httpx.AsyncClient(
        base_url=settings.management_url.rstrip("/") + "/api",
        auth=(settings.management_user, settings.management_password),
        timeout=60,
    ) as http:
        started = time.perf_counter()
        listed = 0
        for vhost in vhosts:
            page = 1
            while True:
                response = await http.get(
                    f"/queues/{quote(vhost, safe='')}",
                    params={
                        "page": page,
                        "page_size": settings.reconcile_page_size,
                        "columns": RECONCILE_COLUMNS,
                        "pagination": "true",
                        "sort": "name",
                        "disable_stats": "true",
                    },
                )
                response.raise_for_status()
                body = response.json()
                listed += len(body["items"])
                if page >= body["page_count"]:
                    break
                page += 1
        return time.perf_counter() - started, listed


async def timed_run(state: BenchState, counts: Counts, *, trace: bool = False) -> dict[str, Any]:
    counts.statements = 0
    counts.management.clear()
    if trace:
        tracemalloc.start()
    started = time.perf_counter()
    record = await state.jobs.run(Job.RECONCILE, Trigger.CLI)
    seconds = time.perf_counter() - started
    peak = 0
    if trace:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert record.status == "succeeded", (record.status, record.failures[:3])
    return {
        "seconds": seconds,
        "statements": counts.statements,
        "management_calls": sum(counts.management.values()),
        "peak": peak,
        "changed": dict(record.changed),
        "found": dict(record.found),
    }


async def cleanup(settings: Settings) -> None:
    management = ManagementClient(settings.model_copy(update={"management_timeout": 60.0}))
    try:
        tag = settings.instance_tag
        vhosts, users = await instance_objects(management, settings)
        await _gather_limited(4, [partial(management.delete_vhost, v) for v in vhosts])
        await _gather_limited(16, [partial(management.delete_user, u) for u in users])
        left_vhosts, left_users = await instance_objects(management, settings)
        left = left_vhosts + left_users
        print(
            f"cleaned up {len(vhosts)} vhosts and {len(users)} broker users tagged {tag!r}"
            + (f"; LEFT BEHIND: {left}" if left else "; nothing left")
        )
    finally:
        await management.aclose()


def _kib(value: int) -> str:
    return f"{value / 1024:,.0f} KiB"


async def bench(settings: Settings) -> None:
    counts = Counts()
    state = _state(settings, counts)
    try:
        offering = uuid.uuid4()
        async with state.sessions() as session:
            session.add(Offering(uuid=offering, name="bench"))
            await session.commit()
        owners = [uuid.uuid4() for _ in range(VHOSTS)]
        subscriptions = VHOSTS * SUBSCRIPTIONS_PER_VHOST
        queues_small = subscriptions  # one queue per subscription
        queues_all = subscriptions * QUEUES_PER_SUBSCRIPTION
        orphans = VHOSTS * ORPHANS_PER_VHOST

        started = time.perf_counter()
        plan = await populate_subscriptions(state, offering, owners)
        await populate_queues(state, offering, plan, OBJECT_TYPES[:1])
        await timed_run(state, counts)  # warm-up
        small_noop = await timed_run(state, counts, trace=True)
        await populate_queues(state, offering, plan, OBJECT_TYPES[1:QUEUES_PER_SUBSCRIPTION])
        await add_orphans(state, owners)
        populated = time.perf_counter() - started
        print(
            f"population: {VHOSTS} vhosts, {queues_all:,} registered queues, {orphans:,} "
            f"orphans, {subscriptions:,} subscriptions and broker users ({populated:.0f} s)",
            flush=True,
        )
        await asyncio.sleep(1)

        vhosts = sorted(owner.hex for owner in owners)
        # The baseline lists exactly what the run in question lists: with the orphans for
        # the full run, without them for the no-op runs. Baseline and no-op runs alternate,
        # so a change in the broker's load (it is shared) weighs on both alike.
        raw_full, listed = await raw_listing(settings, vhosts)
        assert listed == queues_all + orphans + VHOSTS, listed  # + one dead-letter queue each
        full = await timed_run(state, counts)
        assert full["changed"] == {"orphans_deleted": orphans}, full["changed"]
        raw_times, noops, ratios = [], [], []
        for turn in range(PAIRS):
            # Alternate which goes first, and judge each pair on its own.
            if turn % 2:
                noops.append(await timed_run(state, counts))
                seconds, listed = await raw_listing(settings, vhosts)
            else:
                seconds, listed = await raw_listing(settings, vhosts)
                noops.append(await timed_run(state, counts))
            assert listed == queues_all + VHOSTS, listed
            raw_times.append(seconds)
            ratios.append(noops[-1]["seconds"] / seconds)
        assert all(run["changed"] == {} for run in noops)
        raw = statistics.median(raw_times)
        noop = sorted(noops, key=lambda run: run["seconds"])[len(noops) // 2]
        ratio = statistics.median(ratios)
        raw_delete = await raw_deletes(settings, await add_orphans(state, owners))
        large_noop = await timed_run(state, counts, trace=True)
        await add_orphans(state, owners)
        full_traced = await timed_run(state, counts, trace=True)

        print(
            f"(a)  raw listing of the {len(vhosts)} vhosts, same calls and columns: "
            f"{raw_full:.3f} s with the orphans, {raw:.3f} s without (median of {PAIRS})"
        )
        print(
            f"(b1) reconcile deleting {orphans:,} orphans: "
            f"{full['seconds']:.3f} s  b1/a = {full['seconds'] / raw_full:.2f}  "
            f"db statements = {full['statements']}  "
            f"management calls = {full['management_calls']}"
        )
        print(
            f"(b2) reconcile with nothing to do: {noop['seconds']:.3f} s (median of {PAIRS})  "
            f"b2/a = {ratio:.2f} (median of the {PAIRS} pairs' ratios; goal <= 1.5; "
            f"range {min(ratios):.2f}-{max(ratios):.2f})  "
            f"db statements = {noop['statements']}  "
            f"management calls = {noop['management_calls']}"
        )
        baseline = raw_full + raw_delete
        goal5 = full["seconds"] / baseline
        print(
            f"GOAL 5 full reconcile deleting {orphans:,} orphans: {full['seconds']:.2f} s against "
            f"raw listing {raw_full:.2f} s + the same deletes raw, "
            f"{settings.reconcile_delete_concurrency} at a time, {raw_delete:.2f} s: "
            f"x{goal5:.2f}; goal <= 1.5: {'met' if goal5 <= 1.5 else 'NOT met'}"
        )
        print(
            "peak memory (tracemalloc: Python allocations of this process during the run):\n"
            f"     no-op, {queues_small:,} queues ({subscriptions:,} subscriptions, {VHOSTS} "
            f"vhosts): {_kib(small_noop['peak'])}\n"
            f"     no-op, {queues_all:,} queues (same subscriptions and vhosts): "
            f"{_kib(large_noop['peak'])}\n"
            f"     full run (orphans), {queues_all:,} queues: {_kib(full_traced['peak'])}"
        )
    finally:
        await state.management.aclose()
        await state.engine.dispose()


def main() -> None:
    configure_logging(level="WARNING")  # one line per deleted orphan would drown the figures
    with bench_database() as url:
        settings = Settings(
            database_url=url,
            instance_name=f"qkbench-reconcile-{uuid.uuid4().hex[:10]}",
            scheduler_enabled=False,
            management_timeout=60.0,
            # The 1,000 orphans are the point: the deletion guard would hold the run back.
            reconcile_max_deletions=100_000,
            reconcile_max_delete_share=1.0,
        )
        try:
            asyncio.run(bench(settings))
        finally:
            asyncio.run(cleanup(settings))


if __name__ == "__main__":
    main()
