"""Single events at a backend's pace: open-loop capacity against a raw pipeline, in one run,
for each process model of the service.

Open loop: send times are fixed before the run (event n at start + n / rate), not by
completions, and latency is counted from the scheduled send time, so a slow answer
cannot slow the offered load down. The generator is `bench/_loadgen.py`, BENCH_GENERATORS
(1) processes of their own: it shares no event loop or GIL with the pipeline or with the
consumer, and its clients are raw asyncio streams (about 0.2-0.4 ms of CPU per event).
Each rate (BENCH_RATES, default 200, 400, 600, 800, 1000, 1500/s) runs for
BENCH_STEP_SECONDS (8) against

  raw: `bench/_rawpipe.py`, a process of its own doing per event an asyncpg
       INSERT + COMMIT, then an aio-pika persistent confirmed mandatory publish,
       then the answer (line protocol, no HTTP);
  raw HTTP: the same process with `--http`: the same work behind uvicorn (httptools,
       uvloop) and a bare ASGI app that parses the JSON body, posted to as the service is
       (what an HTTP service cannot do without; the service's CPU above it is its own);
  queuekeeper: `queuekeeper serve` in each process model of BENCH_PROCESS_MODELS
       (`<accept workers>x<relay processes>`, default 1x0,1x1,2x1,1x2,2x2; 1x0 is one
       process with the relay in it), single events POSTed to /api/internal/events/
       over BENCH_CONNECTIONS (32) kept-alive connections.

A real consumer (aio-pika, in this process, which does nothing else during a step) takes
every message off the queue; accept-to-consume = consumed minus scheduled send. A rate is
*held* when at least 95 % of the offered events were consumed within the step (plus 1 s)
and their p99 is at most 20 ms; the capacity is the highest rate held. Service CPU per
event accepted: user + system CPU (psutil) of every process of the service's tree (serve,
or the supervisor, and all its descendants, found again at each reading; with what
children that exited used), from before the generator starts to after the last event
arrived, divided by the events accepted; also by kind of process (accept, relay, serve).
Then the last model runs at half the best capacity for BENCH_RSS_SECONDS (300, the 5
minutes of goal 6) while the RSS of all its processes is sampled.
Last, the sliced sweep (`bench/_cpuslice.py`): every model again, at BENCH_SLICED_RATES
(100-800/s), with each process of the service held to BENCH_CPU_SLICE (0.25) of a core, so
that the service, not the two cores it shares with PostgreSQL and RabbitMQ, is the bound,
as it is on a host with a core per process; BENCH_CPU_SLICE=0 skips it.

With BENCH_BYSTANDERS=<n> (say 10000), n consumers bound by customer, project and user to
entities no benchmark event names are written into the database before the sweeps, and the
benchmark's offering has a customer, so each event's recipients statement reads the bindings
of its offering's chain: the capacity with and without them is the cost of matching by
scope keys (contract §12), which must not grow with the number of consumers.

Also printed per step: answers other than 202 (503 + Retry-After when the service sheds
load), answer p99 from the scheduled send time and, in brackets, the pipeline's part of
it (from the request written to its answer), the generator's CPU per event, database
sessions opened (pool churn), messages consumed twice, INFO log lines per event.

    .venv/bin/python -m bench single
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import uvloop

from bench._cpuslice import cpu_slices, throttled_seconds, why_unavailable
from bench._support import (
    bench_database,
    free_port,
    process_cpu_seconds,
    process_system_seconds,
    remove_broker_objects,
)
from bench.publish import TOKEN, Profiler, Service, _payload, confirm_times
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.config import Settings

RATES = [int(r) for r in os.environ.get("BENCH_RATES", "200,400,600,800,1000,1500").split(",")]
STEP_SECONDS = float(os.environ.get("BENCH_STEP_SECONDS", "8"))
RSS_SECONDS = float(os.environ.get("BENCH_RSS_SECONDS", "300"))
PIPELINES = os.environ.get("BENCH_PIPELINES", "raw,rawhttp,queuekeeper").split(",")
# Process models of the service swept, `<accept workers>x<relay processes>` (0 relay
# processes: the relay runs inside the one accept process).
MODELS = os.environ.get("BENCH_PROCESS_MODELS", "1x0,1x1,2x1,1x2,2x2").split(",")
P99_GOAL = 0.020
ACHIEVED_GOAL = 0.95
# Kept-alive client connections per pipeline, as a backend's pool would hold them (32, the
# issue's harness): a due event waits for a free one, its latency still counted from its
# send time.
CONNECTIONS = int(os.environ.get("BENCH_CONNECTIONS", "32"))
# Load generator processes (bench/_loadgen.py); each sends every GENERATORS-th event.
GENERATORS = int(os.environ.get("BENCH_GENERATORS", "1"))
# The sliced sweep (bench/_cpuslice.py): each process of the service held to CPU_SLICE of a
# core, every model of MODELS swept at SLICED_RATES; 0 skips it.
CPU_SLICE = float(os.environ.get("BENCH_CPU_SLICE", "0.25"))
SLICED_RATES = [
    int(r) for r in os.environ.get("BENCH_SLICED_RATES", "100,200,300,400,600,800").split(",")
]
AMQP = "amqp://guest:guest@127.0.0.1:5672/"
# Consumers bound by customer, project and user to entities the benchmark's events do not
# touch (contract §12): with BENCH_BYSTANDERS=10000 each event still has its one recipient,
# and the capacity must not fall (the recipients statement reads bindings through the index
# on what an event names; docs/decisions/025-bindings-authorized-at-delivery.md). Written
# straight into the database (their queues are never declared: nothing is sent to them).
BYSTANDERS = int(os.environ.get("BENCH_BYSTANDERS", "0"))
BYSTANDER_OWNERS = 100


def _pct(values: list[float], pct: float) -> float:
    if not values:
        return float("inf")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


def _cpu_by_kind(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far by kind of process: `accept` workers, `relay` processes and the
    `serve` supervisor (or the one process)."""
    used: dict[str, float] = {}
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        kind = "accept" if b"accept" in command else "relay" if b"relay" in command else "serve"
        used[kind] = used.get(kind, 0.0) + process_cpu_seconds(pid)
    return used


def _rss_mib(pids: list[int]) -> float:
    rss = 0.0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) / 1024
    return rss


@dataclass
class Step:
    rate: int
    sent: int = 0
    achieved: float = 0.0
    p50: float = 0.0
    p99: float = 0.0
    refused: int = 0
    refused_p99: float = 0.0
    answer_p99: float = 0.0
    cpu_ms: float = 0.0
    kernel_ms: float = 0.0  # of cpu_ms, in the kernel
    sessions: int = 0
    duplicates: int = 0
    log_lines: float = 0.0
    confirm_p99: float | None = None
    # From each request written on a connection to its answer: the service's own part.
    served_p99: float | None = None
    generator_cpu_ms: float = 0.0
    # CPU ms per event by kind of process (accept worker, relay, supervisor) when several.
    cpu_kinds: dict[str, float] = field(default_factory=dict)
    # Where the tail came from: the half-seconds of the step (from its start) with the most
    # events over the p99 goal, and how many each; a periodic stall shows as a period.
    late: list[tuple[float, int]] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return self.achieved >= ACHIEVED_GOAL * self.rate and self.p99 <= P99_GOAL

    def line(self, name: str) -> str:
        served = (
            f" (service's part {self.served_p99 * 1e3:.1f} ms)"
            if self.served_p99 is not None
            else ""
        )
        text = (
            f"  {name:11s} {self.rate:5d}/s: achieved {self.achieved:7.1f}/s, "
            f"p50 {self.p50 * 1e3:7.1f} ms, p99 {self.p99 * 1e3:8.1f} ms, "
            f"answer p99 {self.answer_p99 * 1e3:7.1f} ms{served}, CPU {self.cpu_ms:.2f} "
            f"ms/event (kernel {self.kernel_ms:.2f}; generator {self.generator_cpu_ms:.2f}), "
            f"db sessions opened {self.sessions}, consumed twice {self.duplicates}"
        )
        if self.refused:
            text += f", refused {self.refused} (answered in p99 {self.refused_p99 * 1e3:.1f} ms)"
        if name == "queuekeeper":
            text += f", log lines/event {self.log_lines:.2f}"
        if self.confirm_p99 is not None:
            text += f", accept-to-confirm p99 {self.confirm_p99 * 1e3:.1f} ms"
        if len(self.cpu_kinds) > 1:
            text += ", CPU by process kind " + ", ".join(
                f"{kind} {ms:.2f}" for kind, ms in sorted(self.cpu_kinds.items())
            )
        if not self.held and self.late:
            text += ", late events by half-second " + " ".join(
                f"{at:.1f}s:{count}" for at, count in self.late
            )
        return text + ("  held" if self.held else "  NOT held")


@dataclass
class Consumer:
    """Takes every message off a queue (each queue `start` is called for, on a connection to
    its vhost); records when each message_id first arrived."""

    received: dict[str, float] = field(default_factory=dict)
    duplicates: int = 0
    connections: list[aio_pika.abc.AbstractConnection] = field(default_factory=list)

    async def start(self, vhost: str, queue: str) -> None:
        connection = await aio_pika.connect(AMQP + vhost)
        self.connections.append(connection)
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=2000)
        declared = await channel.declare_queue(queue, passive=True)
        await declared.consume(self._on_message, no_ack=True)

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        key = message.message_id or ""
        if key in self.received:
            self.duplicates += 1
        else:
            self.received[key] = time.time()

    async def close(self) -> None:
        for connection in self.connections:
            await connection.close()
        self.connections.clear()


@dataclass
class Pipeline:
    name: str
    # The pipeline's processes now (serve and every process it supervises), read again
    # for each step: a restarted child has a new pid.
    pids: Callable[[], list[int]]
    # What `bench/_loadgen.py` needs besides the schedule: kind, port (and the HTTP
    # request for kind http).
    target: dict[str, Any]
    consumer: Consumer
    sessions: Callable[[], Awaitable[int]]
    log_lines: Callable[[], int] = lambda: 0
    # The service's own accept-to-confirm times of a step's events (None for raw).
    confirm_times: Callable[[str], Awaitable[list[float]]] | None = None


@dataclass
class _Raw:
    """A raw pipeline's process, for the profiler (BENCH_PROFILE_DIR)."""

    process: subprocess.Popen[bytes] | None


async def start_rawpipe(
    dsn: str, queues: list[tuple[str, str]], http: bool = False
) -> tuple[subprocess.Popen[bytes], int]:
    """`bench/_rawpipe.py` publishing each event to every (vhost, queue), once it is ready
    (`http`: behind uvicorn); the process and its port."""
    port = free_port()
    targets = [part for vhost, queue in queues for part in (AMQP + vhost, queue)]
    mode = ["--http"] if http else []
    process = subprocess.Popen(
        [sys.executable, "-m", "bench._rawpipe", *mode, str(port), dsn, *targets],
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    await asyncio.to_thread(process.stdout.readline)
    return process, port


async def generate(target: dict[str, Any], rate: int, seconds: float, prefix: str) -> Any:
    """Run the open-loop schedule from GENERATORS processes of their own (`_loadgen`);
    (send time of event 0, results [n, status, answered - due, served], generator CPU s)."""
    start = time.time() + 1.0  # time to start the processes and open their connections
    spec = {**target, "rate": rate, "seconds": seconds, "start": start, "prefix": prefix}
    if spec["kind"] == "http":
        spec["connections"] = max(1, CONNECTIONS // GENERATORS)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench._loadgen",
            json.dumps({**spec, "index": index, "of": GENERATORS}),
            stdout=asyncio.subprocess.PIPE,
        )
        for index in range(GENERATORS)
    ]
    outputs = await asyncio.gather(*(process.communicate() for process in processes))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    results = [row for stdout, _ in outputs for row in json.loads(stdout)["results"]]
    return start, results, used


async def run_step(pipeline: Pipeline, rate: int, seconds: float) -> Step:
    prefix = f"{pipeline.name[:3]}-{rate}-{secrets.token_hex(3)}-"
    count = int(rate * seconds)
    cpu = process_cpu_seconds(*pipeline.pids())
    kernel = process_system_seconds(*pipeline.pids())
    cpu_kinds = _cpu_by_kind(pipeline.pids())
    sessions, lines = await pipeline.sessions(), pipeline.log_lines()
    start, results, generator_cpu = await generate(pipeline.target, rate, seconds, prefix)
    scheduled = {f"{prefix}{n}": start + n / rate for n in range(count)}
    answers = [row[2] for row in results if row[1] == 202]
    refused = [row[2] for row in results if row[1] != 202]
    refused += [float("inf")] * (count - len(results))  # never answered
    window_end = start + seconds + 1.0
    # Let what was accepted arrive (late arrivals count in the latency, not the rate).
    deadline = time.time() + 10
    while time.time() < deadline and sum(
        1 for key in scheduled if key in pipeline.consumer.received
    ) < len(answers):
        await asyncio.sleep(0.05)
    step = Step(rate=rate, sent=count)
    # Per event accepted: past capacity a refusal (503) costs a fraction of an accept.
    done = max(1, len(answers))
    step.cpu_ms = (process_cpu_seconds(*pipeline.pids()) - cpu) / done * 1e3
    step.kernel_ms = (process_system_seconds(*pipeline.pids()) - kernel) / done * 1e3
    step.cpu_kinds = {
        kind: (used - cpu_kinds.get(kind, 0.0)) / done * 1e3
        for kind, used in _cpu_by_kind(pipeline.pids()).items()
    }
    step.generator_cpu_ms = generator_cpu / count * 1e3
    step.sessions = await pipeline.sessions() - sessions
    step.log_lines = (pipeline.log_lines() - lines) / count
    received = pipeline.consumer.received
    latencies = [received[key] - at for key, at in scheduled.items() if key in received]
    in_window = sum(1 for key in scheduled if received.get(key, float("inf")) <= window_end)
    step.achieved = in_window / seconds
    step.p50, step.p99 = _pct(latencies, 50), _pct(latencies, 99)
    step.late = _late_windows(scheduled, received, start)
    step.answer_p99 = _pct(answers, 99)
    step.served_p99 = _pct([row[3] for row in results if row[1] == 202], 99)
    step.refused, step.refused_p99 = len(refused), _pct(refused, 99) if refused else 0.0
    if pipeline.confirm_times is not None:
        step.confirm_p99 = _pct(await pipeline.confirm_times(prefix), 99)
    step.duplicates = pipeline.consumer.duplicates
    pipeline.consumer.duplicates = 0
    return step


def _late_windows(
    scheduled: dict[str, float], received: dict[str, float], start: float
) -> list[tuple[float, int]]:
    """The (up to 6) half-seconds with the most events consumed later than the p99 goal,
    in time order."""
    windows: dict[float, int] = {}
    for key, at in scheduled.items():
        if received.get(key, float("inf")) - at > P99_GOAL:
            window = int((at - start) * 2) / 2
            windows[window] = windows.get(window, 0) + 1
    return sorted(sorted(windows.items(), key=lambda item: -item[1])[:6])


async def sweep(pipeline: Pipeline, rates: list[int] = RATES) -> list[Step]:
    steps = []
    for rate in rates:
        step = await run_step(pipeline, rate, STEP_SECONDS)
        print(step.line(pipeline.name), flush=True)
        steps.append(step)
        await asyncio.sleep(2)  # let the previous step's tail settle
    return steps


def capacity(steps: list[Step]) -> int:
    return max((step.rate for step in steps if step.held), default=0)


async def rss_run(pipeline: Pipeline, rate: int, seconds: float) -> tuple[float, float, float]:
    """(RSS after warm-up, at the end, peak) in MiB over a steady run at `rate`."""
    warmup = min(20.0, seconds / 5)
    samples: list[tuple[float, float]] = []
    started = time.time()

    async def sample() -> None:
        while True:
            samples.append((time.time() - started, _rss_mib(pipeline.pids())))
            await asyncio.sleep(1)

    sampler = asyncio.create_task(sample())
    try:
        await run_step(pipeline, rate, seconds)
    finally:
        sampler.cancel()
    after_warmup = next(rss for at, rss in samples if at >= warmup)
    tail = [rss for at, rss in samples if at >= seconds - 10] or [samples[-1][1]]
    return after_warmup, sum(tail) / len(tail), max(rss for _, rss in samples)


def _unit_of_work() -> None:
    document = {"items": list(range(100)), "text": "x" * 700}
    for _ in range(20):
        json.loads(json.dumps(document))


def pacing_penalty(rate: int, units: int = 200, rounds: int = 5) -> float:
    """CPU of the same pure-Python work done `rate` times a second over the same work done
    back to back, in this process (median of `rounds` pairs): what idle gaps between events
    cost on this machine.

    On the 2-vCPU VM these figures come from, work done in short bursts with idle gaps
    between them costs up to twice the CPU of the same work done hot (caches and the vCPU's
    idle state), so CPU per event at 200/s is inflated for every pipeline alike.
    """
    ratios = []
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(units):
            _unit_of_work()
        hot = time.process_time() - started
        started = time.process_time()
        for _ in range(units):
            _unit_of_work()
            time.sleep(1 / rate)
        ratios.append((time.process_time() - started) / hot if hot else 1.0)
    return sorted(ratios)[rounds // 2]


async def _sessions(dsn: str, database: str) -> int:
    connection = await asyncpg.connect(dsn)
    try:
        value = await connection.fetchval(
            "SELECT sessions FROM pg_stat_database WHERE datname = $1", database
        )
    finally:
        await connection.close()
    return int(value or 0)


@dataclass
class Model:
    """One process model of the service: accept workers and relay processes."""

    accept_workers: int
    relay_processes: int
    steps: list[Step] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.accept_workers} accept + {self.relay_processes} relay"

    @property
    def capacity(self) -> int:
        return capacity(self.steps)


async def add_bystanders(dsn: str, count: int) -> None:
    """`count` consumers of BYSTANDER_OWNERS owners, each bound to a customer, a project of
    it and its owner's own user, the owner holding a role on the customer: what the
    recipients statement must not read for an event of another customer's offering."""
    if count <= 0:
        return
    owners = [uuid.uuid4() for _ in range(BYSTANDER_OWNERS)]
    customers = [uuid.uuid4() for _ in range(count)]
    projects = [uuid.uuid4() for _ in range(count)]
    consumers = [uuid.uuid4() for _ in range(count)]
    owner_of = [owners[i % len(owners)] for i in range(count)]
    connection = await asyncpg.connect(dsn)
    try:
        async with connection.transaction():
            await connection.execute(
                "INSERT INTO users (uuid, username, full_name, email, token_hash, is_active, "
                "created, modified) SELECT u, 'bystander', '', '', md5(u::text) || "
                "md5(u::text), true, now(), now() FROM unnest($1::uuid[]) AS u",
                owners,
            )
            await connection.execute(
                "INSERT INTO customers (uuid, name, created, modified) "
                "SELECT c, 'bystander', now(), now() FROM unnest($1::uuid[]) AS c",
                customers,
            )
            await connection.execute(
                "INSERT INTO projects (uuid, name, customer_uuid, created, modified) "
                "SELECT p, 'bystander', c, now(), now() FROM unnest($1::uuid[], $2::uuid[]) "
                "AS t(p, c)",
                projects,
                customers,
            )
            await connection.execute(
                "INSERT INTO roles (uuid, user_uuid, role_name, scope_type, scope_uuid, "
                "created, modified) SELECT gen_random_uuid(), o, 'owner', 'customer', c, "
                "now(), now() FROM unnest($1::uuid[], $2::uuid[]) AS t(o, c)",
                owner_of,
                customers,
            )
            await connection.execute(
                "INSERT INTO event_consumers (uuid, user_uuid, scope_key, object_types, "
                "queue_name, vhost, broker_state, auth_token_prefix, created, modified) "
                "SELECT c, o, md5(c::text), '[]'::json, 'consumer_' || replace(c::text, '-', "
                "''), replace(o::text, '-', ''), 'ok', '', now(), now() "
                "FROM unnest($1::uuid[], $2::uuid[]) AS t(c, o)",
                consumers,
                owner_of,
            )
            await connection.execute(
                "INSERT INTO event_consumer_bindings (consumer_uuid, scope_type, scope_uuid) "
                "SELECT c, 'customer', k FROM unnest($1::uuid[], $2::uuid[]) AS t(c, k) "
                "UNION ALL SELECT c, 'project', p FROM unnest($1::uuid[], $3::uuid[]) AS t(c, p) "
                "UNION ALL SELECT c, 'user', o FROM unnest($1::uuid[], $4::uuid[]) AS t(c, o)",
                consumers,
                customers,
                projects,
                owner_of,
            )
        await connection.execute("ANALYZE")
    finally:
        await connection.close()
    print(
        f"bystanders: {count} consumers bound by customer, project and user (3 bindings "
        f"each) to entities no benchmark event names, of {BYSTANDER_OWNERS} owners",
        flush=True,
    )


async def event_pipeline(
    service: Service,
    name: str,
    dsn: str,
    sessions: Callable[[], Awaitable[int]],
    log_lines: Callable[[], int] = lambda: 0,
) -> Pipeline:
    """A customer's offering on the running `service` with one order queue, a consumer
    reading it, and the single event the load generator sends for it."""
    offering, provider = uuid.uuid4(), uuid.uuid4()
    # The offering has a customer, so every event also reads the bindings of its chain.
    await service.call("PUT", f"/api/internal/customers/{provider}/", json={"name": name})
    await service.call(
        "PUT",
        f"/api/internal/offerings/{offering}/",
        json={"name": name, "customer_uuid": provider.hex},
    )
    ((vhost, queue),) = await service.queues(offering, 1)
    consumer = Consumer()
    await consumer.start(vhost, queue)
    body = json.dumps(
        {
            "event_id": "__ID__",
            "offering_uuid": offering.hex,
            "object_type": "order",
            "payload": _payload(700),
        }
    )
    return Pipeline(
        name,
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
        log_lines,
        lambda prefix: confirm_times(dsn, prefix),
    )


async def run_model(
    settings: Settings,
    dsn: str,
    service_log: Path,
    model: Model,
    sessions: Any,
    *,
    share: float = 0.0,
) -> Service:
    """Sweep `queuekeeper serve` in one process model; the service is left running (the
    caller stops it) so the best model can go on to the RSS run. With `share`, each of its
    processes is held to that share of a core for the sweep, at SLICED_RATES."""
    service = Service(
        settings,
        port=free_port(),
        QUEUEKEEPER_ACCEPT_WORKERS=str(model.accept_workers),
        QUEUEKEEPER_RELAY_PROCESSES=str(model.relay_processes),
    )
    await service.start()

    def log_lines() -> int:
        with service_log.open("rb") as handle:
            return sum(1 for line in handle if b'"level":"info"' in line.replace(b" ", b""))

    qk = await event_pipeline(service, "queuekeeper", dsn, sessions, log_lines)
    service.consumer = qk.consumer  # type: ignore[attr-defined]
    service.pipeline = qk  # type: ignore[attr-defined]
    await run_step(qk, 100, 2)  # warm-up: connections, prepared statements
    label = f"single-{model.accept_workers}x{model.relay_processes}"
    if not share:
        print(f"queuekeeper, {model.name} ({len(service.pids())} processes with serve):")
        model.steps = await Profiler(service).record(label, sweep(qk))
        return service
    pids = service.pids()
    print(f"queuekeeper, {model.name}, each of {len(pids)} processes held to {share:g} core:")
    with cpu_slices(pids, share):
        model.steps = await Profiler(service).record(f"{label}-sliced", sweep(qk, SLICED_RATES))
        held_back = throttled_seconds(pids)
    print(f"  held back by the slice {held_back:.1f} s in all over the sweep", flush=True)
    return service


async def sweep_raw(
    settings: Settings,
    provisioner: Provisioner,
    dsn: str,
    sessions: Callable[[], Awaitable[int]],
    consumers: list[Consumer],
    *,
    http: bool,
) -> list[Step]:
    """Sweep `bench/_rawpipe.py` (`http`: behind uvicorn, posted to as the service is) with a
    queue and a consumer of its own; py-spy records it with BENCH_PROFILE_DIR."""
    name = "rawhttp" if http else "raw"
    vhost, queue = f"{settings.instance_name}-{name}", f"subscription_{name}_single"
    await provisioner.ensure_vhost(vhost)
    await provisioner.ensure_queue(vhost, queue)
    process, port = await start_rawpipe(dsn, [(vhost, queue)], http=http)
    try:
        consumer = Consumer()
        consumers.append(consumer)  # closed by the caller
        await consumer.start(vhost, queue)
        target: dict[str, Any] = {"kind": "raw", "port": port}
        if http:
            body = {"offering_uuid": uuid.uuid4().hex, "object_type": "order"}
            body |= {"event_id": "__ID__", "payload": _payload(700)}
            target = {"kind": "http", "port": port, "path": "/api/internal/events/"}
            target |= {"token": TOKEN, "body": json.dumps(body)}
        pipeline = Pipeline(
            "raw HTTP" if http else "raw", lambda: [process.pid], target, consumer, sessions
        )
        return await Profiler(_Raw(process)).record(f"single-{name}", sweep(pipeline))
    finally:
        process.terminate()


async def run(settings: Settings, dsn: str, service_log: Path) -> None:
    database = dsn.rsplit("/", 1)[1]
    management = ManagementClient(settings)
    provisioner = Provisioner(management, settings, uuid.uuid4())
    os.environ["BENCH_SERVICE_LOG"] = str(service_log)
    os.environ.setdefault("QUEUEKEEPER_LOG_FORMAT", "json")
    consumers: list[Consumer] = []
    services: list[Service] = []
    models = [Model(*map(int, text.split("x"))) for text in MODELS]
    print(f"uptime before: {os.popen('uptime').read().strip()}", flush=True)
    penalty = pacing_penalty(200)
    print(
        f"pacing penalty of this machine at 200/s: x{penalty:.2f} (the same pure-Python work "
        "done 200 times a second, against back to back)",
        flush=True,
    )
    sessions = lambda: _sessions(dsn, database)  # noqa: E731
    await add_bystanders(dsn, BYSTANDERS)
    raw_steps: list[Step] = []
    raw_http_steps: list[Step] = []
    rss: tuple[float, float, float] | None = None
    rss_rate = 0
    sliced: list[Model] = []
    try:
        # --- raw pipelines -----------------------------------------------------------
        if "raw" in PIPELINES:
            print(
                "raw pipeline (asyncpg INSERT + COMMIT, then a confirmed publish, per event; "
                f"{GENERATORS} generator process(es)):"
            )
            raw_steps = await sweep_raw(settings, provisioner, dsn, sessions, consumers, http=False)
        if "rawhttp" in PIPELINES:
            print(
                "raw HTTP pipeline (the same work behind uvicorn and a bare ASGI app that "
                "parses the JSON body):"
            )
            raw_http_steps = await sweep_raw(
                settings, provisioner, dsn, sessions, consumers, http=True
            )

        # --- queuekeeper, each process model ---------------------------------------------
        if "queuekeeper" in PIPELINES:
            for model in models:
                service = await run_model(settings, dsn, service_log, model, sessions)
                services.append(service)
                consumers.append(service.consumer)  # type: ignore[attr-defined]
                if model is not models[-1]:
                    await service.stop()
            best = max(models, key=lambda m: (m.capacity, -m.accept_workers - m.relay_processes))
            # The RSS run on the last model's service, still running.
            rss_rate = max(100, best.capacity // 2)
            last = services[-1]
            if RSS_SECONDS > 0:  # BENCH_RSS_SECONDS=0: a shorter run, without the memory phase
                rss = await rss_run(last.pipeline, rss_rate, RSS_SECONDS)  # type: ignore[attr-defined]
            await last.stop()
            if CPU_SLICE > 0 and (why_not := why_unavailable()) is not None:
                print(f"sliced sweep skipped: {why_not}")
            elif CPU_SLICE > 0:
                sliced.extend(Model(m.accept_workers, m.relay_processes) for m in models)
                for model in sliced:
                    service = await run_model(
                        settings, dsn, service_log, model, sessions, share=CPU_SLICE
                    )
                    services.append(service)
                    consumers.append(service.consumer)  # type: ignore[attr-defined]
                    await service.stop()
    finally:
        for consumer_ in consumers:
            await consumer_.close()
        for service_ in services:
            await service_.stop()
        await remove_broker_objects(settings)
        await management.aclose()
    print(f"uptime after: {os.popen('uptime').read().strip()}")
    report(raw_steps, models, rss, rss_rate, penalty, raw_http_steps)
    report_sliced(sliced)


def report_sliced(sliced: list[Model]) -> None:
    """The sliced sweep's scaling: each process held to CPU_SLICE of a core."""
    if not sliced or not sliced[0].steps:
        return
    print(f"scaling with each process of the service held to {CPU_SLICE:g} core:")
    for model in sliced:
        cpu = ", ".join(f"{s.rate}/s {s.cpu_ms:.2f}" for s in model.steps if s.held)
        print(f"  {model.name:20s} capacity {model.capacity:5d}/s (CPU ms/event held: {cpu})")
    first = sliced[0]
    widest = max(sliced, key=lambda m: m.accept_workers + m.relay_processes)
    grows = widest.capacity > first.capacity
    print(
        f"GOAL 1 capacity grows with processes, each held to {CPU_SLICE:g} core: "
        + ", ".join(f"{m.name} {m.capacity}/s" for m in sliced)
        + f": {'met' if grows else 'NOT met'}"
    )


def report(
    raw_steps: list[Step],
    models: list[Model],
    rss: tuple[float, float, float] | None,
    rss_rate: int,
    penalty: float,
    raw_http_steps: list[Step] | None = None,
) -> None:
    raw_cap = capacity(raw_steps)
    top = RATES[-1]
    raw_text = f"{raw_cap}/s" + (" (every rate tried)" if raw_cap == top else "")
    if not models or not models[0].steps:
        print(f"raw capacity {raw_text}")
        return
    print("scaling (capacity: >= 95 % achieved at p99 <= 20 ms):")
    for model in models:
        at200 = next((s for s in model.steps if s.rate == 200), model.steps[0])
        print(
            f"  {model.name:20s} capacity {model.capacity:5d}/s, CPU at {at200.rate}/s "
            f"{at200.cpu_ms:.2f} ms/event over every process"
        )
    best = max(models, key=lambda m: (m.capacity, -m.accept_workers - m.relay_processes))
    qk_cap = best.capacity
    ratio = qk_cap / raw_cap if raw_cap else 0.0
    print(
        f"GOAL 1 single-event capacity >= 800/s at p99 <= 20 ms (>= 95 % achieved): "
        f"{qk_cap}/s ({best.name}): {'met' if qk_cap >= 800 else 'NOT met'}"
    )
    print(
        f"GOAL 1 single-event capacity >= 0.8x raw: {qk_cap}/s against raw {raw_text}, "
        f"ratio {ratio:.2f}: {'met' if raw_cap and ratio >= 0.8 else 'NOT met'}"
    )
    raw400 = next((s for s in raw_steps if s.rate == 400), None)
    qk400 = next((s for s in models[0].steps if s.rate == 400), None)
    if raw400 is not None and qk400 is not None:
        p50_ratio = qk400.p50 / raw400.p50 if raw400.p50 else float("inf")
        print(
            f"GOAL 1 p50 at 400/s within 2x raw's ({models[0].name}): {qk400.p50 * 1e3:.1f} ms "
            f"against raw {raw400.p50 * 1e3:.1f} ms, x{p50_ratio:.2f}: "
            f"{'met' if p50_ratio <= 2 else 'NOT met'}"
        )
    first, last = models[0], models[-1]
    grows = last.capacity > first.capacity
    print(
        f"GOAL 1 capacity grows with processes: {first.name} {first.capacity}/s, "
        f"{last.name} {last.capacity}/s: {'met' if grows else 'NOT met'}"
    )
    at200, name = min(
        ((next((s for s in m.steps if s.rate == 200), m.steps[0]), m.name) for m in models),
        key=lambda pair: pair[0].cpu_ms,
    )
    raw200 = next((s for s in raw_steps if s.rate == at200.rate), Step(rate=0))
    http200 = next((s for s in raw_http_steps or [] if s.rate == at200.rate), None)
    http_text = "" if http200 is None else f"; raw HTTP pipeline {http200.cpu_ms:.2f} ms"
    print(
        f"GOAL 2 service CPU per single event at {at200.rate}/s, over every process of the "
        f"service: {at200.cpu_ms:.2f} ms ({name}; raw pipeline {raw200.cpu_ms:.2f} ms"
        f"{http_text}; "
        f"{at200.cpu_ms / penalty:.2f} ms with this machine's pacing penalty x{penalty:.2f} "
        f"taken out); goal <= 1.0 ms: {'met' if at200.cpu_ms <= 1.0 else 'NOT met'}"
    )
    if rss is None:
        return
    warm, end, peak = rss
    growth = end - warm
    verdict = "NOT met" if growth >= 10 else "met"
    if growth < 10 and RSS_SECONDS < 300:
        verdict = "not shown (a shorter run; BENCH_RSS_SECONDS=300)"
    print(
        f"GOAL 6 service RSS ({last.name}, every process) over {RSS_SECONDS:g} s at "
        f"{rss_rate}/s: {warm:.1f} MiB after warm-up, {end:.1f} MiB at the end (peak "
        f"{peak:.1f}), growth {growth:+.1f} MiB; goal < 10 MiB over 5 minutes: {verdict}"
    )


def main() -> None:
    with bench_database() as url, tempfile.TemporaryDirectory() as tmp:
        settings = Settings(
            database_url=url,
            instance_name=f"qkbench-{secrets.token_hex(5)}",
            service_tokens=[TOKEN],
        )
        print(
            f"rates {RATES} per second, {STEP_SECONDS:g} s each; p99 goal "
            f"{P99_GOAL * 1e3:g} ms, >= {ACHIEVED_GOAL:.0%} of the offered rate",
            flush=True,
        )
        uvloop.run(
            run(
                settings,
                url.replace("postgresql+asyncpg://", "postgresql://"),
                Path(tmp) / "service.log",
            )
        )


if __name__ == "__main__":
    main()
