"""One event fanned out to many matching consumers, against a raw pipeline publishing as many
copies, in one run.

FANOUT (100) owners each hold a role on one customer and have registered a consumer bound
to that customer (contract §12), each consumer's queue in its owner's vhost; every event is
of an offering of that customer, so it matches all of them. Open-loop single events at
BENCH_FANOUT_RATES (2, 5, 10, 20, 40 events/s; BENCH_STEP_SECONDS, 8, each), with the
machinery of `bench single` (`bench/_loadgen.py`, `run_step`), against

  raw: `bench/_rawpipe.py` given FANOUT queues, one per vhost as the service's are: per
       event an asyncpg INSERT + COMMIT, then FANOUT persistent, confirmed, mandatory
       publishes at once, then the answer;
  queuekeeper: `queuekeeper serve` (its default process model), single events POSTed to
       /api/internal/events/.

A consumer in this process reads every queue; an event counts as received when its last
copy has arrived, so the latency is accept-to-last-copy. It prints each step as `bench
single` does, then per rate queuekeeper against raw: events completed per second, latency
p50 and p99, CPU per event; and two RATIO lines: the throughput (the most events per second
completed within a step, the offered rate past capacity) and, at the first rate, latency
and CPU per event. (At this fan-out neither pipeline holds `bench single`'s p99 <= 20 ms.)

    .venv/bin/python -m bench fanout
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import uuid
from dataclasses import dataclass, field

import aio_pika
import uvloop

from bench._support import bench_database, free_port, remove_broker_objects
from bench.publish import TOKEN, Service, _load, _payload, confirm_times
from bench.single import (
    STEP_SECONDS,
    Consumer,
    Pipeline,
    Step,
    _sessions,
    run_step,
    start_rawpipe,
    sweep,
)
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.config import Settings

FANOUT = int(os.environ.get("BENCH_FANOUT", "100"))
# The first is below both pipelines' capacity on a 2-vCPU VM, the last above it.
RATES = [int(r) for r in os.environ.get("BENCH_FANOUT_RATES", "2,5,10,20,40").split(",")]


@dataclass
class LastCopyConsumer(Consumer):
    """Takes every message off all `copies` queues; an event is received when its last copy
    arrives (more copies than queues count as consumed twice)."""

    copies: int = 1
    counts: dict[str, int] = field(default_factory=dict)

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        key = message.message_id or ""
        count = self.counts.get(key, 0) + 1
        self.counts[key] = count
        if count == self.copies:
            self.received[key] = time.time()
        elif count > self.copies:
            self.duplicates += 1


async def matching_consumers(service: Service, offering: uuid.UUID) -> list[tuple[str, str]]:
    """FANOUT owners with a role on the offering's customer, each with a consumer bound to
    that customer: (vhost, queue) of each."""
    provider = uuid.uuid4()
    await service.call("PUT", f"/api/internal/customers/{provider}/", json={"name": "fan-out"})
    await service.call(
        "PUT",
        f"/api/internal/offerings/{offering}/",
        json={"name": "fan-out", "customer_uuid": provider.hex},
    )
    queues = []
    for _ in range(FANOUT):
        user, token = uuid.uuid4(), secrets.token_hex(20)
        await service.call(
            "PUT", f"/api/internal/users/{user}/", json={"username": "fan", "token": token}
        )
        await service.call(
            "PUT",
            f"/api/internal/roles/{uuid.uuid4()}/",
            json={
                "user_uuid": user.hex,
                "role_name": "customer.owner",
                "scope": {"type": "customer", "uuid": provider.hex},
            },
        )
        registered = await service.call(
            "POST",
            "/api/event-consumers/register/",
            json={"scopes": [{"type": "customer", "uuid": provider.hex}]},
            headers={"Authorization": f"Token {token}"},
        )
        queues.append((registered.json()["vhost"], registered.json()["queue_name"]))
    return queues


async def raw_queues(settings: Settings, provisioner: Provisioner) -> list[tuple[str, str]]:
    """FANOUT vhosts with a queue each, declared as queuekeeper declares its own."""
    queues = []
    for n in range(FANOUT):
        vhost, queue = f"{settings.instance_name}-raw-{n}", f"subscription_raw_fanout_{n}"
        await provisioner.ensure_vhost(vhost)
        await provisioner.ensure_queue(vhost, queue)
        queues.append((vhost, queue))
    return queues


def compare(raw: list[Step], service: list[Step]) -> None:
    print(f"queuekeeper against raw, one event to {FANOUT} consumers:")
    for ours, theirs in zip(service, raw, strict=True):
        print(
            f"  {ours.rate:4d} events/s ({ours.rate * FANOUT:,} copies/s): completed "
            f"{ours.achieved:.1f}/s vs {theirs.achieved:.1f}/s; accept-to-last-copy p50 "
            f"{ours.p50 * 1e3:.0f} ms vs {theirs.p50 * 1e3:.0f} ms (x{ours.p50 / theirs.p50:.2f}), "
            f"p99 {ours.p99 * 1e3:.0f} ms vs {theirs.p99 * 1e3:.0f} ms "
            f"(x{ours.p99 / theirs.p99:.2f}); CPU per event {ours.cpu_ms:.1f} ms vs "
            f"{theirs.cpu_ms:.1f} ms (x{ours.cpu_ms / theirs.cpu_ms:.2f})"
        )
    ours_most = max(step.achieved for step in service)
    raw_most = max(step.achieved for step in raw)
    print(
        f"RATIO fan-out {FANOUT} throughput (most events/s completed within a step): "
        f"queuekeeper {ours_most:.1f}/s ({ours_most * FANOUT:,.0f} copies/s) against raw "
        f"{raw_most:.1f}/s ({raw_most * FANOUT:,.0f} copies/s): x{ours_most / raw_most:.2f}"
    )
    ours, theirs = service[0], raw[0]
    print(
        f"RATIO fan-out {FANOUT} at {ours.rate} events/s: accept-to-last-copy p50 "
        f"x{ours.p50 / theirs.p50:.2f}, p99 x{ours.p99 / theirs.p99:.2f}, CPU per event "
        f"x{ours.cpu_ms / theirs.cpu_ms:.2f}"
    )


async def run(settings: Settings, dsn: str) -> None:
    database = dsn.rsplit("/", 1)[1]
    sessions = lambda: _sessions(dsn, database)  # noqa: E731
    management = ManagementClient(settings)
    provisioner = Provisioner(management, settings, uuid.uuid4())
    # One connection per vhost, as many as there are consumers: none closed to make room.
    service = Service(settings, port=free_port(), QUEUEKEEPER_AMQP_POOL_SIZE=str(FANOUT + 16))
    raw_consumer, consumer = LastCopyConsumer(copies=FANOUT), LastCopyConsumer(copies=FANOUT)
    raw_process: subprocess.Popen[bytes] | None = None
    print(f"load average before: {_load()}", flush=True)
    try:
        queues = await raw_queues(settings, provisioner)
        raw_process, raw_port = await start_rawpipe(dsn, queues)
        for vhost, queue in queues:
            await raw_consumer.start(vhost, queue)
        raw_pids = [raw_process.pid]
        raw = Pipeline(
            "raw", lambda: raw_pids, {"kind": "raw", "port": raw_port}, raw_consumer, sessions
        )
        await run_step(raw, 5, 2)  # warm-up: connections, prepared statements
        print(
            f"raw pipeline (asyncpg INSERT + COMMIT, then {FANOUT} confirmed publishes at once, "
            "per event):",
            flush=True,
        )
        raw_steps = await sweep(raw, RATES)
        raw_process.terminate()

        await service.start()
        offering = uuid.uuid4()
        for vhost, queue in await matching_consumers(service, offering):
            await consumer.start(vhost, queue)
        body = json.dumps(
            {
                "event_id": "__ID__",
                "offering_uuid": offering.hex,
                "object_type": "order",
                "payload": _payload(700),
            }
        )
        qk = Pipeline(
            "queuekeeper",
            service.pids,
            {
                "kind": "http",
                "port": service.port,
                "path": "/api/internal/events/",
                "token": TOKEN,
                "body": body,
            },
            consumer,
            sessions,
            confirm_times=lambda prefix: confirm_times(dsn, prefix),
        )
        await run_step(qk, 5, 2)
        print(
            f"queuekeeper (processes: {len(service.pids())}), one event to {FANOUT} consumers "
            "bound to its offering's customer:",
            flush=True,
        )
        service_steps = await sweep(qk, RATES)
    finally:
        await raw_consumer.close()
        await consumer.close()
        if raw_process is not None and raw_process.poll() is None:
            raw_process.terminate()
        await service.stop()
        await remove_broker_objects(settings)
        await management.aclose()
    print(f"load average after: {_load()}")
    compare(raw_steps, service_steps)


def main() -> None:
    with bench_database() as url:
        settings = Settings(
            database_url=url,
            instance_name=f"qkbench-{secrets.token_hex(5)}",
            service_tokens=[TOKEN],
        )
        print(
            f"fan-out {FANOUT}: rates {RATES} events per second, {STEP_SECONDS:g} s each",
            flush=True,
        )
        uvloop.run(run(settings, url.replace("postgresql+asyncpg://", "postgresql://")))


if __name__ == "__main__":
    main()
