"""What the end-to-end tests of the published site agents share: queuekeeper as a real
server with a log of what it answered, the agent's configuration, the agent process, and
the broker's view. The fixtures using these are in conftest.py beside this file."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from tests.brokers import BROKER
from tests.conftest import SERVICE_TOKEN

RUNNER = Path(__file__).with_name("agent_runner.py")
# What waldur-site-agent 1.0.5 sets up with every feature on, in its order: its
# ObservableObjectTypeEnum (agent-protocols 1.0.5 §1).
AGENT_105_TYPES = [
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
# What waldur-site-agent 1.0.7 asks register_queue for with every feature on, in its order
# (agent-protocols 1.0.7 §1): 1.0.5's, with `resource_api_key_rotation` after `order`.
AGENT_107_TYPES = ["order", "resource_api_key_rotation", *AGENT_105_TYPES[1:]]


def _hex() -> str:
    return uuid.uuid4().hex


def valid_payload(object_type: str) -> dict[str, Any]:
    """One payload per type with the fields contract §6 (and the agent's handlers) require."""
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
        "resource_api_key_rotation": {
            "action": "rotate",
            "resource_uuid": _hex(),
            "resource_backend_id": "acc-1",
            "api_key_uuid": _hex(),
            "client_id": "client-1",
        },
        "service_provider_project_group": {
            "action": "create",
            "service_provider_uuid": _hex(),
            "customer_uuid": _hex(),
            "project_group_uuid": _hex(),
            "project_uuid": _hex(),
            "name": "pg_x",
            "gid": 20001,
        },
    }
    if object_type not in payloads:
        raise AssertionError(
            f"The agent subscribes to {object_type!r}, which has no test payload yet: add one "
            "to tests/agents/harness.py valid_payload (and a model to events/payloads.py if "
            "the agent reads fields of it)."
        )
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

    def timed_agent_requests(self) -> list[tuple[str, str, int, float]]:
        """(method, path, status, seconds queuekeeper took to answer) of the agent's requests."""
        return [
            (*entry, seconds)
            for entry, seconds in zip(self.entries, self.seconds, strict=True)
            if "/internal/" not in entry[1]
        ]


@dataclass
class Server:
    url: str
    log: RequestLog


def agent_config(
    path: Path,
    api_url: str,
    token: str,
    offering_uuid: str,
    *,
    all_types: bool = True,
    stomp_defaults: bool = False,
) -> Path:
    """The agent configuration docs/tutorial/site-agent.md recommends; all nine types, or
    `order` only.

    The broker is RabbitMQ's web-STOMP, dialled directly without TLS; with `stomp_defaults`
    the configuration says nothing about the broker or TLS, as a site's does: the agent then
    uses wss on the REST host, port 443, path /rmqws-stomp, and checks certificates."""
    broker: dict[str, Any] = {
        "stomp_ws_host": BROKER.host,
        "stomp_ws_port": BROKER.web_stomp_port,
        "stomp_ws_path": "/ws",
        "websocket_use_tls": False,
        "verify_ssl": False,
    }
    offering: dict[str, Any] = {
        "name": "queuekeeper end-to-end",
        "waldur_api_url": api_url,
        "waldur_api_token": token,
        "waldur_offering_uuid": offering_uuid,
        "backend_type": "none",
        "stomp_enabled": True,
        **({} if stomp_defaults else broker),
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
        # The agent's process may be writing a line as it is read: only whole lines count.
        whole, _partial = self.record.read_text().rpartition("\n")[::2]
        return [json.loads(line) for line in whole.splitlines() if line.strip()]

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


async def start_agent(
    python: Path,
    config: Path,
    workdir: Path,
    name: str,
    *extra: str,
    env: dict[str, str] | None = None,
) -> RunningAgent:
    """The runner with this configuration; `env` is added to the test's environment."""
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
        *extra,
        stdin=asyncio.subprocess.PIPE,
        stdout=output,
        stderr=output,
        env={**os.environ, **env} if env else None,
    )
    output.close()
    return RunningAgent(process, workdir, name)


# --- events and the broker's view -------------------------------------------------------


Publisher = Callable[[str, dict[str, Any]], Awaitable[str]]


async def publish_event(
    http: httpx.AsyncClient, offering: uuid.UUID, object_type: str, payload: dict[str, Any]
) -> dict[str, Any]:
    """As the backend does: POST /api/internal/events/?wait=true; the answer."""
    response = await http.post(
        "/api/internal/events/",
        params={"wait": "true"},
        json={
            "event_id": f"e2e-{object_type}-{uuid.uuid4().hex[:8]}",
            "offering_uuid": offering.hex,
            "object_type": object_type,
            "payload": payload,
        },
        headers={"Authorization": f"Bearer {SERVICE_TOKEN}"},
    )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


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
