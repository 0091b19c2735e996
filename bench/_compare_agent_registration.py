"""The agents' other registrations on two versions of the code side by side, in one run:
register_queue (contract §9) and register_event_subscription, first call (201) and repeat (200).

As `_compare_registration` does for create_queue: two `queuekeeper serve` processes (the
old one importing from another checkout's `src`) on one database, blocks of 20 calls
alternating between them, CPU per call from /proc; and Management API calls per call from
each server's `/metrics` (queuekeeper_management_api_calls_total). Not part of `make bench`:

    git worktree add /tmp/old <commit>
    python -m bench._compare_agent_registration /tmp/old/src
"""

from __future__ import annotations

import os
import re
import secrets
import statistics
import time
import uuid
from dataclasses import dataclass, field

import httpx

from bench._compare_registration import _cpu_seconds, run_side_by_side
from bench._support import SERVICE_TOKEN
from queuekeeper.config import Settings

BLOCK = 20
BLOCKS = int(os.environ.get("BENCH_BLOCKS", "4"))
IDENTITIES = "/api/marketplace-site-agent-identities/"
PHASES = (
    ("register_queue", 201),
    ("register_queue", 200),
    ("register_event_subscription", 201),
    ("register_event_subscription", 200),
)
_CALLS = re.compile(r"^queuekeeper_management_api_calls_total\{[^}]*\} ([0-9.e+]+)$", re.M)


@dataclass
class _Server:
    http: httpx.AsyncClient
    pid: int
    agent: dict[str, str] = field(default_factory=dict)
    identities: list[str] = field(default_factory=list)
    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    broker_calls: dict[str, float] = field(default_factory=dict)

    async def prepare(self) -> None:
        service = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
        token, user, offering = secrets.token_hex(20), uuid.uuid4(), uuid.uuid4()
        await self.http.put(
            f"/api/internal/users/{user}/", json={"username": "b", "token": token}, headers=service
        )
        await self.http.put(
            f"/api/internal/offerings/{offering}/", json={"name": "o"}, headers=service
        )
        await self.http.put(f"/api/internal/offerings/{offering}/users/{user}/", headers=service)
        self.agent = {"Authorization": f"Token {token}"}
        for index in range(BLOCKS * BLOCK):
            response = await self.http.post(
                IDENTITIES,
                json={"offering": offering.hex, "name": f"agent-{index}", "version": "1.0.7"},
                headers=self.agent,
            )
            assert response.status_code == 201, response.text
            self.identities.append(response.json()["uuid"])

    async def management_calls(self) -> float:
        text = (await self.http.get("/metrics")).text
        return sum(float(value) for value in _CALLS.findall(text))

    async def block(self, number: int) -> None:
        identities = self.identities[number * BLOCK : (number + 1) * BLOCK]
        for route, expect in PHASES:
            phase = f"{route} {expect}"
            body = (
                {"object_types": ["order"]}
                if route == "register_queue"
                else {"observable_object_type": "order"}
            )
            calls = await self.management_calls()
            before = _cpu_seconds(self.pid)
            for identity in identities:
                started = time.perf_counter()
                response = await self.http.post(
                    f"{IDENTITIES}{identity}/{route}/", json=body, headers=self.agent
                )
                self.wall.setdefault(phase, []).append(time.perf_counter() - started)
                assert response.status_code == expect, response.text
            self.cpu[phase] = self.cpu.get(phase, 0.0) + _cpu_seconds(self.pid) - before
            self.broker_calls[phase] = (
                self.broker_calls.get(phase, 0.0) + await self.management_calls() - calls
            )


async def _run(servers: dict[str, tuple[str, int]], _settings: Settings) -> None:
    clients: dict[str, _Server] = {}
    for label, (base, pid) in servers.items():
        clients[label] = _Server(httpx.AsyncClient(base_url=base, timeout=30), pid)
        await clients[label].prepare()
    try:
        for number in range(BLOCKS):
            for server in clients.values():
                await server.block(number)
    finally:
        for server in clients.values():
            await server.http.aclose()
    calls = BLOCKS * BLOCK
    for route, expect in PHASES:
        phase = f"{route} {expect}"
        print(f"  {phase} ({calls} calls each)")
        for label, server in clients.items():
            p50 = statistics.median(server.wall[phase]) * 1000
            print(
                f"    {label}: p50 {p50:.2f} ms, CPU {server.cpu[phase] / calls * 1000:.2f} "
                f"ms/call, Management API calls {server.broker_calls[phase] / calls:.1f}/call"
            )


def main() -> None:
    room = str(BLOCKS * BLOCK + 10)
    run_side_by_side(
        "usage: python -m bench._compare_agent_registration <old checkout's src directory>",
        _run,
        QUEUEKEEPER_MAX_IDENTITIES_PER_USER=room,
        QUEUEKEEPER_MAX_CONSUMERS_PER_USER=room,
        QUEUEKEEPER_MAX_SUBSCRIPTIONS_PER_USER=room,
    )


if __name__ == "__main__":
    main()
