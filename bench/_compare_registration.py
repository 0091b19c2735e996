"""create_queue on two versions of the code side by side, with raw PUT + GET, in one run.

This VM's speed moves by a quarter within minutes, so a change to create_queue is judged by
running the old and the new code at once: two `queuekeeper serve` processes (the old one
importing from another checkout's `src`), blocks of 20 calls alternating between them, the
raw baseline in blocks between theirs, CPU per call from /proc. Not part of `make bench`:

    git worktree add /tmp/old <commit>
    python -m bench._compare_registration /tmp/old/src
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench._support import SERVICE_TOKEN, bench_database, live_process, remove_broker_objects
from queuekeeper.broker import topology
from queuekeeper.config import Settings
from queuekeeper.events.payloads import OBJECT_TYPES

BLOCK = 20
BLOCKS = int(os.environ.get("BENCH_BLOCKS", "8"))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class _Server:
    http: httpx.AsyncClient
    pid: int
    agent: dict[str, str] = field(default_factory=dict)
    url: str = ""
    pairs: list[tuple[uuid.UUID, str]] = field(default_factory=list)
    wall: dict[str, list[float]] = field(default_factory=lambda: {"new": [], "repeat": []})
    cpu: dict[str, float] = field(default_factory=lambda: {"new": 0.0, "repeat": 0.0})

    async def prepare(self) -> None:
        service = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
        token, user = secrets.token_hex(20), uuid.uuid4()
        await self.http.put(
            f"/api/internal/users/{user}/", json={"username": "b", "token": token}, headers=service
        )
        offerings = [uuid.uuid4() for _ in range(BLOCKS * BLOCK // len(OBJECT_TYPES) + 1)]
        for offering in offerings:
            await self.http.put(
                f"/api/internal/offerings/{offering}/", json={"name": "o"}, headers=service
            )
            grant = f"/api/internal/offerings/{offering}/users/{user}/"
            await self.http.put(grant, headers=service)
        self.agent = {"Authorization": f"Token {token}"}
        response = await self.http.post("/api/event-subscriptions/", json={}, headers=self.agent)
        self.url = f"/api/event-subscriptions/{response.json()['uuid']}/create_queue/"
        self.pairs = [(o, t) for o in offerings for t in OBJECT_TYPES]

    async def block(self, number: int) -> None:
        pairs = self.pairs[number * BLOCK : (number + 1) * BLOCK]
        for phase, expect in (("new", 201), ("repeat", 200)):
            before = _cpu_seconds(self.pid)
            for offering, object_type in pairs:
                started = time.perf_counter()
                response = await self.http.post(
                    self.url,
                    json={"offering_uuid": offering.hex, "object_type": object_type},
                    headers=self.agent,
                )
                self.wall[phase].append(time.perf_counter() - started)
                assert response.status_code == expect, response.text
            self.cpu[phase] += _cpu_seconds(self.pid) - before


def _ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


async def _run(servers: dict[str, tuple[str, int]], settings: Settings) -> None:
    vhost = f"{settings.instance_name}-raw"
    body = {"durable": True, "auto_delete": False, "arguments": topology.queue_arguments(settings)}
    auth = (settings.management_user, settings.management_password)
    raw_new: list[float] = []
    raw_existing: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        raw = await stack.enter_async_context(
            httpx.AsyncClient(base_url=settings.management_url + "/api", auth=auth)
        )

        async def put_get(name: str) -> float:
            started = time.perf_counter()
            await raw.put(f"/queues/{vhost}/{name}", json=body)
            await raw.get(f"/queues/{vhost}/{name}", params={"columns": "arguments"})
            return time.perf_counter() - started

        await raw.put(f"/vhosts/{vhost}", json={"tags": settings.instance_tag})
        clients: dict[str, _Server] = {}
        for label, (base, pid) in servers.items():
            http = await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=30))
            clients[label] = _Server(http, pid)
            await clients[label].prepare()
        try:
            for number in range(BLOCKS):
                for server in clients.values():
                    await server.block(number)
                for index in range(BLOCK):
                    raw_new.append(await put_get(f"q{number}-{index}"))
                    raw_existing.append(await put_get(f"q{number}-{index}"))
        finally:
            await raw.delete(f"/vhosts/{vhost}")
    calls = BLOCKS * BLOCK
    print(
        f"  raw PUT + GET p50 {_ms(raw_existing):.2f} ms, raw PUT (new) + GET p50 "
        f"{_ms(raw_new):.2f} ms ({calls} each)"
    )
    for label, server in clients.items():
        repeat, new = _ms(server.wall["repeat"]), _ms(server.wall["new"])
        print(
            f"  {label}: repeat p50 {repeat:.2f} ms (x{repeat / _ms(raw_existing):.2f}), CPU "
            f"{server.cpu['repeat'] / calls * 1000:.2f} ms/call | new p50 {new:.2f} ms "
            f"(x{new / _ms(raw_new):.2f}), CPU {server.cpu['new'] / calls * 1000:.2f} ms/call"
        )


def run_side_by_side(
    usage: str,
    run: Callable[[dict[str, tuple[str, int]], Settings], Awaitable[None]],
    **env: str,
) -> None:
    """`run` against two `queuekeeper serve` processes on one bench database: the old code
    (the `src` directory named on the command line) and this checkout's."""
    if len(sys.argv) != 2:
        sys.exit(usage)
    with bench_database() as url:
        settings = Settings(
            database_url=url,
            instance_name=f"qk-bench-{uuid.uuid4().hex[:8]}",
            service_tokens=[SERVICE_TOKEN],
        )
        try:
            with (
                live_process(settings, PYTHONPATH=sys.argv[1], **env) as (old_base, old),
                live_process(settings, **env) as (new_base, new),
            ):
                servers = {"old": (old_base, old.pid), "new": (new_base, new.pid)}
                asyncio.run(run(servers, settings))
        finally:
            asyncio.run(remove_broker_objects(settings))


def main() -> None:
    run_side_by_side(
        "usage: python -m bench._compare_registration <old checkout's src directory>", _run
    )


if __name__ == "__main__":
    main()
