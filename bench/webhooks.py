"""Webhook delivery (contract §13) against a raw HTTP client posting the same bodies.

`queuekeeper serve` on a fresh database (its own process), loopback allowed for webhooks. A
receiver on 127.0.0.1 (aiohttp, in this process) answers 200 at once and records each
`webhook-id` with its arrival time. Webhook consumers are written in the database as
registration leaves them.

- raw: an aiohttp client (one `ClientSession`, kept-alive connections) in a process of its
  own, posting bodies shaped and signed as the dispatcher's to the same receiver, one
  request at a time per consumer (as the dispatcher posts one at a time per consumer), for
  1 and for BENCH_WEBHOOK_CONSUMERS (10) consumers side by side; its CPU per post;
- throughput: BENCH_WEBHOOK_EVENTS (2,000) events per consumer accepted while the consumers
  are disabled (`webhook_gone_at`), then enabled and announced as `update_webhook` does
  (decision 034): deliveries/s until the receiver has them
  all, for 1 and for 10 consumers; the service's CPU per delivery (serve and its children);
- latency: events sent open-loop at BENCH_WEBHOOK_RATE (200/s) for BENCH_WEBHOOK_SECONDS
  (5) to one consumer by `bench single`'s load generator (a process of its own); from each
  event's scheduled send to its arrival at the receiver, p50/p90/p99.

Printed: each figure and its ratio to the raw client's. BENCH_WEBHOOK_LATENCY=0 leaves the
latency out; BENCH_PROFILE_DIR records the service with py-spy in each throughput phase
(bench/_profile.py reads the files). BENCH_WEBHOOK_DEBUG=1 adds the
accept's own answer times and a few events' latencies across the run (a backlog growing
shows as latencies rising with n).

    .venv/bin/python -m bench webhooks
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from aiohttp import web

from bench._support import fmt_ms, free_port, on_a_bench_database, percentiles
from bench.publish import TOKEN, Profiler, Service
from bench.single import generate
from queuekeeper.broker.topology import webhook_queue_name
from queuekeeper.config import Settings
from queuekeeper.events.outbox import WEBHOOKS_DUE_CHANNEL
from queuekeeper.events.outbox_postgres import WEBHOOK_DUE_NOW
from queuekeeper.webhooks import signing

CONSUMERS = int(os.environ.get("BENCH_WEBHOOK_CONSUMERS", "10"))
EVENTS = int(os.environ.get("BENCH_WEBHOOK_EVENTS", "2000"))
RATE = float(os.environ.get("BENCH_WEBHOOK_RATE", "200"))
SECONDS = float(os.environ.get("BENCH_WEBHOOK_SECONDS", "5"))
BODY = {
    "offering_uuid": uuid.uuid4().hex,
    "object_type": "order",
    "payload": {"order_uuid": uuid.uuid4().hex, "order_state": "executing"},
    "schema_version": 1,
}


class Receiver:
    """Answers 200 at once; the arrival time (wall clock, as the generator's) of each
    webhook-id."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.count = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.arrived.setdefault(request.headers.get("webhook-id", ""), time.time())
        self.count += 1
        return web.Response(status=200)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        self.port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def url(self, n: int) -> str:
        return f"http://127.0.0.1:{self.port}/hook/{n}"

    async def wait_for(self, count: int, timeout: float = 300) -> None:
        deadline = time.perf_counter() + timeout
        while self.count < count:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"receiver got {self.count} of {count}")
            await asyncio.sleep(0.005)


def _raw_client(url: str, consumers: int, per_consumer: int) -> None:
    """The raw client's process: posts, then prints posts/s and its CPU ms per post."""

    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()

    async def posting() -> float:
        async with aiohttp.ClientSession() as session:

            async def one_consumer(n: int) -> None:
                for i in range(per_consumer):
                    event_id = f"raw-{n}-{i}-{uuid.uuid4().hex}"
                    body = json.dumps(
                        {**BODY, "event_id": event_id}, separators=(",", ":")
                    ).encode()
                    headers = signing.headers(secret, event_id, int(time.time()), body)
                    async with session.post(f"{url}/{n}", data=body, headers=headers) as answer:
                        await answer.read()
                        answer.raise_for_status()

            started = time.perf_counter()
            await asyncio.gather(*(one_consumer(n) for n in range(consumers)))
            return time.perf_counter() - started

    cpu = time.process_time()
    elapsed = asyncio.run(posting())
    used = time.process_time() - cpu
    total = consumers * per_consumer
    print(json.dumps({"rate": total / elapsed, "cpu_ms": used * 1000 / total}))


async def raw(receiver: Receiver, consumers: int, per_consumer: int) -> tuple[float, float]:
    """Posts/s of a raw aiohttp client in a process of its own, one request at a time per
    consumer, and its CPU ms per post (the process's start and imports not counted)."""
    # This file run as a script (so a tree checked out for comparison runs this client too),
    # the bench package found from the working directory.
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).resolve()),
        "--raw",
        f"http://127.0.0.1:{receiver.port}/hook",
        str(consumers),
        str(per_consumer),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": path},
    )
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the raw client failed ({process.returncode})")
    figures = json.loads(out.decode().strip().splitlines()[-1])
    return float(figures["rate"]), float(figures["cpu_ms"])


async def webhook_consumers(
    service: Service, database: str, offering: uuid.UUID, receiver: Receiver, count: int
) -> list[uuid.UUID]:
    """`count` webhook consumers of one owner with access to `offering`, disabled."""
    owner = uuid.uuid4()
    await service.call(
        "PUT",
        f"/api/internal/users/{owner}/",
        json={"username": "hooks", "token": secrets.token_hex(20)},
    )
    await service.call("PUT", f"/api/internal/offerings/{offering}/users/{owner}/")
    made = [uuid.uuid4() for _ in range(count)]
    connection = await asyncpg.connect(database.replace("+asyncpg", ""))
    try:
        for n, consumer in enumerate(made):
            await connection.execute(
                "INSERT INTO event_consumers (uuid, user_uuid, object_types, queue_name, vhost,"
                " broker_state, auth_token_prefix, is_global, payload_filters, delivery,"
                " webhook_url, webhook_secret, webhook_gone_at, last_error, created, modified)"
                " VALUES ($1, $2, '[]', $3, $4, 'ok', '', false, '{}', 'webhook', $5, $6,"
                " now(), '', now(), now())",
                consumer,
                owner,
                webhook_queue_name(consumer),
                owner.hex,
                receiver.url(n),
                "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode(),
            )
            await connection.execute(
                "INSERT INTO event_consumer_scopes (consumer_uuid, offering_uuid) VALUES ($1, $2)",
                consumer,
                offering,
            )
    finally:
        await connection.close()
    return made


async def set_enabled(database: str, consumers: list[uuid.UUID], enabled: bool) -> None:
    """Block or unblock the consumers; an unblocking makes their copies due and announces
    them by `update_webhook`'s own statement (an idle dispatcher's look may be seconds away)."""
    connection = await asyncpg.connect(database.replace("+asyncpg", ""))
    try:
        async with connection.transaction():
            await connection.execute(
                "UPDATE event_consumers SET webhook_gone_at = "
                "CASE WHEN $2 THEN NULL ELSE now() END WHERE uuid = ANY($1::uuid[])",
                consumers,
                enabled,
            )
            for consumer in consumers if enabled else []:
                # The statement `update_webhook` runs (outbox.webhook_copies_due_now).
                await connection.execute(
                    WEBHOOK_DUE_NOW, consumer, datetime.now(UTC), WEBHOOKS_DUE_CHANNEL
                )
    finally:
        await connection.close()


def _event(offering: uuid.UUID, event_id: str) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "offering_uuid": offering.hex,
        "object_type": "order",
        "payload": BODY["payload"],
    }


async def throughput(
    service: Service, database: str, receiver: Receiver, count: int, label: str
) -> tuple[float, float]:
    """Deliveries/s and service CPU ms per delivery for `count` consumers' backlogs."""
    offering = uuid.uuid4()
    await service.call("PUT", f"/api/internal/offerings/{offering}/", json={"name": "hooks"})
    consumers = await webhook_consumers(service, database, offering, receiver, count)
    for start in range(0, EVENTS, 500):
        events = [_event(offering, f"{label}-{n}") for n in range(start, min(start + 500, EVENTS))]
        await service.call("POST", "/api/internal/events/batch/", json={"events": events})
    before, cpu = receiver.count, service.cpu_seconds()
    started = time.perf_counter()
    await set_enabled(database, consumers, True)
    await receiver.wait_for(before + count * EVENTS)
    elapsed = time.perf_counter() - started
    used = service.cpu_seconds() - cpu
    await set_enabled(database, consumers, False)
    return count * EVENTS / elapsed, used * 1000 / (count * EVENTS)


async def latency(service: Service, database: str, receiver: Receiver) -> list[float]:
    """Accept to arrival of events sent open-loop at RATE by `bench.single`'s generator (a
    process of its own, so its cost is neither this process's nor the service's)."""
    offering = uuid.uuid4()
    await service.call("PUT", f"/api/internal/offerings/{offering}/", json={"name": "hooks"})
    consumers = await webhook_consumers(service, database, offering, receiver, 1)
    await set_enabled(database, consumers, True)
    body = json.dumps(_event(offering, "__ID__"))
    target = {
        "kind": "http",
        "port": service.port,
        "path": "/api/internal/events/",
        "token": TOKEN,
        "body": body,
    }
    prefix = f"latency-{secrets.token_hex(3)}-"
    start, results, _cpu = await generate(target, int(RATE), SECONDS, prefix)
    accepted = sum(1 for row in results if row[1] == 202)
    scheduled = {f"{prefix}{n}": start + n / RATE for n in range(int(RATE * SECONDS))}
    deadline = time.perf_counter() + 30
    while sum(1 for e in scheduled if e in receiver.arrived) < accepted:
        if time.perf_counter() > deadline:
            break
        await asyncio.sleep(0.01)
    print(f"sent {len(scheduled)} events open-loop at {RATE:g}/s, {accepted} accepted (202)")
    if os.environ.get("BENCH_WEBHOOK_DEBUG"):
        answered = sorted(row[2] for row in results)
        print("answered - due", fmt_ms(percentiles(answered)))
        for n in (0, 1, 10, 100, 500, len(scheduled) - 1):
            key = f"{prefix}{n}"
            print(n, receiver.arrived.get(key, 0) - scheduled[key])
    return [receiver.arrived[e] - at for e, at in scheduled.items() if e in receiver.arrived]


async def run(settings: Settings) -> None:
    receiver = Receiver()
    await receiver.start()
    service = Service(
        settings,
        free_port(),
        QUEUEKEEPER_WEBHOOK_ALLOWED_NETWORKS="127.0.0.1/32",
        QUEUEKEEPER_LOG_LEVEL="WARNING",
    )
    await service.start()
    profiler = Profiler(service)
    print(f"load average before: {_load()}")
    try:
        raw_one, raw_cpu_one = await raw(receiver, 1, EVENTS)
        raw_many, raw_cpu_many = await raw(receiver, CONSUMERS, EVENTS // 2)
        print(
            f"raw aiohttp (a process of its own): 1 consumer {raw_one:,.0f}/s,"
            f" {raw_cpu_one:.2f} ms CPU/post; {CONSUMERS} consumers {raw_many:,.0f}/s,"
            f" {raw_cpu_many:.2f} ms CPU/post"
        )
        one, cpu_one = await profiler.record(
            "webhooks1", throughput(service, settings.database_url, receiver, 1, "one")
        )
        many, cpu_many = await profiler.record(
            f"webhooks{CONSUMERS}",
            throughput(service, settings.database_url, receiver, CONSUMERS, "many"),
        )
        print(
            f"webhooks, 1 consumer: {one:,.0f} deliveries/s (x{one / raw_one:.2f} of raw), "
            f"service CPU {cpu_one:.2f} ms/delivery"
        )
        print(
            f"webhooks, {CONSUMERS} consumers: {many:,.0f} deliveries/s "
            f"(x{many / raw_many:.2f} of raw), service CPU {cpu_many:.2f} ms/delivery"
        )
        if os.environ.get("BENCH_WEBHOOK_LATENCY", "1") != "0":
            samples = await latency(service, settings.database_url, receiver)
            print(
                f"accept -> receiver at {RATE:g} events/s, 1 consumer: {len(samples)} "
                f"received, {fmt_ms(percentiles(samples))}"
            )
        print(f"load average after: {_load()}")
    finally:
        await service.stop()
        await receiver.stop()


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    on_a_bench_database(run)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--raw"]:
        _raw_client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
