"""Sizing figures for docs/howto/deploy.md ("Sizing"): database bytes per retained event and
delivery, and broker memory per agent (vhost, queues, broker user, STOMP connection).

    .venv/bin/python -m bench.sizing            # BENCH_EVENTS=20000 BENCH_AGENTS=100

The database part runs the real service in-process (relay off, so every copy stays in the
outbox as a retained row) on a fresh PostgreSQL database, posts events in batches of 1,000
and reads `pg_total_relation_size` (tables, indexes, TOAST). The broker part makes agents'
objects through the provisioner and opens one web-STOMP connection per agent (as 1.0.7
does; 1.0.5 opens one per object type), reading the node's memory breakdown before and
after. The broker is shared: its figures are deltas of the whole node, so other clients
add noise; run it on a quiet broker for tight numbers.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid
from typing import Any

import httpx
import stomp
from asgi_lifespan import LifespanManager
from sqlalchemy import text

from bench._support import SERVICE_TOKEN, bench_database, remove_broker_objects
from queuekeeper.app import create_app
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.passwords import rabbit_password_hash
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.config import Settings
from queuekeeper.db import create_engine

EVENTS = int(os.environ.get("BENCH_EVENTS", "20000"))
AGENTS = int(os.environ.get("BENCH_AGENTS", "100"))
BATCH = 1000
MIB = 1024 * 1024


def order_payload() -> dict[str, Any]:
    """An order event as Waldur sends it (about 300 bytes of JSON)."""
    return {
        "order_uuid": uuid.uuid4().hex,
        "order_state": "executing",
        "action": "create",
        "project_uuid": uuid.uuid4().hex,
        "customer_uuid": uuid.uuid4().hex,
        "resource_uuid": uuid.uuid4().hex,
        "resource_name": "allocation-" + secrets.token_hex(4),
    }


async def database_figures(settings: Settings) -> None:
    app = create_app(settings)
    headers = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
    async with (
        LifespanManager(app, startup_timeout=60, shutdown_timeout=60) as manager,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=manager.app), base_url="http://bench", timeout=120
        ) as http,
    ):
        user, offering, token = uuid.uuid4(), uuid.uuid4(), secrets.token_hex(20)
        await http.put(
            f"/api/internal/users/{user}/", json={"username": "u", "token": token}, headers=headers
        )
        await http.put(f"/api/internal/offerings/{offering}/", json={"name": "o"}, headers=headers)
        await http.put(f"/api/internal/offerings/{offering}/users/{user}/", headers=headers)
        agent = {"Authorization": f"Token {token}"}
        subscription = (await http.post("/api/event-subscriptions/", json={}, headers=agent)).json()
        created = await http.post(
            f"/api/event-subscriptions/{subscription['uuid']}/create_queue/",
            json={"offering_uuid": offering.hex, "object_type": "order"},
            headers=agent,
        )
        assert created.status_code == 201, created.text
        for start in range(0, EVENTS, BATCH):
            events = [
                {"offering_uuid": offering.hex, "object_type": "order", "payload": order_payload()}
                for _ in range(min(BATCH, EVENTS - start))
            ]
            answer = await http.post(
                "/api/internal/events/batch/", json={"events": events}, headers=headers
            )
            assert answer.status_code in (200, 202), answer.text
    engine = create_engine(settings)
    async with engine.connect() as connection:
        sizes = {
            table: int(
                await connection.scalar(text(f"SELECT pg_total_relation_size('{table}')")) or 0
            )
            for table in ("events", "deliveries")
        }
        rows = {
            table: int(await connection.scalar(text(f"SELECT count(*) FROM {table}")) or 0)
            for table in sizes
        }
    await engine.dispose()
    per_event = sizes["events"] / rows["events"]
    per_delivery = sizes["deliveries"] / rows["deliveries"]
    print(f"database: {rows['events']} events, {rows['deliveries']} deliveries retained")
    print(f"  events table + indexes: {sizes['events'] / MIB:.1f} MiB, {per_event:.0f} B/event")
    print(
        f"  deliveries + indexes: {sizes['deliveries'] / MIB:.1f} MiB, "
        f"{per_delivery:.0f} B/delivery (one per recipient queue)"
    )
    print(
        f"  per million events with one recipient each: "
        f"{(per_event + per_delivery) * 1e6 / (1024**3):.2f} GiB; each further recipient "
        f"+{per_delivery * 1e6 / (1024**3):.2f} GiB"
    )


async def memory(management: ManagementClient) -> dict[str, int]:
    response = await management._request("GET", "/nodes", "node")
    (node,) = response.json()
    detail = await management._request("GET", f"/nodes/{node['name']}/memory", "node")
    breakdown: dict[str, int] = {
        key: int(value) for key, value in detail.json()["memory"].items() if isinstance(value, int)
    }
    breakdown["total_used"] = int(node["mem_used"])
    return breakdown


async def broker_figures(settings: Settings) -> None:
    management = ManagementClient(settings)
    provisioner = Provisioner(management, settings, uuid.uuid4())
    token = secrets.token_hex(20)
    password = rabbit_password_hash(token)
    agents: list[tuple[str, str, str]] = []
    try:
        before = await memory(management)
        for _ in range(AGENTS):
            vhost, login = uuid.uuid4().hex, uuid.uuid4().hex
            await provisioner.ensure_vhost(vhost)
            await provisioner.ensure_subscription_user(vhost, uuid.UUID(login), password)
            queue = f"subscription_{login}_offering_{uuid.uuid4().hex}_order"
            await provisioner.ensure_queue(vhost, queue)
            agents.append((vhost, login, queue))
        await asyncio.sleep(5)
        objects = await memory(management)
        connections = [open_stomp(vhost, login, token, queue) for vhost, login, queue in agents]
        await asyncio.sleep(5)
        connected = await memory(management)
        for connection in connections:
            connection.disconnect()
        report("vhost + dead-letter queue + queue + broker user", before, objects, AGENTS)
        report("web-STOMP connection subscribed to one queue", objects, connected, AGENTS)
    finally:
        await management.aclose()
        await remove_broker_objects(settings)


def open_stomp(vhost: str, login: str, passcode: str, queue: str) -> stomp.WSStompConnection:
    connection = stomp.WSStompConnection(
        [("127.0.0.1", 15674)], ws_path="/ws", vhost=vhost, heartbeats=(0, 0)
    )
    connection.connect(login, passcode, wait=True)
    connection.subscribe(f"/amq/queue/{queue}", id="1", ack="client-individual")
    return connection


def report(what: str, before: dict[str, int], after: dict[str, int], count: int) -> None:
    total = (after["total_used"] - before["total_used"]) / count
    parts = {
        key: (after.get(key, 0) - before.get(key, 0)) / count
        for key in after
        if key != "total_used" and abs(after.get(key, 0) - before.get(key, 0)) / count > 2048
    }
    largest = ", ".join(f"{key} {value / 1024:.0f} KiB" for key, value in sorted(parts.items()))
    print(f"broker: {what}: {total / 1024:.0f} KiB each over {count} ({largest})")


def main() -> None:
    base = Settings(
        service_tokens=[SERVICE_TOKEN],
        instance_name=f"qkbench-sizing-{secrets.token_hex(4)}",
        relay_enabled=False,
        scheduler_enabled=False,
        events_batch_max=BATCH,
    )
    with bench_database() as url:
        asyncio.run(database_figures(base.model_copy(update={"database_url": url})))
    asyncio.run(broker_figures(base))


if __name__ == "__main__":
    main()
