"""`queuekeeper serve` with several accept workers and relay processes: events are accepted
on the one port and delivered to a real STOMP consumer; a child killed with SIGKILL is
restarted and nothing accepted is lost; /readyz and /metrics cover every process; SIGTERM
stops them all within seconds. On 2 cores, by default, `serve` is one process with the
relay inside."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from queuekeeper.common.processes import MULTIPROC_ENV, STATUS_FILE, alive
from queuekeeper.config import Settings
from tests.conftest import SERVICE_TOKEN
from tests.events.support import order_event, register
from tests.helpers import Backend
from tests.proxy import closed_port
from tests.stomp_client import StompConsumer

QUEUEKEEPER = str(Path(sys.executable).parent / "queuekeeper")


@dataclass
class Served:
    base: str
    process: subprocess.Popen[bytes]
    metrics: Path
    log: Path

    def status(self) -> dict[str, int | None]:
        """Each supervised process and its pid, as the supervisor last wrote them."""
        entries = json.loads((self.metrics / STATUS_FILE).read_text())["processes"]
        return {entry["name"]: entry["pid"] for entry in entries}


def _serve(
    settings: Settings, tmp_path: Path, cpus: set[int] | None = None, **env: str
) -> Iterator[Served]:
    port = closed_port()
    metrics = tmp_path / "metrics"
    environment = {
        **{key: value for key, value in os.environ.items() if not key.startswith("QUEUEKEEPER")},
        "QUEUEKEEPER_DATABASE_URL": settings.database_url,
        "QUEUEKEEPER_AMQP_URL": settings.amqp_url,
        "QUEUEKEEPER_MANAGEMENT_URL": settings.management_url,
        "QUEUEKEEPER_INSTANCE_NAME": settings.instance_name,
        "QUEUEKEEPER_SERVICE_TOKENS": SERVICE_TOKEN,
        "QUEUEKEEPER_LOG_FORMAT": "json",
        MULTIPROC_ENV: str(metrics),
        **env,
    }
    log = tmp_path / "serve.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [QUEUEKEEPER, "serve", "--port", str(port)],
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            # The cores `serve` may run on, as a container's CPU set would give them.
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )
    served = Served(f"http://127.0.0.1:{port}", process, metrics, log)
    try:
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def supervised(settings: Settings, tmp_path: Path, clean_state: None) -> Iterator[Served]:
    yield from _serve(
        settings,
        tmp_path,
        QUEUEKEEPER_ACCEPT_WORKERS="2",
        QUEUEKEEPER_RELAY_PROCESSES="2",
        # The killed relay's claims come back when their lease ends: keep the wait short.
        QUEUEKEEPER_PUBLISH_TIMEOUT="3",
        QUEUEKEEPER_RELAY_LEASE_SECONDS="5",
    )


async def _ready(served: Served, timeout: float = 60.0) -> dict[str, object]:
    """/readyz once it answers 200 with every supervised process running."""
    deadline = time.monotonic() + timeout
    body: dict[str, object] = {}
    async with httpx.AsyncClient(base_url=served.base, timeout=5) as client:
        while time.monotonic() < deadline:
            assert served.process.poll() is None, served.log.read_text()[-3000:]
            try:
                response = await client.get("/readyz", headers={"Connection": "close"})
                body = response.json()
                processes = body.get("checks", {}).get("processes", {})  # type: ignore[union-attr]
                nodes = processes.get("nodes") or {}
                if (
                    response.status_code == 200
                    and len(nodes) == 4
                    and all(node["ok"] for node in nodes.values())
                ):
                    return body
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"not ready with 4 processes: {body}\n{served.log.read_text()[-3000:]}")


async def _answers_after_idle(base: str, idle: float) -> bool:
    """Whether a connection that answered once still answers after `idle` seconds unused."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    request = f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    try:
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(idle)
            try:
                writer.write(request)
                status = await reader.readline()
            except ConnectionResetError:  # closed by the server while idle, then reset
                return False
            if not status:  # closed by the server while idle
                return False
            assert status.startswith(b"HTTP/1.1 200"), status
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            await reader.readexactly(length)
        return True
    finally:
        writer.close()


def _total(text: str, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


async def _totals_once_settled(
    client: httpx.AsyncClient, expected: int, timeout: float = 20.0
) -> set[tuple[float, float]]:
    """(events accepted, copies published) from six scrapes on new connections, once they
    reach `expected` (or the timeout passes)."""
    deadline = time.monotonic() + timeout
    while True:
        totals = set()
        for _ in range(6):
            text = (await client.get("/metrics", headers={"Connection": "close"})).text
            published = sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "queuekeeper_deliveries_total"
                and sample.labels.get("outcome") == "published"
            )
            totals.add((_total(text, "queuekeeper_events_accepted_total"), published))
        if all(min(pair) >= expected for pair in totals) or time.monotonic() > deadline:
            return totals
        await asyncio.sleep(0.5)


async def _restarted(
    supervised: Served, names: tuple[str, ...], before: dict[str, int | None]
) -> dict[str, int | None]:
    """The status once the supervisor has restarted `names` (it looks every 0.2 s; the
    restart of a child that lived 10 s or more follows at once)."""
    for _ in range(100):
        status = supervised.status()
        if all(status[name] not in (None, before[name]) for name in names):
            return status
        await asyncio.sleep(0.1)
    return supervised.status()


async def _post_until_answered(client: httpx.AsyncClient, event: dict[str, object]) -> int:
    """A backend's retry: a connection lost with a killed worker is sent again (the same
    event_id, so a retry of an event already stored is recognised, not stored twice)."""
    for _ in range(50):
        try:
            response = await client.post(
                "/api/internal/events/", json=event, headers={"Connection": "close"}
            )
            return response.status_code
        except httpx.TransportError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"{event['event_id']} never answered")


@pytest.mark.timeout(240)
async def test_accept_workers_and_relays_deliver_survive_kill_9_and_stop_on_sigterm(
    supervised: Served,
) -> None:
    first = await _ready(supervised)
    assert first["status"] == "ready"
    pids = supervised.status()
    assert sorted(pids) == ["accept-0", "accept-1", "relay-0", "relay-1"]
    assert all(alive(pid) for pid in pids.values())

    service = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
    async with httpx.AsyncClient(base_url=supervised.base, timeout=30, headers=service) as client:
        backend = Backend(client, SERVICE_TOKEN)
        registered = await register(backend)
        consumer = StompConsumer(
            registered.vhost, uuid.UUID(registered.subscription).hex, registered.agent.token
        )
        consumer.connect()
        consumer.subscribe(f"/amq/queue/{registered.queue_name}")
        try:
            accepted: list[str] = []
            # Retries answered 200: the killed worker had stored the event before it died.
            recognised: list[str] = []

            async def send(count: int, tag: str) -> None:
                for n in range(count):
                    event = order_event(registered.offering, event_id=f"{tag}-{n}")
                    status = await _post_until_answered(client, event)
                    assert status in (200, 202)
                    accepted.append(str(event["event_id"]))
                    if status == 200:
                        recognised.append(str(event["event_id"]))

            await send(20, "before")
            # The accept workers run no relay: what reaches the consumer went through a
            # relay process.
            received = await asyncio.to_thread(consumer.wait_for, 20, 30)
            assert {m.headers.get("amqp-message-id") for m in received} >= set(accepted)

            # /metrics sums every process, whichever worker answers (a new connection per
            # scrape): both accept workers' acceptances, both relays' publishes (a copy is
            # counted once settled, just after the consumer may have it).
            totals = await _totals_once_settled(client, 20)
            assert totals == {(20.0, 20.0)}, totals

            # kill -9 one accept worker and one relay while events keep coming.
            sending = asyncio.create_task(send(60, "during"))
            await asyncio.sleep(0.3)
            os.kill(int(pids["accept-0"] or 0), signal.SIGKILL)
            os.kill(int(pids["relay-0"] or 0), signal.SIGKILL)
            await sending
            await _ready(supervised)
            restarted = await _restarted(supervised, ("accept-0", "relay-0"), pids)
            assert restarted["accept-0"] not in (None, pids["accept-0"])
            assert restarted["relay-0"] not in (None, pids["relay-0"])
            assert (restarted["accept-1"], restarted["relay-1"]) == (
                pids["accept-1"],
                pids["relay-1"],
            )
            await send(20, "after")

            # Nothing accepted is lost (copies the killed relay held come back when their
            # lease runs out).
            received = await asyncio.to_thread(consumer.wait_for_ids, accepted, 60)
            missing = set(accepted) - {m.headers.get("amqp-message-id") for m in received}
            assert not missing, f"{len(missing)} accepted events never delivered: {missing}"
        finally:
            consumer.close()

        # The killed processes' counts stay in the totals: a dead worker's file is kept.
        totals = await _totals_once_settled(client, len(accepted))
    accepted_totals = {pair[0] for pair in totals}
    assert len(accepted_totals) == 1, totals  # every scrape, whichever worker answered
    # A worker killed between its commit and its counter's increment leaves one uncounted
    # (so may the killed relay between a settlement and its counter: publishes only grow).
    assert len(accepted) - len(recognised) <= accepted_totals.pop() <= len(accepted)
    assert min(pair[1] for pair in totals) >= 20

    # SIGTERM stops the supervisor and every child within seconds.
    children = [pid for pid in supervised.status().values() if pid is not None]
    started = time.monotonic()
    supervised.process.send_signal(signal.SIGTERM)
    assert supervised.process.wait(timeout=15) == 0
    assert time.monotonic() - started < 15  # the supervisor kills what is left after 10 s
    assert not [pid for pid in children if alive(pid)]
    assert not (supervised.metrics / STATUS_FILE).exists()


@pytest.mark.timeout(120)
async def test_serve_on_two_cores_is_one_process_with_the_relay_inside_by_default(
    settings: Settings, tmp_path: Path, clean_state: None
) -> None:
    """Neither QUEUEKEEPER_ACCEPT_WORKERS nor QUEUEKEEPER_RELAY_PROCESSES set, 2 cores to
    run on: no supervisor, no child, and the relay starts in the one process. An idle
    connection is kept for QUEUEKEEPER_HTTP_KEEP_ALIVE_SECONDS, then closed."""
    cpus = set(sorted(os.sched_getaffinity(0))[:2])
    for served in _serve(settings, tmp_path, cpus, QUEUEKEEPER_HTTP_KEEP_ALIVE_SECONDS="2"):
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(base_url=served.base, timeout=5) as client:
            while True:
                assert served.process.poll() is None, served.log.read_text()[-3000:]
                assert time.monotonic() < deadline, served.log.read_text()[-3000:]
                try:
                    if (await client.get("/readyz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
            body = (await client.get("/readyz")).json()
        idle_briefly, idle_long = await asyncio.gather(
            _answers_after_idle(served.base, 1.0), _answers_after_idle(served.base, 3.0)
        )
        assert idle_briefly, "closed before QUEUEKEEPER_HTTP_KEEP_ALIVE_SECONDS"
        assert not idle_long, "kept past QUEUEKEEPER_HTTP_KEEP_ALIVE_SECONDS"
        assert "processes" not in body["checks"]
        children = Path(f"/proc/{served.process.pid}/task/{served.process.pid}/children")
        assert children.read_text().split() == []
        logged = [
            json.loads(line) for line in served.log.read_text().splitlines() if line[:1] == "{"
        ]
        assert "relay_started" in {line.get("event") for line in logged}
        assert "supervisor_started" not in {line.get("event") for line in logged}
