"""A real `queuekeeper serve`: huge bodies neither grow its memory nor stall it, and
`X-Forwarded-For` from an unlisted peer (loopback included) is not believed."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from bench._support import live_process

from queuekeeper.config import Settings
from tests.conftest import SERVICE_TOKEN
from tests.security.exhaust import attack

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


@dataclass
class Served:
    base: str
    pid: int


@pytest.fixture
def served(settings: Settings, clean_state: None) -> Iterator[Served]:
    with live_process(
        settings,
        QUEUEKEEPER_AMQP_URL=settings.amqp_url,
        QUEUEKEEPER_MANAGEMENT_URL=settings.management_url,
        QUEUEKEEPER_SCHEDULER_ENABLED="false",
    ) as (base, process):
        yield Served(base, process.pid)


def _agent_token(served: Served) -> str:
    """A user pushed to the served instance; its API token."""
    token = secrets.token_hex(20)
    response = httpx.put(
        f"{served.base}/api/internal/users/{uuid.uuid4()}/",
        json={"username": "agent", "token": token},
        headers=SERVICE,
    )
    assert response.status_code == 201, response.text
    return token


def test_huge_bodies_neither_grow_memory_nor_stall_the_service(served: Served) -> None:
    # Before: four 63 MB POSTs without credentials took RSS from 509 to 1,401 MiB and
    # stalled /healthz for ~3 s. Each is now a 401 on its headers.
    unauthenticated = attack(served.base, served.pid)
    print("no credentials:", unauthenticated)
    assert unauthenticated.statuses == [401] * 4
    assert unauthenticated.growth < 40
    assert unauthenticated.healthz_worst < 0.5

    agent = {"Authorization": f"Token {_agent_token(served)}"}
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
    token = _agent_token(served)
    response = httpx.post(
        f"{served.base}/api/event-subscriptions/",
        json={},
        headers={"Authorization": f"Token {token}", "X-Forwarded-For": "203.0.113.9"},
    )
    assert response.status_code == 201, response.text
    assert response.json()["source_ip"] == "127.0.0.1"
