"""The published waldur-site-agent 1.0.7, unchanged but for its message handlers, against
queuekeeper and web-STOMP (contract §9, docs/agent-protocols.md 1.0.7).

1.0.7 registers one queue per offering with `register_queue` and routes each message by
the `object_type` in its body with its own router (`route_message`); only the handlers
the router calls are replaced by recorders (tests/agents/agent_runner.py). The agent
runs its initial processing too, as `waldur_site_agent -m event_process` does.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from tests.agents.harness import (
    AGENT_107_TYPES,
    RunningAgent,
    Server,
    agent_config,
    broker_snapshot,
    publish_event,
    start_agent,
    valid_payload,
)
from tests.agents.releases import RELEASES
from tests.agents.test_agent_matrix import assert_ack_mode
from tests.conftest import SERVICE_TOKEN
from tests.events.support import queue_depth
from tests.helpers import Agent, Backend

IDENTITIES = "/api/marketplace-site-agent-identities/"
# With only an order backend configured.
ORDER_TYPES = ["order", "resource_api_key_rotation"]
INITIAL_PROCESSING = "--initial-processing"
(RELEASE,) = [release for release in RELEASES if release.version == "1.0.7"]


def expected_sequence(first_start: bool, identity: str) -> list[tuple[str, str, int]]:
    """Contract 2: R1, R2 and R5 of the initial processing, then R1, R2b and R6."""
    status = 201 if first_start else 200
    return [
        ("GET", IDENTITIES, 200),
        ("POST", IDENTITIES, 201) if first_start else ("PUT", f"{IDENTITIES}{identity}/", 200),
        # register_service: Waldur's marketplace is not queuekeeper's; the agent logs it.
        ("POST", f"{IDENTITIES}{identity}/register_service/", 404),
        ("GET", IDENTITIES, 200),
        ("PUT", f"{IDENTITIES}{identity}/", 200),
        ("POST", f"{IDENTITIES}{identity}/register_queue/", status),
    ]


publish = publish_event


async def publish_every_type(
    http: httpx.AsyncClient, offering: uuid.UUID, queue: str, types: list[str]
) -> dict[str, tuple[str, dict[str, Any]]]:
    sent: dict[str, tuple[str, dict[str, Any]]] = {}
    for object_type in types:
        payload = valid_payload(object_type)
        answer = await publish(http, offering, object_type, payload)
        assert answer["queued"] == 1, answer
        assert [(d["queue_name"], d["state"]) for d in answer["deliveries"]] == [
            (queue, "published")
        ], answer
        sent[object_type] = (answer["event_id"], payload)
    return sent


def assert_received_once_intact(
    received: list[dict[str, Any]],
    sent: dict[str, tuple[str, dict[str, Any]]],
    offering: uuid.UUID,
    queue: str,
    log: str,
) -> None:
    assert sorted(item["object_type"] for item in received) == sorted(sent), log
    for item in received:
        event_id, payload = sent[item["object_type"]]
        # The agent's own router picked the handler from the body's object_type.
        assert json.loads(item["body"]) == {
            **payload,
            "offering_uuid": offering.hex,
            "object_type": item["object_type"],
            "schema_version": 1,
        }
        assert item["headers"]["amqp-message-id"] == event_id
        assert item["headers"]["destination"] == f"/queue/{queue}"


async def started(
    python: Path, config: Path, workdir: Path, name: str
) -> tuple[RunningAgent, dict[str, Any]]:
    running = await start_agent(python, config, workdir, name, INITIAL_PROCESSING)
    status = await running.ready(timeout=120)
    return running, status


@pytest.mark.timeout(600)
async def test_published_site_agent_107_registers_one_queue_receives_and_restarts_idempotently(
    server: Server,
    site_agent_107_python: Path,
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

        # --- first start: one identity, one consumer queue for all ten types ----------
        server.log.clear()
        first, status = await started(site_agent_107_python, config, tmp_path, "first")
        try:
            first_requests = server.log.timed_agent_requests()
            first_rest = sum(server.log.seconds)
            (consumer,) = status["consumers"]
            assert consumer["connected"], first.log_tail()
            assert consumer["observable_object_types"] == AGENT_107_TYPES
            assert consumer["vhost"] == agent.vhost
            queue = consumer["queue_name"]
            assert queue == f"consumer_{consumer['rmq_username']}"
            identity = consumer["agent_identity_uuid"]
            sequence = [request[:3] for request in first_requests]
            assert sequence[-6:] == expected_sequence(True, identity), sequence
            assert all(request[1] == "/api/version/" for request in sequence[:-6]), sequence
            (listed,) = (await http.get(IDENTITIES, headers=agent.headers)).json()
            assert listed["compatibility"]["status"] == "compatible", listed
            # Subscribed as the release does (auto-ack, no prefetch asked), as the broker sees it.
            await assert_ack_mode(agent.vhost, {queue}, RELEASE)

            sent = await publish_every_type(http, offering, queue, AGENT_107_TYPES)
            received = await first.wait_received(len(AGENT_107_TYPES))
            assert_received_once_intact(received, sent, offering, queue, first.log_tail())
            before = await broker_snapshot(management, settings, agent.vhost)
            assert [name for name, _ in before["queues"]] == sorted([queue, "waldur.dlq.messages"])
            assert before["users"] == [consumer["rmq_username"]]
        finally:
            await first.stop()
        assert first.process.returncode == 0, first.log_tail()

        # --- while it is down: an event waits in its queue ----------------------------
        waiting = valid_payload("order")
        answer = await publish(http, offering, "order", waiting)
        assert answer["deliveries"][0]["state"] == "published"

        # --- restart: nothing changes on the broker, the waiting event arrives --------
        server.log.clear()
        second, status = await started(site_agent_107_python, config, tmp_path, "second")
        try:
            second_requests = server.log.timed_agent_requests()
            second_rest = sum(server.log.seconds)
            assert status["consumers"] == [consumer]
            sequence = [request[:3] for request in second_requests]
            assert sequence[-6:] == expected_sequence(False, identity), sequence
            assert await broker_snapshot(management, settings, agent.vhost) == before
            (early,) = await second.wait_received(1)
            assert json.loads(early["body"])["order_uuid"] == waiting["order_uuid"]
            sent = await publish_every_type(http, offering, queue, AGENT_107_TYPES)
            received = (await second.wait_received(1 + len(AGENT_107_TYPES)))[1:]
            assert_received_once_intact(received, sent, offering, queue, second.log_tail())
        finally:
            await second.stop()
        assert second.process.returncode == 0, second.log_tail()
        await asyncio.sleep(1)  # nothing arrives twice, even late
        assert len(second.received()) == 1 + len(AGENT_107_TYPES), second.received()
        print(  # the figures quoted in docs/reference/site-agent-1.0.7.md (run with -s to see them)
            f"\nsite-agent 1.0.7 start-up, 10 types: first start "
            f"{first.status['setup_seconds']:.2f} s (queuekeeper {first_rest:.2f} s of it; "
            f"+{first.status['import_seconds']:.2f} s imports):\n{_timed(first_requests)}\n"
            f"restart {second.status['setup_seconds']:.2f} s (queuekeeper {second_rest:.2f} s; "
            f"+{second.status['import_seconds']:.2f} s):\n{_timed(second_requests)}",
            file=sys.stderr,
        )


def _timed(requests: list[tuple[str, str, int, float]]) -> str:
    return "\n".join(
        f"  {method} {path} -> {status} in {seconds * 1000:.0f} ms"
        for method, path, status, seconds in requests
    )


async def legacy_order_queue(http: httpx.AsyncClient, agent: Agent, offering: uuid.UUID) -> str:
    """What a 1.0.5 agent of the same user left behind: a subscription and an order queue."""
    subscription = await agent.create_subscription(observable_objects=[{"object_type": "order"}])
    response = await agent.create_queue(subscription["uuid"], offering, "order")
    assert response.status_code == 201, response.text
    name: str = response.json()["queue_name"]
    return name


@pytest.mark.timeout(600)
async def test_107_filter_keeps_other_types_off_and_a_user_on_both_protocols_gets_one_copy(
    server: Server,
    site_agent_107_python: Path,
    management: ManagementClient,
    tmp_path: Path,
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        backend = Backend(http, SERVICE_TOKEN)
        agent, offering = await backend.agent_with_offering()
        legacy = await legacy_order_queue(http, agent, offering)
        # Another user on the legacy protocol only keeps receiving its own copy.
        other = await backend.put_user()
        await backend.grant(other, offering)
        others_queue = await legacy_order_queue(http, other, offering)
        config = agent_config(
            tmp_path / "agent.yaml",
            f"{server.url}/api/",
            agent.token,
            offering.hex,
            all_types=False,
        )
        running, status = await started(site_agent_107_python, config, tmp_path, "orders")
        try:
            (consumer,) = status["consumers"]
            assert consumer["observable_object_types"] == ORDER_TYPES
            queue = consumer["queue_name"]

            # A type outside its filter: no copy for the consumer.
            resource = await publish(http, offering, "resource", valid_payload("resource"))
            assert resource["queued"] == 0, resource

            # The user is on both protocols: one copy, to the consumer; the legacy queue of
            # the same user gets none; the other user's legacy queue gets its own.
            order = valid_payload("order")
            answer = await publish(http, offering, "order", order)
            assert sorted((d["queue_name"], d["state"]) for d in answer["deliveries"]) == sorted(
                [(queue, "published"), (others_queue, "published")]
            ), answer
            assert answer["queued"] == 2
            (received,) = await running.wait_received(1)
            assert received["object_type"] == "order"
            assert json.loads(received["body"])["order_uuid"] == order["order_uuid"]
            # Exact (a passive declare): the Management API's count lags.
            assert await queue_depth(agent.vhost, legacy) == 0
            assert await queue_depth(other.vhost, others_queue) == 1  # nobody reads it here
        finally:
            await running.stop()
        # Nothing more arrived: the resource event never reached the queue.
        assert len(running.received()) == 1, running.received()
