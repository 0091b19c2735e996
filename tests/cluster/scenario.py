"""Three `queuekeeper serve` replicas on one PostgreSQL and a 3-node RabbitMQ cluster, under a
steady stream of single events, while one broker node and one replica are killed (kill -9)
and brought back.

What it proves (and reports in figures): every accepted event reached its consumer at least
once (lost = 0), how many arrived twice (the at-least-once window), the worst stall, that
registration calls spread over replicas converge without a 5xx, and that each scheduled job
ran once per interval although three schedulers fire.

The replicas list the nodes in a different order each (replica k starts at node k+1), as an
operator spreads connections; the consumers (the agents' own broker users) do the same.

Run: `make test-cluster`, or `python -m tests.cluster.scenario [--queue-type quorum|classic]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg  # type: ignore[import-untyped]
import httpx

from tests.cluster.harness import NODES, Cluster
from tests.proxy import free_port

ROOT = Path(__file__).resolve().parents[2]
QUEUEKEEPER = ROOT / ".venv" / "bin" / "queuekeeper"
PG_ADMIN_DSN = os.environ.get("QK_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
SERVICE_TOKEN = "cluster-scenario-" + secrets.token_hex(8)
# Generous: on this shared machine a connection can take seconds while a node is down.
CONSUMER_CONNECT_TIMEOUT = 15
RECONCILE_INTERVAL = 20
STALE_INTERVAL = 30


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process so far (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int | None) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except (OSError, TypeError):
        return None
    return None


def machine_load() -> str:
    """The 1-minute load average and how much of the time runnable tasks waited for a CPU:
    the machine is shared, and the figures mean little without it."""
    with open("/proc/loadavg") as loadavg:
        load = loadavg.read().split()[0]
    try:
        with open("/proc/pressure/cpu") as pressure:
            waiting = pressure.readline().split()[2].split("=")[1]
    except (OSError, IndexError):
        waiting = "?"
    return f"load {load}, cpu pressure some avg60 {waiting} %"


def rotated(k: int) -> list[int]:
    return [NODES[(k + n) % len(NODES)] for n in range(len(NODES))]


@dataclass
class Replica:
    index: int
    port: int
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    pids: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [str(QUEUEKEEPER), "serve"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )
        self.pids.append(self.process.pid)

    def kill(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        return self.process.pid

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


@dataclass
class AgentQueue:
    user: uuid.UUID
    token: str
    offering: uuid.UUID
    subscription: str = ""
    queue_name: str = ""
    home: str = ""  # the node holding the queue (quorum: its leader) when the stream began

    @property
    def vhost(self) -> str:
        return self.user.hex


@dataclass
class Tally:
    sent_at: dict[str, float] = field(default_factory=dict)
    accepted: dict[str, float] = field(default_factory=dict)  # event_id -> first attempt
    accept_seconds: list[float] = field(default_factory=list)
    never_accepted: int = 0
    rejected_4xx: list[str] = field(default_factory=list)
    http_retries: int = 0
    slow_accepts: list[tuple[float, str]] = field(default_factory=list)
    received: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    consumer_reconnects: int = 0
    consumer_errors: Counter[str] = field(default_factory=Counter)
    registration_statuses: list[int] = field(default_factory=list)


class Scenario:
    def __init__(
        self,
        cluster: Cluster,
        queue_type: str,
        *,
        rate: float,
        stream_seconds: float,
        agents: int,
        kill_node: int = 2,
        kill_replica: int = 1,
    ) -> None:
        self.cluster = cluster
        self.queue_type = queue_type
        self.rate = rate
        self.stream_seconds = stream_seconds
        self.agent_count = agents
        self.kill_node = kill_node
        self.kill_replica = kill_replica
        self.tag = f"qkcl{queue_type[0]}{secrets.token_hex(3)}"
        self.database = f"qk_cluster_{self.tag}"
        self.workdir = cluster.dir / self.tag
        self.replicas: list[Replica] = []
        self.agents: list[AgentQueue] = []
        self.tally = Tally()
        self.events: list[tuple[float, str]] = []  # (seconds into the stream, what happened)
        self.auth = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
        self.t0 = 0.0
        self.while_down: dict[str, str] = {}

    # --- set-up ----------------------------------------------------------------------------
    @property
    def database_url(self) -> str:
        base = PG_ADMIN_DSN.rsplit("/", 1)[0]
        return f"{base}/{self.database}"

    async def _admin_sql(self, sql: str) -> None:
        connection = await asyncpg.connect(PG_ADMIN_DSN)
        try:
            await connection.execute(sql)
        finally:
            await connection.close()

    def _replica_env(self, k: int) -> dict[str, str]:
        order = rotated(k)
        env = {
            key: value for key, value in os.environ.items() if not key.startswith("QUEUEKEEPER_")
        }
        env.pop("RABBIT_URL", None)
        env.update(
            QUEUEKEEPER_DATABASE_URL=self.database_url,
            QUEUEKEEPER_AMQP_URL=",".join(self.cluster.amqp_url(i) for i in order),
            QUEUEKEEPER_MANAGEMENT_URL=",".join(self.cluster.management_url(i) for i in order),
            QUEUEKEEPER_SERVICE_TOKENS=SERVICE_TOKEN,
            QUEUEKEEPER_INSTANCE_NAME=self.tag,
            QUEUEKEEPER_QUEUE_TYPE=self.queue_type,
            QUEUEKEEPER_PUBLIC_URL="http://queuekeeper.test",
            QUEUEKEEPER_RECONCILE_INTERVAL_SECONDS=str(RECONCILE_INTERVAL),
            QUEUEKEEPER_STALE_CLEANUP_INTERVAL_SECONDS=str(STALE_INTERVAL),
            QUEUEKEEPER_SCHEDULER_JITTER_SECONDS="0",
            QUEUEKEEPER_RELAY_BACKOFF_MAX="15",
            QUEUEKEEPER_LOG_FORMAT="json",
            QUEUEKEEPER_LOG_LEVEL="INFO",
        )
        return env

    async def set_up(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        await self._admin_sql(f'CREATE DATABASE "{self.database}"')
        migrate = await asyncio.to_thread(
            subprocess.run,
            [str(QUEUEKEEPER), "migrate"],
            env=self._replica_env(0),
            capture_output=True,
            text=True,
            check=False,
        )
        if migrate.returncode:
            raise RuntimeError(f"migrate failed: {migrate.stdout}{migrate.stderr}")
        for k in range(3):
            env = self._replica_env(k)
            port = free_port()
            env["QUEUEKEEPER_PORT"] = str(port)
            replica = Replica(k, port, env, self.workdir / f"replica{k}.log")
            replica.start()
            self.replicas.append(replica)
        async with httpx.AsyncClient(timeout=5) as http:
            for replica in self.replicas:
                await self._until_ready(http, replica, 90)

    @staticmethod
    async def _until_ready(http: httpx.AsyncClient, replica: Replica, seconds: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{replica.url}/readyz")).status_code == 200:
                    return time.monotonic() - started
            await asyncio.sleep(0.3)
        raise RuntimeError(f"replica {replica.index} not ready after {seconds} s")

    async def register(self, http: httpx.AsyncClient) -> None:
        """The backend pushes users, offerings and grants; each agent registers through the
        replicas, the same create_queue sent to all three at once (a retrying agent behind a
        load balancer)."""
        backend = self.replicas[0].url
        for n in range(self.agent_count):
            agent = AgentQueue(uuid.uuid4(), secrets.token_hex(20), uuid.uuid4())
            user = {"username": f"agent-{n}-{self.tag}", "token": agent.token}
            for method_url, body in (
                (f"{backend}/api/internal/users/{agent.user}/", user),
                (f"{backend}/api/internal/offerings/{agent.offering}/", {"name": f"o{n}"}),
            ):
                response = await http.put(method_url, json=body, headers=self.auth)
                response.raise_for_status()
            response = await http.put(
                f"{backend}/api/internal/offerings/{agent.offering}/users/{agent.user}/",
                headers=self.auth,
            )
            response.raise_for_status()
            self.agents.append(agent)

        async def one(n: int, agent: AgentQueue) -> None:
            headers = {"Authorization": f"Token {agent.token}"}
            home = self.replicas[n % 3].url
            response = await http.post(
                f"{home}/api/event-subscriptions/",
                json={"description": "cluster", "observable_objects": [{"object_type": "order"}]},
                headers=headers,
            )
            self.tally.registration_statuses.append(response.status_code)
            response.raise_for_status()
            agent.subscription = response.json()["uuid"]
            path = f"/api/event-subscriptions/{agent.subscription}/create_queue/"
            body = {"offering_uuid": agent.offering.hex, "object_type": "order"}
            # Declared first through the agent's own replica, whose first Management node
            # is node n % 3 + 1: queues (classic homes, quorum leaders) spread over all
            # three nodes. Then the same call on all three at once: all converge.
            first = await http.post(home + path, json=body, headers=headers)
            self.tally.registration_statuses.append(first.status_code)
            answers = await asyncio.gather(
                *(http.post(r.url + path, json=body, headers=headers) for r in self.replicas)
            )
            self.tally.registration_statuses.extend(a.status_code for a in answers)
            agent.queue_name = next(a.json()["queue_name"] for a in answers if a.is_success)
            listed = await http.get(
                f"{home}/api/event-subscription-queues/",
                params={"event_subscription_uuid": agent.subscription},
                headers=headers,
            )
            rows = listed.json()
            rows = rows.get("results", rows) if isinstance(rows, dict) else rows
            if len(rows) != 1:
                raise AssertionError(f"{len(rows)} queue rows after concurrent create_queue")

        await asyncio.gather(*(one(n, agent) for n, agent in enumerate(self.agents)))

    # --- consumers --------------------------------------------------------------------------
    async def consume(self, n: int, agent: AgentQueue, stop: asyncio.Event) -> None:
        order = rotated(n)
        attempt = 0
        while not stop.is_set():
            node = order[attempt % len(order)]
            attempt += 1
            gone = asyncio.Event()
            connection = None
            try:
                connection = await aio_pika.connect(
                    self.cluster.amqp_url(node, agent.subscription, agent.token, agent.vhost),
                    timeout=CONSUMER_CONNECT_TIMEOUT,
                )
                connection.close_callbacks.add(lambda *_, gone=gone: gone.set())
                channel = await connection.channel()
                channel.close_callbacks.add(lambda *_, gone=gone: gone.set())
                await channel.set_qos(prefetch_count=200)
                queue = await channel.get_queue(agent.queue_name, ensure=False)

                async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                    self.tally.received[message.message_id or ""].append(time.monotonic())
                    await message.ack()

                tag = await queue.consume(on_message)
                underlay: Any = await channel.get_underlay_channel()
                while not (gone.is_set() or stop.is_set()):
                    # A broker basic.cancel (a classic queue's home node died) only drops
                    # the consumer: notice it and consume again elsewhere.
                    if tag not in underlay.consumers:
                        break
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(gone.wait(), 0.5)
            except Exception as exc:  # any failure: reconnect to the next node
                self.tally.consumer_errors[f"qkc{node}: {type(exc).__name__}: {exc}"[:160]] += 1
            finally:
                if connection is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(connection.close(), 2)
            if not stop.is_set():
                self.tally.consumer_reconnects += 1
                await asyncio.sleep(0.5)

    # --- the stream -------------------------------------------------------------------------
    async def send_one(self, http: httpx.AsyncClient, n: int) -> None:
        agent = self.agents[n % len(self.agents)]
        event_id = f"{self.tag}-{n}"
        body = {
            "event_id": event_id,
            "offering_uuid": agent.offering.hex,
            "object_type": "order",
            "payload": {"order_uuid": uuid.uuid4().hex},
        }
        first = time.monotonic()
        self.tally.sent_at[event_id] = first
        deadline = first + 60
        k = n
        errors: list[str] = []
        while time.monotonic() < deadline:
            replica = self.replicas[k % 3]
            k += 1
            attempt = time.monotonic()
            try:
                response = await http.post(
                    f"{replica.url}/api/internal/events/", json=body, headers=self.auth
                )
            except httpx.HTTPError as exc:
                self.tally.http_retries += 1
                errors.append(
                    f"replica {replica.index}: {type(exc).__name__} after "
                    f"{time.monotonic() - attempt:.1f} s"
                )
                continue
            if response.status_code in (200, 202):
                self.tally.accepted[event_id] = first
                took = time.monotonic() - first
                self.tally.accept_seconds.append(took)
                if took > 2:
                    self.tally.slow_accepts.append(
                        (
                            took,
                            f"at {first - self.t0:.1f} s took {took:.1f} s: "
                            + ("; ".join(errors) or f"replica {replica.index} answered slowly"),
                        )
                    )
                return
            if response.status_code < 500:
                self.tally.rejected_4xx.append(f"{response.status_code} {response.text[:200]}")
                return
            self.tally.http_retries += 1
            await asyncio.sleep(0.1)
        self.tally.never_accepted += 1

    async def stream(self, http: httpx.AsyncClient) -> None:
        tasks: set[asyncio.Task[None]] = set()
        limit = asyncio.Semaphore(400)
        n = 0
        while (elapsed := time.monotonic() - self.t0) < self.stream_seconds:
            due = self.t0 + n / self.rate
            if due > time.monotonic():
                await asyncio.sleep(due - time.monotonic())
            await limit.acquire()
            task = asyncio.create_task(self.send_one(http, n))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            task.add_done_callback(lambda _: limit.release())
            n += 1
        del elapsed
        await asyncio.gather(*tasks)

    async def faults(self) -> dict[str, Any]:
        """Kill a replica, then a broker node; bring each back a little later."""
        s = self.stream_seconds
        plan: dict[str, Any] = {}

        async def at(fraction: float) -> None:
            delay = self.t0 + s * fraction - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

        def note(what: str) -> None:
            self.events.append((round(time.monotonic() - self.t0, 1), what))

        replica = self.replicas[self.kill_replica]
        await at(0.25)
        plan["replica_killed_pid"] = replica.kill()
        note(f"kill -9 replica {replica.index} (pid {plan['replica_killed_pid']})")
        await at(0.35)
        plan["node_killed_pid"] = self.cluster.kill(self.kill_node)
        note(f"kill -9 broker node qkc{self.kill_node} (pid {plan['node_killed_pid']})")
        await at(0.55)
        replica.start()
        note(f"replica {replica.index} started again (pid {replica.process.pid})")  # type: ignore[union-attr]
        await at(0.5)
        # The Management API is slow to answer while a node is down: never let it hold up
        # the plan.
        snapshot = asyncio.create_task(self.queue_stats())
        await at(0.6)
        note(f"starting broker node qkc{self.kill_node}")
        plan["node_restart_seconds"] = await asyncio.to_thread(self.cluster.restart, self.kill_node)
        note(f"broker node qkc{self.kill_node} back (took {plan['node_restart_seconds']} s)")
        self.while_down = await snapshot
        return plan

    # --- the run ----------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        started = time.monotonic()
        await self.set_up()
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=10, limits=limits) as http:
            await self.register(http)
            stop = asyncio.Event()
            consumers = [
                asyncio.create_task(self.consume(n, agent, stop))
                for n, agent in enumerate(self.agents)
            ]
            await asyncio.sleep(2)
            await self.find_homes(http)
            before = self.sample()
            load_before = machine_load()
            driver_cpu = time.process_time()
            self.t0 = time.monotonic()
            _, plan = await asyncio.gather(self.stream(http), self.faults())
            stream_end = time.monotonic()
            usage = self.usage(before, self.sample(), stream_end - self.t0)
            usage["driver"] = {
                "cpu_percent": round(
                    100 * (time.process_time() - driver_cpu) / (stream_end - self.t0), 1
                )
            }
            drained = await self._drain(120)
            stop.set()
            await asyncio.gather(*consumers)
            readyz = (await http.get(f"{self.replicas[0].url}/readyz")).json()
        figures = self.figures(plan, stream_end, drained)
        figures["resources_during_stream"] = usage
        figures["machine"] = {"load_before": load_before, "load_after": machine_load()}
        figures["jobs"] = await self.job_figures()
        figures["deliveries"] = await self.delivery_figures()
        figures["readyz_after"] = readyz["detail"]
        figures["scenario_seconds"] = round(time.monotonic() - started, 1)
        return figures

    async def queue_stats(self) -> dict[str, str]:
        """Each queue as the broker sees it (ready, unacked, consumers, online members)."""
        stats: dict[str, str] = {}
        base = self.cluster.management_url(1)
        async with httpx.AsyncClient(auth=("guest", "guest"), timeout=10) as http:
            answers = await asyncio.gather(
                *(
                    http.get(f"{base}/api/queues/{agent.vhost}/{agent.queue_name}")
                    for agent in self.agents
                ),
                return_exceptions=True,
            )
        for n, answer in enumerate(answers):
            try:
                if isinstance(answer, BaseException):
                    raise answer
                info = answer.json()
            except (httpx.HTTPError, ValueError) as exc:
                stats[str(n)] = repr(exc)[:100]
                continue
            stats[str(n)] = (
                f"ready {info.get('messages_ready')}, unacked "
                f"{info.get('messages_unacknowledged')}, consumers {info.get('consumers')}, "
                f"leader {str(info.get('leader') or info.get('node'))[:4]}, online "
                f"{[str(m)[:4] for m in info.get('online') or []]}"
            )
        return stats

    async def find_homes(self, http: httpx.AsyncClient) -> None:
        for agent in self.agents:
            response = await http.get(
                f"{self.cluster.management_url(1)}/api/queues/{agent.vhost}/{agent.queue_name}",
                params={"columns": "name,node,leader"},
                auth=("guest", "guest"),
            )
            info = response.json() if response.is_success else {}
            agent.home = str(info.get("leader") or info.get("node") or "?").split("@")[0]

    def per_queue(self, consumed: set[str], stream_end: float) -> list[dict[str, Any]]:
        """Each queue's worst consumption gap during the stream and worst latency, next to
        the node that held it and the node its consumer connected to first."""
        tally = self.tally
        by_agent: dict[int, list[str]] = defaultdict(list)
        for event_id in consumed:
            by_agent[int(event_id.rsplit("-", 1)[1]) % len(self.agents)].append(event_id)
        rows = []
        for n, agent in enumerate(self.agents):
            ids = by_agent[n]
            arrivals = sorted(
                t for e in ids for t in tally.received[e] if self.t0 + 1 < t < stream_end
            )
            gaps = [b - a for a, b in itertools.pairwise(arrivals)]
            latencies = [min(tally.received[e]) - tally.accepted[e] for e in ids]
            rows.append(
                {
                    "queue": n,
                    "home": agent.home,
                    "consumer_first_node": f"qkc{rotated(n)[0]}",
                    "worst_gap_s": round(max(gaps, default=0), 1),
                    "worst_gap_at_s": round(arrivals[gaps.index(max(gaps))] - self.t0, 1)
                    if gaps
                    else None,
                    "worst_latency_s": round(max(latencies, default=0), 1),
                }
            )
        return rows

    def sample(self) -> dict[str, tuple[int | None, float | None]]:
        pids: dict[str, int | None] = {f"qkc{i}": self.cluster.pid(i) for i in NODES}
        for replica in self.replicas:
            pids[f"replica{replica.index}"] = replica.process.pid if replica.process else None
        return {name: (pid, cpu_seconds(pid)) for name, pid in pids.items()}

    @staticmethod
    def usage(
        before: dict[str, tuple[int | None, float | None]],
        after: dict[str, tuple[int | None, float | None]],
        seconds: float,
    ) -> dict[str, Any]:
        """CPU (% of one core) over the stream of each process that lived through it (a
        killed one restarted with fresh counters), and its memory at the end."""
        result: dict[str, Any] = {}
        for name, (pid, cpu) in after.items():
            old_pid, old_cpu = before.get(name, (None, None))
            percent = None
            if pid == old_pid and cpu is not None and old_cpu is not None:
                percent = round(100 * (cpu - old_cpu) / seconds, 1)
            result[name] = {"cpu_percent": percent, "rss_mib": rss_mib(pid)}
        return result

    async def _drain(self, seconds: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            if all(event_id in self.tally.received for event_id in self.tally.accepted):
                return round(time.monotonic() - started, 1)
            await asyncio.sleep(0.5)
        return -1.0

    def figures(self, plan: dict[str, Any], stream_end: float, drained: float) -> dict[str, Any]:
        tally = self.tally
        accepted = tally.accepted
        consumed = {event_id for event_id in accepted if event_id in tally.received}
        deliveries = sum(len(times) for times in tally.received.values())
        latency = sorted(min(tally.received[e]) - accepted[e] for e in consumed)
        arrivals = sorted(
            t for times in tally.received.values() for t in times if self.t0 + 1 < t < stream_end
        )
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        worst_gap_at = gaps.index(max(gaps)) if gaps else 0

        def window(start: float, end: float) -> float:
            inside = [
                min(tally.received[e]) - accepted[e]
                for e in consumed
                if start <= accepted[e] - self.t0 < end
            ]
            return round(max(inside), 2) if inside else 0.0

        kill_times = {what: t for t, what in self.events}
        replica_kill = next(
            t for what, t in kill_times.items() if what.startswith("kill -9 replica")
        )
        node_kill = next(t for what, t in kill_times.items() if what.startswith("kill -9 broker"))
        return {
            "queue_type": self.queue_type,
            "rate_per_s": self.rate,
            "stream_seconds": self.stream_seconds,
            "agents_and_queues": len(self.agents),
            "events_sent": len(tally.sent_at),
            "events_accepted": len(accepted),
            "never_accepted": tally.never_accepted,
            "rejected_4xx": tally.rejected_4xx[:5],
            "http_retries_to_another_replica": tally.http_retries,
            "worst_accept_seconds": round(max(tally.accept_seconds, default=0), 2),
            "accept_p99_seconds": round(
                sorted(tally.accept_seconds)[int(len(tally.accept_seconds) * 0.99) - 1], 3
            )
            if tally.accept_seconds
            else None,
            "slowest_accepts": [text for _, text in sorted(tally.slow_accepts)[-8:]],
            "events_consumed": len(consumed),
            "lost": len(accepted) - len(consumed),
            "deliveries_consumed": deliveries,
            "duplicates": deliveries - len(consumed),
            "latency_p50_s": round(statistics.median(latency), 3) if latency else None,
            "latency_p99_s": round(latency[int(len(latency) * 0.99) - 1], 3) if latency else None,
            "latency_max_s": round(latency[-1], 2) if latency else None,
            "worst_stall_s": round(max(gaps, default=0), 2),
            "worst_stall_at_s": round(arrivals[worst_gap_at] - self.t0, 1) if gaps else None,
            "worst_latency_after_replica_kill_s": window(replica_kill, replica_kill + 10),
            "worst_latency_after_node_kill_s": window(node_kill, node_kill + 10),
            "drained_after_stream_s": drained,
            "consumer_reconnects": tally.consumer_reconnects,
            "consumer_errors": dict(tally.consumer_errors.most_common(8)),
            "registration_statuses": dict(
                sorted(
                    (status, tally.registration_statuses.count(status))
                    for status in set(tally.registration_statuses)
                )
            ),
            "timeline": self.events,
            "per_queue": self.per_queue(consumed, stream_end),
            "queues_while_node_down": self.while_down,
            **plan,
        }

    async def _query(self, sql: str) -> list[asyncpg.Record]:
        connection = await asyncpg.connect(self.database_url)
        try:
            return list(await connection.fetch(sql))
        finally:
            await connection.close()

    async def job_figures(self) -> dict[str, Any]:
        rows = await self._query(
            "SELECT job, status, started FROM job_runs WHERE trigger = 'schedule' ORDER BY started"
        )
        result: dict[str, Any] = {}
        for job, interval in (("reconcile", RECONCILE_INTERVAL), ("cleanup_stale", STALE_INTERVAL)):
            mine = [row for row in rows if row["job"] == job]
            ran = [row["started"] for row in mine if row["status"] != "skipped"]
            skipped = sum(1 for row in mine if row["status"] == "skipped")
            gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(ran)]
            result[job] = {
                "interval_s": interval,
                "runs": len(ran),
                "skipped_records": skipped,
                "shortest_gap_s": round(min(gaps), 1) if gaps else None,
                "statuses": sorted({row["status"] for row in mine}),
            }
        return result

    async def delivery_figures(self) -> dict[str, Any]:
        rows = await self._query(
            "SELECT state, count(*) AS n, max(attempts) AS attempts FROM deliveries GROUP BY state"
        )
        return {row["state"]: {"count": row["n"], "max_attempts": row["attempts"]} for row in rows}

    async def tear_down(self) -> None:
        for replica in self.replicas:
            await asyncio.to_thread(replica.stop)
        with contextlib.suppress(Exception):
            await self._admin_sql(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
        # This run's vhosts (and their queues) off the cluster, so the next run starts light.
        async with httpx.AsyncClient(
            base_url=self.cluster.management_url(1) + "/api", auth=("guest", "guest"), timeout=30
        ) as http:
            with contextlib.suppress(httpx.HTTPError):
                vhosts = (await http.get("/vhosts", params={"columns": "name,tags"})).json()
                for vhost in vhosts:
                    if f"queuekeeper:{self.tag}" in str(vhost.get("tags")):
                        await http.delete(f"/vhosts/{vhost['name']}")


async def queue_cost(cluster: Cluster, queue_type: str, count: int = 300) -> dict[str, Any]:
    """Memory the three nodes take per queue of this type (the arguments queuekeeper
    declares), for the per-cluster extrapolation in docs/scaling.md."""
    from queuekeeper.broker import topology
    from queuekeeper.config import Settings

    arguments = topology.queue_arguments(Settings(queue_type=queue_type))  # type: ignore[arg-type]
    vhost = f"qkc-cost-{queue_type}-{secrets.token_hex(3)}"
    pids = [cluster.pid(i) for i in NODES]
    async with httpx.AsyncClient(
        base_url=cluster.management_url(1) + "/api", auth=("guest", "guest"), timeout=60
    ) as http:
        (await http.put(f"/vhosts/{vhost}")).raise_for_status()
        await asyncio.sleep(2)
        before = sum(rss_mib(pid) or 0 for pid in pids)
        limit = asyncio.Semaphore(8)

        async def declare(n: int) -> None:
            async with limit:
                response = await http.put(
                    f"/queues/{vhost}/cost_{n}",
                    json={"durable": True, "auto_delete": False, "arguments": arguments},
                )
                response.raise_for_status()

        started = time.monotonic()
        await asyncio.gather(*(declare(n) for n in range(count)))
        declare_seconds = time.monotonic() - started
        await asyncio.sleep(3)
        after = sum(rss_mib(pid) or 0 for pid in pids)
        await http.delete(f"/vhosts/{vhost}")
    return {
        "queues": count,
        "declare_seconds": round(declare_seconds, 1),
        "cluster_rss_mib_before": round(before, 1),
        "cluster_rss_mib_after": round(after, 1),
        "kib_per_queue_cluster_wide": round((after - before) * 1024 / count, 1),
    }


async def run_scenario(cluster: Cluster, queue_type: str, **options: Any) -> dict[str, Any]:
    scenario = Scenario(cluster, queue_type, **options)
    try:
        return await scenario.run()
    finally:
        await scenario.tear_down()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue-type", choices=["quorum", "classic", "both"], default="both")
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--seconds", type=float, default=75)
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = parser.parse_args(argv)
    cluster = Cluster()
    results: dict[str, Any] = {}
    try:
        cluster.up()
        results["cluster"] = dict(cluster.timings)
        kinds = ["quorum", "classic"] if args.queue_type == "both" else [args.queue_type]
        for kind in kinds:
            results[kind] = asyncio.run(
                run_scenario(
                    cluster, kind, rate=args.rate, stream_seconds=args.seconds, agents=args.agents
                )
            )
            print(json.dumps({kind: results[kind]}, indent=1, default=str), flush=True)
    finally:
        left = cluster.down()
        results["cluster_pids_left"] = left
        print(f"cluster down; beam PIDs still alive: {left}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
