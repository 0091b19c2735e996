"""The published waldur-site-agent 1.0.5, unmodified, against queuekeeper and web-STOMP.

queuekeeper runs as a real uvicorn server (the agent brings its own HTTP
client); the agent runs its own event-processing set-up for all nine object
types in a subprocess from its own virtualenv, with only its message handler
replaced by a recorder (tests/agents/agent_runner.py). Then it is restarted,
and the second start must reuse everything the first one made.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import pytest
import uvicorn
import yaml
from prometheus_client import REGISTRY

from queuekeeper.app import create_app
from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from tests.agents.site_agent_venv import ensure_site_agent_venv
from tests.brokers import BROKER
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Backend

RUNNER = Path(__file__).with_name("agent_runner.py")

# 1.0.5's ObservableObjectTypeEnum, in the order the agent sets them up (contract 1).
AGENT_TYPES = [
    "order",
    "user_role",
    "resource",
    "service_account",
    "course_account",
    "offering_user",
    "offering_resources_sync",
    "importable_resources",
    "resource_periodic_limits",
]


def _hex() -> str:
    return uuid.uuid4().hex


def valid_payload(object_type: str) -> dict[str, Any]:
    """One payload per type with the fields SPEC 6 (and the agent's handlers) require."""
    payloads: dict[str, dict[str, Any]] = {
        "order": {"order_uuid": _hex(), "order_state": "executing"},
        "user_role": {
            "project_uuid": _hex(),
            "project_name": "Project X",
            "user_uuid": _hex(),
            "user_username": "alice",
            "granted": True,
            "role_name": "PROJECT.MEMBER",
        },
        "resource": {"resource_uuid": _hex()},
        "service_account": {
            "account_uuid": _hex(),
            "account_username": "svc-1",
            "project_uuid": _hex(),
            "action": "create",
        },
        "course_account": {
            "account_uuid": _hex(),
            "account_username": "course-1",
            "project_uuid": _hex(),
            "action": "delete",
        },
        "offering_user": {"offering_user_uuid": _hex(), "action": "username_set"},
        "offering_resources_sync": {"requested_by_user_uuid": _hex()},
        "importable_resources": {"backend_resource_request_uuid": _hex()},
        "resource_periodic_limits": {
            "resource_uuid": _hex(),
            "backend_id": "acc-1",
            "action": "apply_periodic_settings",
            "settings": {"fairshare": 100, "grp_tres_mins": {"cpu": 6000}},
        },
    }
    return payloads[object_type]


# --- queuekeeper as a real server, with a log of what it answered ------------------


@dataclass
class RequestLog:
    """ASGI middleware: (method, path, status) of every HTTP request, as the agent saw it."""

    app: Any
    entries: list[tuple[str, str, int]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def record(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.entries.append((scope["method"], scope["path"], message["status"]))
                self.seconds.append(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, record)

    def clear(self) -> None:
        self.entries.clear()
        self.seconds.clear()

    def agent_requests(self) -> list[tuple[str, str, int]]:
        return [entry for entry in self.entries if "/internal/" not in entry[1]]


@dataclass
class Server:
    url: str
    log: RequestLog


@pytest.fixture
async def server(settings: Settings, clean_state: None) -> AsyncIterator[Server]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = RequestLog(create_app(settings.model_copy(update={"public_url": url})))
    config = uvicorn.Config(log, lifespan="on", log_level="warning", access_log=False)
    uvicorn_server = uvicorn.Server(config)
    task = asyncio.create_task(uvicorn_server.serve(sockets=[sock]))
    deadline = time.monotonic() + 30
    while not uvicorn_server.started:
        assert not task.done(), "queuekeeper did not start"
        assert time.monotonic() < deadline, "queuekeeper did not start within 30 s"
        await asyncio.sleep(0.05)
    try:
        yield Server(url, log)
    finally:
        uvicorn_server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


# --- the agent in its own virtualenv ---------------------------------------------------


@pytest.fixture(scope="session")
def site_agent_python() -> Path:
    return ensure_site_agent_venv()


def agent_config(
    path: Path, api_url: str, token: str, offering_uuid: str, *, all_types: bool = True
) -> Path:
    """The agent configuration docs/agents.md recommends; all nine types, or `order` only."""
    offering: dict[str, Any] = {
        "name": "queuekeeper end-to-end",
        "waldur_api_url": api_url,
        "waldur_api_token": token,
        "waldur_offering_uuid": offering_uuid,
        "backend_type": "none",
        "stomp_enabled": True,
        "stomp_ws_host": "127.0.0.1",
        "stomp_ws_port": 15674,
        "stomp_ws_path": "/ws",
        "websocket_use_tls": False,
        "verify_ssl": False,
        # Any non-empty backend name enables the types; none is installed here, so the
        # agent logs "Unsupported backend type" for its optional federation hook.
        "order_processing_backend": "queuekeeper-e2e",
    }
    if all_types:
        offering.update(
            {
                "membership_sync_backend": "queuekeeper-e2e",
                "resource_import_enabled": True,
                "backend_settings": {"periodic_limits": {"enabled": True}},
            }
        )
    path.write_text(yaml.safe_dump({"offerings": [offering]}))
    return path


class RunningAgent:
    def __init__(self, process: asyncio.subprocess.Process, workdir: Path, name: str) -> None:
        self.process = process
        self.record = workdir / f"{name}.received.jsonl"
        self.status_file = workdir / f"{name}.status.json"
        self.output = workdir / f"{name}.log"
        self.status: dict[str, Any] = {}

    def log_tail(self) -> str:
        text = self.output.read_text(errors="replace") if self.output.exists() else ""
        return text[-6000:]

    async def ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.status_file.exists():
            if self.process.returncode is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"agent set-up did not finish (exit {self.process.returncode}):\n"
                    + self.log_tail()
                )
            await asyncio.sleep(0.1)
        self.status = json.loads(self.status_file.read_text())
        assert self.status["event"] == "ready", f"{self.status}\n{self.log_tail()}"
        return self.status

    def received(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        lines = self.record.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    async def wait_received(self, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.received()) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self.received()

    async def stop(self) -> None:
        if self.process.returncode is None:
            assert self.process.stdin is not None
            self.process.stdin.write(b"stop\n")
            await self.process.stdin.drain()
            try:
                await asyncio.wait_for(self.process.wait(), 30)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


async def start_agent(python: Path, config: Path, workdir: Path, name: str) -> RunningAgent:
    output = (workdir / f"{name}.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        str(python),
        str(RUNNER),
        str(config),
        str(workdir / f"{name}.received.jsonl"),
        str(workdir / f"{name}.status.json"),
        "--setup-timeout",
        "90",
        "--lifetime",
        "300",
        stdin=asyncio.subprocess.PIPE,
        stdout=output,
        stderr=output,
    )
    output.close()
    return RunningAgent(process, workdir, name)


# --- events and the broker's view -------------------------------------------------------


Publisher = Callable[[str, dict[str, Any]], Awaitable[str]]


def publisher_for(
    http: httpx.AsyncClient, offering: uuid.UUID, queue_of: dict[str, str]
) -> Publisher:
    """Publish as the backend does: POST /api/internal/events/, waiting for the confirm."""

    async def publish(object_type: str, payload: dict[str, Any]) -> str:
        event_id = f"e2e-{object_type}-{uuid.uuid4().hex[:8]}"
        response = await http.post(
            "/api/internal/events/",
            params={"wait": "true"},
            json={
                "event_id": event_id,
                "offering_uuid": offering.hex,
                "object_type": object_type,
                "payload": payload,
            },
            headers={"Authorization": f"Bearer {SERVICE_TOKEN}"},
        )
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["queued"] == 1, answer
        assert answer["deliveries"] == [
            {
                "queue_name": queue_of[object_type],
                "vhost": answer["deliveries"][0]["vhost"],
                "state": "published",
            }
        ], answer
        return event_id

    return publish


async def broker_snapshot(
    management: ManagementClient, settings: Settings, vhost: str
) -> dict[str, Any]:
    page = await management.list_queues_page(vhost, page=1, page_size=500)
    users = sorted(
        user.name for user in await management.list_users() if settings.instance_tag in user.tags
    )
    permissions = {
        user: await management.get_permissions(vhost, user) for user in users if len(user) == 32
    }
    vhosts = sorted(
        item.name for item in await management.list_vhosts() if settings.instance_tag in item.tags
    )
    return {
        "queues": sorted((item.name, json.dumps(item.arguments)) for item in page.items),
        "users": users,
        "permissions": permissions,
        "vhosts": vhosts,
    }


def expected_sequence(first_start: bool, identity: str, subscriptions: list[str]) -> list[Any]:
    identities = "/api/marketplace-site-agent-identities/"
    sequence: list[Any] = [("GET", identities, 200)]
    sequence.append(
        ("POST", identities, 201) if first_start else ("PUT", f"{identities}{identity}/", 200)
    )
    status = 201 if first_start else 200
    for subscription in subscriptions:
        sequence.append(("POST", f"{identities}{identity}/register_event_subscription/", status))
        sequence.append(("POST", f"/api/event-subscriptions/{subscription}/create_queue/", status))
    return sequence


def queue_names(offering: uuid.UUID, consumers: list[dict[str, Any]]) -> dict[str, str]:
    """What both sides compute: `subscription_<sub hex>_offering_<offering hex>_<type>`."""
    return {
        item["object_type"]: f"subscription_{item['subscription']}_offering_{offering.hex}_"
        f"{item['object_type']}"
        for item in consumers
    }


async def assert_receives_every_type(
    running: RunningAgent,
    publish: Publisher,
    offering: uuid.UUID,
    queues: dict[str, str],
    already: int = 0,
) -> None:
    sent: dict[str, tuple[str, dict[str, Any]]] = {}
    for object_type in AGENT_TYPES:
        payload = valid_payload(object_type)
        sent[object_type] = (await publish(object_type, payload), payload)
    received = (await running.wait_received(already + len(AGENT_TYPES)))[already:]
    assert sorted(item["object_type"] for item in received) == sorted(AGENT_TYPES), (
        f"{received}\n{running.log_tail()}"
    )
    for item in received:
        event_id, payload = sent[item["object_type"]]
        body = json.loads(item["body"])
        assert body == {
            **payload,
            "offering_uuid": offering.hex,
            "object_type": item["object_type"],
        }
        headers = item["headers"]
        assert headers["amqp-message-id"] == event_id  # what an agent deduplicates on
        assert headers["content-type"] == "application/json"
        assert headers["subscription"] == queues[item["object_type"]]
        assert headers["destination"] == f"/queue/{queues[item['object_type']]}"


@pytest.mark.timeout(900)
async def test_published_site_agent_sets_up_receives_and_restarts_idempotently(
    server: Server,
    site_agent_python: Path,
    management: ManagementClient,
    settings: Settings,
    tmp_path: Path,
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        backend = Backend(http, SERVICE_TOKEN)
        agent, offering = await backend.agent_with_offering()
        config = agent_config(
            tmp_path / "agent.yaml", f"{server.url}/api/", agent.token, offering.hex
        )

        # --- first start: everything is created --------------------------------------
        server.log.clear()
        first = await start_agent(site_agent_python, config, tmp_path, "first")
        try:
            status = await first.ready(timeout=120)
            agent_requests = server.log.agent_requests()
            first_rest = sum(server.log.seconds)
            consumers = status["consumers"]
            assert [item["object_type"] for item in consumers] == AGENT_TYPES, first.log_tail()
            assert all(item["connected"] for item in consumers)
            assert {item["user_uuid"] for item in consumers} == {agent.uuid.hex}
            identities = (
                await http.get("/api/marketplace-site-agent-identities/", headers=agent.headers)
            ).json()
            assert len(identities) == 1
            identity = identities[0]["uuid"]
            subscriptions = [item["subscription"] for item in consumers]
            assert agent_requests == expected_sequence(True, identity, subscriptions)

            queues = queue_names(offering, consumers)
            publish = publisher_for(http, offering, queues)
            await assert_receives_every_type(first, publish, offering, queues)
            before = await broker_snapshot(management, settings, agent.vhost)
            assert len([q for q in before["queues"] if q[0].startswith("subscription_")]) == 9
            assert sorted(subscriptions) == sorted(u for u in before["users"] if len(u) == 32)
        finally:
            await first.stop()
        assert first.process.returncode == 0, first.log_tail()

        # --- restart: everything is reused ---------------------------------------------
        server.log.clear()
        second = await start_agent(site_agent_python, config, tmp_path, "second")
        try:
            status = await second.ready(timeout=120)
            second_rest = sum(server.log.seconds)
            assert [item["subscription"] for item in status["consumers"]] == subscriptions
            assert server.log.agent_requests() == expected_sequence(False, identity, subscriptions)
            after = await broker_snapshot(management, settings, agent.vhost)
            assert after == before
            await assert_receives_every_type(second, publish, offering, queues)
        finally:
            await second.stop()
        assert second.process.returncode == 0, second.log_tail()

        listed = await http.get("/api/event-subscriptions/", headers=agent.headers)
        assert len(listed.json()) == 9
        registered = await http.get("/api/event-subscription-queues/", headers=agent.headers)
        assert len(registered.json()) == 9
        print(  # the figures quoted in docs/agents.md (run with -s to see them)
            f"\nsite-agent start-up, 9 types: first start {first.status['setup_seconds']:.2f} s "
            f"(queuekeeper {first_rest:.2f} s of it; +{first.status['import_seconds']:.2f} s "
            f"imports), restart {second.status['setup_seconds']:.2f} s (queuekeeper "
            f"{second_rest:.2f} s; +{second.status['import_seconds']:.2f} s)",
            file=sys.stderr,
        )


@pytest.mark.timeout(300)
async def test_an_upper_case_offering_uuid_is_flagged_and_its_agent_receives_nothing(
    server: Server, site_agent_python: Path, tmp_path: Path
) -> None:
    """Why docs/agents.md says to configure the offering uuid in lowercase (contract 4.1)."""
    metric = "queuekeeper_agent_offering_uuid_not_lowercase_total"
    flagged_before = REGISTRY.get_sample_value(metric) or 0.0
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        backend = Backend(http, SERVICE_TOKEN)
        agent, offering = await backend.agent_with_offering()
        configured = str(offering).upper()
        config = agent_config(
            tmp_path / "agent.yaml", f"{server.url}/api/", agent.token, configured, all_types=False
        )
        running = await start_agent(site_agent_python, config, tmp_path, "upper")
        try:
            status = await running.ready(timeout=120)
            # queuekeeper accepted every call and made the lowercase queue...
            assert [entry[2] for entry in server.log.agent_requests()] == [200, 201, 201, 201]
            assert REGISTRY.get_sample_value(metric) == flagged_before + 1
            (consumer,) = status["consumers"]
            queue = queue_names(offering, [consumer])["order"]
            publish = publisher_for(http, offering, {"order": queue})
            await publish("order", valid_payload("order"))
            # ...but the agent subscribes to `..._offering_<UPPER HEX>_order`, is refused
            # NOT_FOUND and reconnects in a loop, so the event stays in the queue.
            await asyncio.sleep(2)
            assert running.received() == []
            connection = await aio_pika.connect(BROKER.amqp_url(agent.vhost))
            async with connection:
                channel = await connection.channel()
                declared = await channel.declare_queue(queue, passive=True)
                assert declared.declaration_result.message_count == 1
            reconnects = running.log_tail().count("attempting reconnection")
            assert reconnects >= 3, running.log_tail()
        finally:
            await running.stop()
