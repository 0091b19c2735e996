"""create_queue latency (new and repeat) against a raw Management API PUT, in one run.

A new queue: token lookup, one read of what is checked, PUT queue, GET queue (arguments
read back), then under the vhost lock the access check and INSERT ... ON CONFLICT DO
NOTHING, commit. A repeat call: token lookup, the same read, GET queue; a PUT only when the
queue is missing or wrong. The baselines are a bare PUT of the same queue and PUT + GET
(what a verified declare needs, the issue's baseline for both calls), back to back, and
PUT + GET timed right after each create_queue call (paired, for information).
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid

import httpx

from bench._support import (
    SERVICE_TOKEN,
    bench_database,
    fmt_ms,
    live_server,
    percentiles,
    remove_broker_objects,
)
from queuekeeper.broker import topology
from queuekeeper.config import Settings
from queuekeeper.events.payloads import OBJECT_TYPES

OFFERINGS = 20  # x 10 object types = 200 queues


async def _run(base: str, settings: Settings) -> None:
    headers = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
    token = secrets.token_hex(20)
    user = uuid.uuid4()
    # Raw baseline: the same declare on the same broker, in a vhost of its own.
    vhost = f"{settings.instance_name}-raw"
    arguments = topology.queue_arguments(settings)
    body = {"durable": True, "auto_delete": False, "arguments": arguments}
    auth = (settings.management_user, settings.management_password)
    async with (
        httpx.AsyncClient(base_url=base, timeout=30) as http,
        httpx.AsyncClient(base_url=settings.management_url + "/api", auth=auth) as raw,
    ):
        await http.put(
            f"/api/internal/users/{user}/",
            json={"username": "bench", "token": token},
            headers=headers,
        )
        offerings = [uuid.uuid4() for _ in range(OFFERINGS)]
        for offering in offerings:
            await http.put(
                f"/api/internal/offerings/{offering}/", json={"name": "o"}, headers=headers
            )
            await http.put(f"/api/internal/offerings/{offering}/users/{user}/", headers=headers)
        agent = {"Authorization": f"Token {token}"}
        subscription = (await http.post("/api/event-subscriptions/", json={}, headers=agent)).json()
        pairs = [(offering, object_type) for offering in offerings for object_type in OBJECT_TYPES]
        await raw.put(f"/vhosts/{vhost}", json={"tags": settings.instance_tag})

        async def create_queue(offering: uuid.UUID, object_type: str, expect: int) -> float:
            started = time.perf_counter()
            response = await http.post(
                f"/api/event-subscriptions/{subscription['uuid']}/create_queue/",
                json={"offering_uuid": offering.hex, "object_type": object_type},
                headers=agent,
            )
            elapsed = time.perf_counter() - started
            assert response.status_code == expect, response.text
            return elapsed

        async def put_get(name: str) -> float:
            started = time.perf_counter()
            await raw.put(f"/queues/{vhost}/{name}", json=body)
            await raw.get(f"/queues/{vhost}/{name}", params={"columns": "arguments"})
            return time.perf_counter() - started

        async def put(name: str) -> float:
            started = time.perf_counter()
            await raw.put(f"/queues/{vhost}/{name}", json=body)
            return time.perf_counter() - started

        try:
            # Each call with a baseline timed right after it (paired: this VM's speed drifts
            # by a quarter within minutes), printed for information. The goal is judged
            # against the baselines timed back to back below, the faster and stricter ones:
            # a PUT + GET right after a create_queue took ~1.6x as long, for reasons not
            # established.
            new, paired_new, repeat, paired_repeat = [], [], [], []
            for index, (offering, object_type) in enumerate(pairs):
                new.append(await create_queue(offering, object_type, 201))
                paired_new.append(await put_get(f"p{index}"))
            for index, (offering, object_type) in enumerate(pairs):
                repeat.append(await create_queue(offering, object_type, 200))
                paired_repeat.append(await put_get(f"p{index}"))
            put_new = [await put(f"q{index}") for index in range(len(pairs))]
            put_repeat = [await put(f"q{index}") for index in range(len(pairs))]
            put_get_existing = [await put_get(f"q{index}") for index in range(len(pairs))]
            put_new_get = [await put_get(f"n{index}") for index in range(len(pairs))]
        finally:
            await raw.delete(f"/vhosts/{vhost}")

    rows = {
        "raw PUT (new queue)": percentiles(put_new),
        "raw PUT (existing)": percentiles(put_repeat),
        "raw PUT + GET": percentiles(put_get_existing),
        "raw PUT (new) + GET": percentiles(put_new_get),
        "paired PUT + GET": percentiles(paired_repeat),
        "paired PUT (new) + GET": percentiles(paired_new),
        "create_queue new (201)": percentiles(new),
        "create_queue repeat (200)": percentiles(repeat),
    }
    for label, stats in rows.items():
        print(f"  {label:28s} {fmt_ms(stats)}")
    new_ratio = rows["create_queue new (201)"]["p50"] / rows["raw PUT (new queue)"]["p50"]
    repeat_ratio = rows["create_queue repeat (200)"]["p50"] / rows["raw PUT (existing)"]["p50"]
    print(f"  p50 ratio create_queue new / raw PUT new: x{new_ratio:.2f}")
    print(f"  p50 ratio create_queue repeat / raw PUT existing: x{repeat_ratio:.2f}")
    goal_new = rows["create_queue new (201)"]["p50"] / rows["raw PUT (new) + GET"]["p50"]
    goal_repeat = rows["create_queue repeat (200)"]["p50"] / rows["raw PUT + GET"]["p50"]
    paired_repeat_ratio = rows["create_queue repeat (200)"]["p50"] / rows["paired PUT + GET"]["p50"]
    paired_new_ratio = rows["create_queue new (201)"]["p50"] / rows["paired PUT (new) + GET"]["p50"]
    print(
        f"  paired (baseline right after each call): repeat x{paired_repeat_ratio:.2f}, "
        f"new x{paired_new_ratio:.2f} (information; the goal uses the back-to-back baselines)"
    )
    met = goal_new <= 2 and goal_repeat <= 2
    print(
        f"GOAL 4 create_queue p50: repeat / raw PUT + GET x{goal_repeat:.2f}, new / raw PUT "
        f"(new) + GET x{goal_new:.2f}; goal <= 2 each: {'met' if met else 'NOT met'}"
    )


def main() -> None:
    with bench_database() as url:
        settings = Settings(
            database_url=url,
            instance_name=f"qk-bench-{uuid.uuid4().hex[:8]}",
            service_tokens=[SERVICE_TOKEN],
        )
        print(
            f"  {len(OBJECT_TYPES) * OFFERINGS} queues, sequential, PostgreSQL, uvicorn on loopback"
        )
        try:
            with live_server(settings) as base:
                asyncio.run(_run(base, settings))
        finally:
            asyncio.run(remove_broker_objects(settings))


if __name__ == "__main__":
    main()
