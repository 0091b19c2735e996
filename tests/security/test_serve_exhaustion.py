"""A real `queuekeeper serve`: huge bodies neither grow its memory nor stall it, and
`X-Forwarded-For` from an unlisted peer (loopback included) is not believed."""

from __future__ import annotations

import os
import secrets
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

from queuekeeper.config import Settings
from tests.conftest import SERVICE_TOKEN
from tests.proxy import free_port
from tests.security.exhaust import attack

QUEUEKEEPER = str(Path(sys.executable).parent / "queuekeeper")
SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


@dataclass
class Served:
    base: str
    pid: int


@pytest.fixture
def served(settings: Settings, clean_state: None, tmp_path: Path) -> Iterator[Served]:
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        {
            "QUEUEKEEPER_DATABASE_URL": settings.database_url,
            "QUEUEKEEPER_AMQP_URL": settings.amqp_url,
            "QUEUEKEEPER_MANAGEMENT_URL": settings.management_url,
            "QUEUEKEEPER_INSTANCE_NAME": settings.instance_name,
            "QUEUEKEEPER_SERVICE_TOKENS": SERVICE_TOKEN,
            "QUEUEKEEPER_SCHEDULER_ENABLED": "false",
            "QUEUEKEEPER_LOG_FORMAT": "json",
            "QUEUEKEEPER_LOG_LEVEL": "WARNING",
        }
    )
    log = tmp_path / "serve.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [QUEUEKEEPER, "serve", "--port", str(port)],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield Served(base, process.pid)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_huge_bodies_neither_grow_memory_nor_stall_the_service(served: Served) -> None:
    # Before: four 63 MB POSTs without credentials took RSS from 509 to 1,401 MiB and
    # stalled /healthz for ~3 s. Each is now a 401 on its headers.
    unauthenticated = attack(served.base, served.pid)
    print("no credentials:", unauthenticated)
    assert unauthenticated.statuses == [401] * 4
    assert unauthenticated.growth < 40
    assert unauthenticated.healthz_worst < 0.5

    token = secrets.token_hex(20)
    response = httpx.put(
        f"{served.base}/api/internal/users/{uuid.uuid4()}/",
        json={"username": "big-sender", "token": token},
        headers=SERVICE,
    )
    assert response.status_code == 201, response.text
    agent = {"Authorization": f"Token {token}"}
    # An authenticated agent: refused by Content-Length, or counted while streamed.
    sized = attack(served.base, served.pid, headers=agent)
    print("agent, Content-Length:", sized)
    assert sized.statuses == [413] * 4
    streamed = attack(served.base, served.pid, headers=agent, chunked=True)
    print("agent, chunked:", streamed)
    assert streamed.statuses == [413] * 4
    assert max(sized.growth, streamed.growth) < 40
    assert max(sized.healthz_worst, streamed.healthz_worst) < 0.5


def test_forwarded_for_from_an_unlisted_loopback_peer_is_not_believed(served: Served) -> None:
    token = secrets.token_hex(20)
    response = httpx.put(
        f"{served.base}/api/internal/users/{uuid.uuid4()}/",
        json={"username": "behind-nothing", "token": token},
        headers=SERVICE,
    )
    assert response.status_code == 201, response.text
    response = httpx.post(
        f"{served.base}/api/event-subscriptions/",
        json={},
        headers={"Authorization": f"Token {token}", "X-Forwarded-For": "203.0.113.9"},
    )
    assert response.status_code == 201, response.text
    assert response.json()["source_ip"] == "127.0.0.1"
