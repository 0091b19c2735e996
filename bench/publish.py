"""Publishing throughput and latency against a raw aio-pika baseline, in one run.

(a) raw aio-pika: persistent 1 KiB messages, publisher confirms, `mandatory`,
    500 confirms in flight, into one queue with queuekeeper's arguments;
(b) queuekeeper: events POSTed to /api/internal/events/batch/ (1000 per request)
    until every copy is confirmed, PostgreSQL as the database, fan-out 1 and 10;
(c) single events at a steady 200/s: accept-to-confirm latency (the event's
    `accepted` to its copy's `finished`, both stamped by the service), and the
    HTTP round trip of the POST.

The service runs as `queuekeeper serve` in its own process (uvicorn, relay in
the lifespan) against a database this benchmark creates and drops; everything
it creates on the broker carries its own instance tag and is deleted at the end.

    make bench            # or: .venv/bin/python -m bench publish
    BENCH_EVENTS=20000 BENCH_FANOUT10_EVENTS=3000 BENCH_LATENCY_SECONDS=10 (defaults)
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import httpx

from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.config import Settings

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_DSN = os.environ.get("QK_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
TOKEN = "bench-service-token-" + secrets.token_hex(8)
BODY_BYTES = 1024
EVENTS = int(os.environ.get("BENCH_EVENTS", "20000"))
FANOUT10_EVENTS = int(os.environ.get("BENCH_FANOUT10_EVENTS", "3000"))
LATENCY_SECONDS = float(os.environ.get("BENCH_LATENCY_SECONDS", "10"))
LATENCY_RATE = 200.0
RAW_MESSAGES = EVENTS
IN_FLIGHT = 500
BATCH = 1000
CONCURRENT_REQUESTS = 2


def _migrate(url: str) -> None:
    from alembic import command
    from alembic.config import Config

    config = Config(str(ROOT / "alembic.ini"))
    config.attributes["database_url"] = url
    command.upgrade(config, "head")


async def _admin(sql: str) -> None:
    connection = await asyncpg.connect(PG_ADMIN_DSN)
    try:
        await connection.execute(sql)
    finally:
        await connection.close()


def _payload(filler: int) -> dict[str, Any]:
    return {"order_uuid": uuid.uuid4().hex, "order_state": "executing", "note": "x" * filler}


def _filler_for_1kib(offering: uuid.UUID) -> int:
    probe = {**_payload(0), "offering_uuid": offering.hex, "object_type": "order"}
    return BODY_BYTES - len(json.dumps(probe).encode())


class Service:
    """`queuekeeper serve` in a subprocess, and an HTTP client for it."""

    def __init__(self, settings: Settings, port: int) -> None:
        self.settings = settings
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None
        self.http = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=120,
        )

    async def start(self) -> None:
        env = {
            **os.environ,
            "QUEUEKEEPER_DATABASE_URL": self.settings.database_url,
            "QUEUEKEEPER_INSTANCE_NAME": self.settings.instance_name,
            "QUEUEKEEPER_SERVICE_TOKENS": TOKEN,
            "QUEUEKEEPER_QUEUE_MAX_LENGTH": str(self.settings.queue_max_length),
            "QUEUEKEEPER_PUBLIC_URL": f"http://127.0.0.1:{self.port}",
        }
        command = [str(Path(sys.executable).parent / "queuekeeper"), "serve"]
        log = open(os.environ.get("BENCH_SERVICE_LOG", os.devnull), "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port)], env=env, stdout=log, stderr=log
        )
        for _ in range(200):
            with suppress(httpx.HTTPError):
                if (await self.http.get("/healthz")).status_code == 200:
                    return
            await asyncio.sleep(0.05)
        raise RuntimeError("queuekeeper serve did not start")

    async def stop(self) -> None:
        await self.http.aclose()
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()

    async def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = await self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text[:300]}")
        return response

    async def queues(self, offering: uuid.UUID, count: int) -> list[tuple[str, str]]:
        """`count` users with access to `offering`, each with one order queue."""
        made = []
        for _ in range(count):
            user, token = uuid.uuid4(), secrets.token_hex(20)
            await self.call(
                "PUT", f"/api/internal/users/{user}/", json={"username": "b", "token": token}
            )
            await self.call("PUT", f"/api/internal/offerings/{offering}/users/{user}/")
            agent = {"Authorization": f"Token {token}"}
            subscription = (
                await self.call("POST", "/api/event-subscriptions/", json={}, headers=agent)
            ).json()
            queue = (
                await self.call(
                    "POST",
                    f"/api/event-subscriptions/{subscription['uuid']}/create_queue/",
                    json={"offering_uuid": offering.hex, "object_type": "order"},
                    headers=agent,
                )
            ).json()
            made.append((queue["vhost"], queue["queue_name"]))
        return made

    async def drained(self, timeout: float = 600) -> None:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            stats = (await self.call("GET", "/api/admin/outbox/")).json()
            if stats["pending"] == 0:
                return
            await asyncio.sleep(0.01)
        raise RuntimeError(f"outbox not drained: {stats}")


async def raw_baseline(settings: Settings, management: ManagementClient) -> float:
    """Messages/s of bare aio-pika: persistent 1 KiB, confirms, mandatory, 500 in flight."""
    provisioner = Provisioner(management, settings)
    vhost = uuid.uuid4().hex
    await provisioner.ensure_vhost(vhost)
    await provisioner.ensure_queue(vhost, "subscription_raw_baseline")
    connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:5672/{vhost}")
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        body = b"x" * BODY_BYTES
        slots = asyncio.Semaphore(IN_FLIGHT)

        async def one(n: int) -> None:
            async with slots:
                await channel.default_exchange.publish(
                    aio_pika.Message(
                        body,
                        message_id=str(n),
                        content_type="application/json",
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    routing_key="subscription_raw_baseline",
                    mandatory=True,
                )

        await asyncio.gather(*(one(n) for n in range(200)))  # warm-up
        started = time.perf_counter()
        await asyncio.gather(*(one(n) for n in range(RAW_MESSAGES)))
        elapsed = time.perf_counter() - started
    await management.delete_vhost(vhost)
    return RAW_MESSAGES / elapsed


async def through_service(service: Service, fan_out: int, events: int) -> tuple[float, float]:
    """(events/s, messages/s) from the first POST until every copy is confirmed."""
    offering = uuid.uuid4()
    await service.call("PUT", f"/api/internal/offerings/{offering}/", json={"name": "bench"})
    queues = await service.queues(offering, fan_out)
    filler = _filler_for_1kib(offering)
    warm = [{"offering_uuid": offering.hex, "object_type": "order", "payload": _payload(filler)}]
    await service.call("POST", "/api/internal/events/batch/", json={"events": warm * 10})
    await service.drained()
    bodies = []
    for start in range(0, events, BATCH):
        batch = [
            {"offering_uuid": offering.hex, "object_type": "order", "payload": _payload(filler)}
            for _ in range(min(BATCH, events - start))
        ]
        bodies.append(json.dumps({"events": batch}).encode())
    slots = asyncio.Semaphore(CONCURRENT_REQUESTS)

    async def send(content: bytes) -> None:
        async with slots:
            await service.call(
                "POST",
                "/api/internal/events/batch/",
                content=content,
                headers={"content-type": "application/json"},
            )

    started = time.perf_counter()
    await asyncio.gather(*(send(body) for body in bodies))
    await service.drained()
    elapsed = time.perf_counter() - started
    for vhost, name in queues:  # empty them, so the next phase starts alike
        connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:5672/{vhost}")
        async with connection:
            channel = await connection.channel()
            await (await channel.declare_queue(name, passive=True)).purge()
    return events / elapsed, events * fan_out / elapsed


async def latency(service: Service, dsn: str) -> dict[str, float]:
    """Single events at a steady LATENCY_RATE per second, fan-out 1."""
    offering = uuid.uuid4()
    await service.call("PUT", f"/api/internal/offerings/{offering}/", json={"name": "latency"})
    await service.queues(offering, 1)
    filler = _filler_for_1kib(offering)
    count = int(LATENCY_RATE * LATENCY_SECONDS)
    round_trips: list[float] = []
    prefix = f"lat-{secrets.token_hex(4)}-"

    async def one(n: int) -> None:
        event = {
            "event_id": f"{prefix}{n}",
            "offering_uuid": offering.hex,
            "object_type": "order",
            "payload": _payload(filler),
        }
        started = time.perf_counter()
        await service.call("POST", "/api/internal/events/", json=event)
        round_trips.append(time.perf_counter() - started)

    loop = asyncio.get_running_loop()
    begin = loop.time()
    tasks = []
    for n in range(count):
        await asyncio.sleep(max(0.0, begin + n / LATENCY_RATE - loop.time()))
        tasks.append(asyncio.create_task(one(n)))
    await asyncio.gather(*tasks)
    sent_for = loop.time() - begin
    await service.drained()
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            "SELECT extract(epoch FROM d.finished - e.accepted) AS seconds "
            "FROM deliveries d JOIN events e ON e.event_id = d.event_id "
            "WHERE e.event_id LIKE $1 AND d.state = 'published'",
            prefix + "%",
        )
    finally:
        await connection.close()
    confirm = sorted(float(row["seconds"]) for row in rows)
    round_trips.sort()
    return {
        "rate": count / sent_for,
        "confirmed": len(confirm),
        "sent": count,
        "p50": _pct(confirm, 50),
        "p99": _pct(confirm, 99),
        "max": confirm[-1],
        "http_p50": _pct(round_trips, 50),
        "http_p99": _pct(round_trips, 99),
    }


def _pct(values: list[float], pct: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(pct) - 1]
        if len(values) > 1
        else values[0]
    )


class Profiler:
    """With BENCH_PROFILE_DIR set, py-spy records the service during each phase
    (collapsed stacks, one file per phase): how the figures below were explained."""

    def __init__(self, service: Service) -> None:
        self.directory = os.environ.get("BENCH_PROFILE_DIR")
        self.service = service

    async def record(self, phase: str, coroutine: Any) -> Any:
        if not self.directory or self.service.process is None:
            return await coroutine
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--pid",
                str(self.service.process.pid),
                "--format",
                "raw",
                "--rate",
                "200",
                "--output",
                str(Path(self.directory) / f"{phase}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            return await coroutine
        finally:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=30)


async def run(settings: Settings, dsn: str) -> None:
    management = ManagementClient(settings)
    service = Service(settings, port=int(os.environ.get("BENCH_PORT", "18765")))
    profiler = Profiler(service)
    try:
        await service.start()
        raw = await raw_baseline(settings, management)
        one_eps, one_mps = await profiler.record("fanout1", through_service(service, 1, EVENTS))
        ten_eps, ten_mps = await profiler.record(
            "fanout10", through_service(service, 10, FANOUT10_EVENTS)
        )
        lat = await profiler.record("latency", latency(service, dsn))
    finally:
        await service.stop()
        await _remove_broker_objects(settings, management)
        await management.aclose()
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, PostgreSQL + RabbitMQ on the same host"
    )
    print(f"(a) raw aio-pika, 1 KiB persistent, {IN_FLIGHT} confirms in flight: {raw:,.0f} msg/s")
    print(
        f"(b) fan-out 1:  {one_eps:,.0f} events/s, {one_mps:,.0f} msg/s, b/a = {one_mps / raw:.2f}"
    )
    print(
        f"(b) fan-out 10: {ten_eps:,.0f} events/s, {ten_mps:,.0f} msg/s, b/a = {ten_mps / raw:.2f}"
    )
    print(
        f"(c) single events at {lat['rate']:.0f}/s ({lat['confirmed']}/{lat['sent']} confirmed): "
        f"accept-to-confirm p50 {lat['p50'] * 1000:.1f} ms, p99 {lat['p99'] * 1000:.1f} ms, "
        f"max {lat['max'] * 1000:.1f} ms; POST round trip p50 {lat['http_p50'] * 1000:.1f} ms, "
        f"p99 {lat['http_p99'] * 1000:.1f} ms"
    )
    print(
        f"goals: ratio >= 0.6 at fan-out 1: {'met' if one_mps / raw >= 0.6 else 'NOT met'}; "
        f"p99 <= 20 ms: {'met' if lat['p99'] <= 0.020 else 'NOT met'}"
    )


async def _remove_broker_objects(settings: Settings, management: ManagementClient) -> None:
    for vhost in await management.list_vhosts():
        tags = vhost.get("tags") or []
        if settings.instance_tag in (tags.split(",") if isinstance(tags, str) else tags):
            await management.delete_vhost(vhost["name"])
    for user in await management.list_users():
        tags = user.get("tags") or []
        if settings.instance_tag in (tags.split(",") if isinstance(tags, str) else tags):
            await management.delete_user(user["name"])


def main() -> None:
    name = f"qk_bench_{secrets.token_hex(6)}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    base = PG_ADMIN_DSN.rsplit("/", 1)[0]
    dsn = f"{base}/{name}"
    url = dsn.replace("postgresql://", "postgresql+asyncpg://")
    try:
        _migrate(url)
        settings = Settings(
            database_url=url,
            instance_name=f"qkbench-{secrets.token_hex(5)}",
            service_tokens=[TOKEN],
            queue_max_length=1_000_000,  # the benchmark fills queues nobody consumes
        )
        print(
            f"command: {' '.join(sys.argv) or 'python -m bench publish'}; "
            f"events {EVENTS} (fan-out 1), {FANOUT10_EVENTS} (fan-out 10), "
            f"latency {LATENCY_SECONDS:g} s",
            flush=True,
        )
        asyncio.run(run(settings, dsn))
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
