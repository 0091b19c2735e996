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

Each batch phase also prints where the whole machine's CPU went per message (the
service, PostgreSQL's backends, RabbitMQ's beam.smp, this generator; /proc): on this
2-core box the phases are CPU-bound machine-wide, so b/a follows the ratio of raw's
machine CPU per message to the service path's.

    make bench            # or: .venv/bin/python -m bench publish
    BENCH_EVENTS=20000 BENCH_FANOUT10_EVENTS=3000 BENCH_LATENCY_SECONDS=10 BENCH_ROUNDS=3
    (defaults)
    BENCH_RELAY_PROCESS=1   the relay as its own process (`queuekeeper relay`) beside serve
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
from typing import Any, Protocol

import aio_pika
import asyncpg
import httpx

from bench._support import (
    bench_database,
    process_cpu_seconds,
    process_tree,
    remove_broker_objects,
    stat_cpu,
)
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.config import Settings

TOKEN = "bench-service-token-" + secrets.token_hex(8)
BODY_BYTES = 1024
EVENTS = int(os.environ.get("BENCH_EVENTS", "20000"))
FANOUT10_EVENTS = int(os.environ.get("BENCH_FANOUT10_EVENTS", "3000"))
LATENCY_SECONDS = float(os.environ.get("BENCH_LATENCY_SECONDS", "10"))
LATENCY_RATE = float(os.environ.get("BENCH_LATENCY_RATE", "200"))
RAW_MESSAGES = EVENTS
IN_FLIGHT = 500
BATCH = 1000
CONCURRENT_REQUESTS = 2
# Raw and the service alternate this many times and goal 3 is the median of the paired
# ratios: on a shared 2-vCPU VM one raw run alone moves by +-15 % from run to run.
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))


def _payload(filler: int) -> dict[str, Any]:
    return {"order_uuid": uuid.uuid4().hex, "order_state": "executing", "note": "x" * filler}


def _filler_for_1kib(offering: uuid.UUID) -> int:
    probe = {**_payload(0), "offering_uuid": offering.hex, "object_type": "order"}
    return BODY_BYTES - len(json.dumps(probe).encode())


def machine_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores; /proc/stat, no idle, no iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cpu_by_command(*names: str) -> dict[str, float]:
    """CPU seconds used so far by the running processes of each command name (/proc/*/stat):
    `postgres` sums every backend, `beam.smp` is RabbitMQ."""
    used = dict.fromkeys(names, 0.0)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, seconds = stat_cpu(stat.read_text())
        except OSError:
            continue
        if name in used:
            used[name] += seconds
    return used


class CpuShares:
    """Where the machine's CPU went during one phase, per message."""

    def __init__(self) -> None:
        self.machine = machine_cpu_seconds()
        self.processes = cpu_by_command("postgres", "beam.smp")
        self.generator = time.process_time()

    def per_message(self, messages: int, service: float | None = None) -> str:
        machine = machine_cpu_seconds() - self.machine
        processes = cpu_by_command("postgres", "beam.smp")
        parts = {
            "PostgreSQL": processes["postgres"] - self.processes["postgres"],
            "RabbitMQ": processes["beam.smp"] - self.processes["beam.smp"],
            "generator": time.process_time() - self.generator,
        }
        if service is not None:
            parts = {"service": service, **parts}
        shown = ", ".join(f"{k} {v / messages * 1e6:.0f}" for k, v in parts.items())
        return f"machine CPU {machine / messages * 1e6:.0f} us per message: {shown}"


class Service:
    """`queuekeeper serve` in a subprocess, and an HTTP client for it."""

    def __init__(
        self, settings: Settings, port: int, executable: Path | None = None, **env: str
    ) -> None:
        self.settings = settings
        # Another checkout's `queuekeeper` (bench/_paired.py); this one's by default.
        self.executable = executable or Path(sys.executable).parent / "queuekeeper"
        self.port = port
        self.env = env  # QUEUEKEEPER_* overrides (the process model)
        self.process: subprocess.Popen[bytes] | None = None
        self.relay: subprocess.Popen[bytes] | None = None  # with BENCH_RELAY_PROCESS=1
        self.last_cpu = 0.0  # service CPU seconds of the last timed phase
        self.last_shares = ""  # where the machine's CPU went in that phase, per message
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
            **self.env,
        }
        command = [str(self.executable), "serve"]
        log = open(os.environ.get("BENCH_SERVICE_LOG", os.devnull), "wb")  # noqa: SIM115
        # --workers overrides QUEUEKEEPER_ACCEPT_WORKERS: only when asked for.
        workers = os.environ.get("BENCH_WORKERS")
        if os.environ.get("BENCH_RELAY_PROCESS") == "1":
            self.relay = subprocess.Popen([command[0], "relay"], env=env, stdout=log, stderr=log)
            env = {**env, "QUEUEKEEPER_RELAY_ENABLED": "false"}
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port), *(["--workers", workers] if workers else [])],
            env=env,
            stdout=log,
            stderr=log,
        )
        for _ in range(200):
            with suppress(httpx.HTTPError):
                if (await self.http.get("/healthz")).status_code == 200:
                    return
            await asyncio.sleep(0.05)
        raise RuntimeError("queuekeeper serve did not start")

    async def stop(self) -> None:
        await self.http.aclose()
        for process in (self.process, self.relay):
            if process is not None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()

    def pids(self) -> list[int]:
        """The service's processes now: serve, what it supervises, and the relay apart."""
        roots = [p.pid for p in (self.process, self.relay) if p is not None]
        return [pid for root in roots for pid in process_tree(root)]

    def cpu_seconds(self) -> float:
        """User + system CPU the service's processes have used (Linux /proc)."""
        return process_cpu_seconds(*self.pids())

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

    async def drained(self, timeout: float = 600, poll: float = 0.01) -> None:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            stats = (await self.call("GET", "/api/admin/outbox/")).json()
            if stats["pending"] == 0:
                return
            await asyncio.sleep(poll)
        raise RuntimeError(f"outbox not drained: {stats}")


async def raw_baseline(settings: Settings, management: ManagementClient) -> tuple[float, str]:
    """Messages/s of bare aio-pika (persistent 1 KiB, confirms, mandatory, 500 in flight),
    and where the machine's CPU went meanwhile."""
    provisioner = Provisioner(management, settings, uuid.uuid4())
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
        shares = CpuShares()
        started = time.perf_counter()
        await asyncio.gather(*(one(n) for n in range(RAW_MESSAGES)))
        elapsed = time.perf_counter() - started
        machine = shares.per_message(RAW_MESSAGES)
    await management.delete_vhost(vhost)
    return RAW_MESSAGES / elapsed, machine


async def through_service(
    service: Service, dsn: str, fan_out: int, events: int
) -> tuple[float, float]:
    """(events/s, messages/s) from the first POST until every copy is confirmed.

    The end is the last copy's `finished` as the service stamped it, and the outbox is
    polled only every 0.2 s: polling it every 10 ms cost the service (and the generator's
    httpx) more than a tenth of the phase's CPU, which the raw baseline never pays."""
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

    cpu, shares = service.cpu_seconds(), CpuShares()
    started = time.time()
    await asyncio.gather(*(send(body) for body in bodies))
    await service.drained(poll=0.2)
    service.last_cpu = service.cpu_seconds() - cpu
    service.last_shares = shares.per_message(events * fan_out, service.last_cpu)
    elapsed = await last_finished(dsn) - started
    for vhost, name in queues:  # empty them, so the next phase starts alike
        connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:5672/{vhost}")
        async with connection:
            channel = await connection.channel()
            await (await channel.declare_queue(name, passive=True)).purge()
    return events / elapsed, events * fan_out / elapsed


class KeepAliveClient:
    """A minimal HTTP/1.1 client over kept-alive connections, for the latency phase.

    httpx spends ~2.5 ms of CPU per request; on a 2-core machine that also runs the
    service, PostgreSQL and RabbitMQ, the load generator would otherwise take half a
    core at 200 requests/s and measure itself more than the service.
    """

    def __init__(self, port: int, connections: int = 32) -> None:
        self.port = port
        self.idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.Queue()
        )
        self.size = connections
        # Seconds from each request written to its answer read: the service's part of an
        # answer, without the wait for a free connection before it.
        self.served: list[float] = []

    async def open(self) -> None:
        for _ in range(self.size):
            self.idle.put_nowait(await asyncio.open_connection("127.0.0.1", self.port))

    async def post(self, path: str, body: bytes) -> int:
        reader, writer = await self.idle.get()
        written = time.perf_counter()
        try:
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            self.served.append(time.perf_counter() - written)
        finally:
            self.idle.put_nowait((reader, writer))
        return status

    async def close(self) -> None:
        while not self.idle.empty():
            _reader, writer = self.idle.get_nowait()
            writer.close()


async def last_finished(dsn: str) -> float:
    """When the service confirmed its last copy (epoch seconds, its own clock)."""
    connection = await asyncpg.connect(dsn)
    try:
        value = await connection.fetchval(
            "SELECT extract(epoch FROM max(finished)) FROM deliveries WHERE state = 'published'"
        )
    finally:
        await connection.close()
    return float(value)


async def confirm_times(dsn: str, prefix: str) -> list[float]:
    """Accept-to-confirm of the published copies of events whose id starts with `prefix`,
    as the service stamped it (the event's `accepted`, the copy's `finished`)."""
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
    return [float(row["seconds"]) for row in rows]


async def latency(service: Service, dsn: str) -> dict[str, float]:
    """Single events at a steady LATENCY_RATE per second, fan-out 1."""
    offering = uuid.uuid4()
    await service.call("PUT", f"/api/internal/offerings/{offering}/", json={"name": "latency"})
    await service.queues(offering, 1)
    filler = _filler_for_1kib(offering)
    count = int(LATENCY_RATE * LATENCY_SECONDS)
    round_trips: list[float] = []
    prefix = f"lat-{secrets.token_hex(4)}-"

    bodies = [
        json.dumps(
            {
                "event_id": f"{prefix}{n}",
                "offering_uuid": offering.hex,
                "object_type": "order",
                "payload": _payload(filler),
            }
        ).encode()
        for n in range(count)
    ]
    client = KeepAliveClient(service.port)
    await client.open()

    async def one(n: int) -> None:
        started = time.perf_counter()
        status = await client.post("/api/internal/events/", bodies[n])
        round_trips.append(time.perf_counter() - started)
        if status != 202:
            raise RuntimeError(f"event {n} answered {status}")

    loop = asyncio.get_running_loop()
    cpu = service.cpu_seconds()
    begin = loop.time()
    tasks = []
    for n in range(count):
        await asyncio.sleep(max(0.0, begin + n / LATENCY_RATE - loop.time()))
        tasks.append(asyncio.create_task(one(n)))
    await asyncio.gather(*tasks)
    sent_for = loop.time() - begin
    await client.close()
    await service.drained()
    cpu_per_event = (service.cpu_seconds() - cpu) / count
    confirm = sorted(await confirm_times(dsn, prefix))
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
        "cpu": cpu_per_event,
    }


def _pct(values: list[float], pct: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(pct) - 1]
        if len(values) > 1
        else values[0]
    )


class Profiled(Protocol):
    """What a profiler records: a process (the service's `serve`, or a raw pipeline's)."""

    @property
    def process(self) -> subprocess.Popen[bytes] | None: ...


class Profiler:
    """With BENCH_PROFILE_DIR set, py-spy records the service during each phase
    (collapsed stacks, one file per phase): how the figures below were explained."""

    def __init__(self, service: Profiled) -> None:
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
                "--subprocesses",  # `serve` supervises: its accept workers and relays
                # BENCH_PROFILE_NATIVE=1: C frames too (uvloop, asyncpg's protocol, the
                # parsers), which py-spy otherwise charges to the Python frame calling them.
                *(["--native"] if os.environ.get("BENCH_PROFILE_NATIVE") == "1" else []),
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


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


async def run(settings: Settings, dsn: str) -> None:
    phases = set(os.environ.get("BENCH_ONLY", "raw,fanout1,fanout10,latency").split(","))
    management = ManagementClient(settings)
    service = Service(settings, port=int(os.environ.get("BENCH_PORT", "18765")))
    profiler = Profiler(service)
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; PostgreSQL, RabbitMQ, the service and this "
        f"load generator share it; load average before: {_load()}",
        flush=True,
    )
    goals: dict[int, list[float]] = {1: [], 10: []}
    try:
        await service.start()
        for round_ in range(1, ROUNDS + 1):
            raw = 0.0
            if "raw" in phases:
                raw, raw_machine = await raw_baseline(settings, management)
                print(
                    f"round {round_}: (a) raw aio-pika, 1 KiB persistent, confirms, mandatory, "
                    f"{IN_FLIGHT} in flight: {raw:,.0f} msg/s ({raw_machine})",
                    flush=True,
                )
            for phase, fan_out, events in (
                ("fanout1", 1, EVENTS),
                ("fanout10", 10, FANOUT10_EVENTS),
            ):
                if phase not in phases:
                    continue
                eps, mps = await profiler.record(
                    f"{phase}-{round_}", through_service(service, dsn, fan_out, events)
                )
                used = service.last_cpu / (events * fan_out) * 1e6
                ratio = f", b/a = {mps / raw:.2f}" if raw else ""
                print(
                    f"round {round_}: (b) fan-out {fan_out}: {eps:,.0f} events/s, "
                    f"{mps:,.0f} msg/s{ratio} (service CPU {used:.0f} us per message; "
                    f"{service.last_shares})",
                    flush=True,
                )
                if raw:
                    goals[fan_out].append(mps / raw)
        if "latency" in phases:
            lat = await profiler.record("latency", latency(service, dsn))
            used = lat["cpu"] * 1e3
            print(
                f"(c) single events at {lat['rate']:.0f}/s ({lat['confirmed']:.0f}/"
                f"{lat['sent']:.0f} confirmed): accept-to-confirm p50 {lat['p50'] * 1000:.1f} ms, "
                f"p99 {lat['p99'] * 1000:.1f} ms, max {lat['max'] * 1000:.1f} ms; POST round "
                f"trip p50 {lat['http_p50'] * 1000:.1f} ms, p99 {lat['http_p99'] * 1000:.1f} ms "
                f"(service CPU {used:.2f} ms per event)",
                flush=True,
            )
    finally:
        await service.stop()
        await remove_broker_objects(settings)
        await management.aclose()
    print(f"load average after: {_load()}")
    medians = {fan: statistics.median(ratios) for fan, ratios in goals.items() if ratios}
    if medians:
        met = medians.get(1, 0) >= 0.85 and medians.get(10, 0) >= 0.75
        print(
            "GOAL 3 batches against raw pipelined confirms, median of "
            f"{ROUNDS} paired rounds: "
            + ", ".join(
                f"fan-out {fan} x{medians[fan]:.2f} ({' '.join(f'{r:.2f}' for r in goals[fan])})"
                for fan in sorted(medians)
            )
            + f"; goal fan-out 1 >= 0.85, fan-out 10 >= 0.75: {'met' if met else 'NOT met'}"
        )


def main() -> None:
    with bench_database() as url:
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
        asyncio.run(run(settings, url.replace("postgresql+asyncpg://", "postgresql://")))
