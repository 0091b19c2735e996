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
import sys
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import pytest
from prometheus_client import REGISTRY

from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from tests.agents.harness import (
    AGENT_105_TYPES,
    Publisher,
    RunningAgent,
    Server,
    agent_config,
    broker_snapshot,
    publisher_for,
    start_agent,
    valid_payload,
)
from tests.agents.releases import RELEASES
from tests.agents.test_agent_matrix import assert_ack_mode
from tests.brokers import BROKER
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Backend

AGENT_TYPES = AGENT_105_TYPES
(RELEASE,) = [release for release in RELEASES if release.version == "1.0.5"]


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
            assert identities[0]["compatibility"]["status"] == "compatible", identities
            subscriptions = [item["subscription"] for item in consumers]
            assert agent_requests == expected_sequence(True, identity, subscriptions)

            queues = queue_names(offering, consumers)
            # Subscribed as the release does (auto-ack, no prefetch asked), as the broker sees it.
            await assert_ack_mode(agent.vhost, set(queues.values()), RELEASE)
            publish = publisher_for(http, offering, queues)
            await assert_receives_every_type(first, publish, offering, queues)
            before = await broker_snapshot(management, settings, agent.vhost)
            assert len([q for q in before["queues"] if q[0].startswith("subscription_")]) == 9
            assert sorted(subscriptions) == sorted(u for u in before["users"] if len(u) == 32)
        finally:
            await first.stop()
        assert first.process.returncode == 0, first.log_tail()

        # --- while it is down, an event waits in its queue -------------------------------
        waiting = valid_payload("order")
        await publish("order", waiting)

        # --- restart: everything is reused, the waiting event arrives ------------------
        server.log.clear()
        second = await start_agent(site_agent_python, config, tmp_path, "second")
        try:
            status = await second.ready(timeout=120)
            second_rest = sum(server.log.seconds)
            assert [item["subscription"] for item in status["consumers"]] == subscriptions
            assert server.log.agent_requests() == expected_sequence(False, identity, subscriptions)
            after = await broker_snapshot(management, settings, agent.vhost)
            assert after == before
            (early,) = await second.wait_received(1)
            assert json.loads(early["body"])["order_uuid"] == waiting["order_uuid"]
            await assert_receives_every_type(second, publish, offering, queues, already=1)
        finally:
            await second.stop()
        assert second.process.returncode == 0, second.log_tail()
        await asyncio.sleep(1)  # nothing arrives twice, even late
        assert len(second.received()) == 1 + len(AGENT_TYPES), second.received()

        listed = await http.get("/api/event-subscriptions/", headers=agent.headers)
        assert len(listed.json()) == 9
        registered = await http.get("/api/event-subscription-queues/", headers=agent.headers)
        assert len(registered.json()) == 9
        print(  # the figures quoted in docs/tutorial/site-agent.md (run with -s to see them)
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
    """Why docs/tutorial/site-agent.md says to configure the offering uuid in lowercase
    (agent-protocols 1.0.5 §4.1)."""
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
