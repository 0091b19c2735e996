"""The compatibility matrix (contract §10): every published agent line that sites run, unchanged
but for its message handlers (recorders, tests/agents/agent_runner.py), against queuekeeper
and RabbitMQ's web-STOMP.

For each release of tests/agents/releases.py: set-up as `waldur_site_agent -m
event_process` does it, one event of every type it subscribes to handled once by the
handler its own router picks, the acknowledgement mode it subscribes with as the broker
sees it, and a restart that changes nothing on the broker and delivers what waited. For
releases that acknowledge (1.0.8), a message unacknowledged when the connection drops is
delivered again after the reconnect, and prefetch-count 1 keeps the next one in the queue.
`make check-newest-agent` runs this file against the newest release on PyPI.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from tests.agents.harness import (
    RunningAgent,
    Server,
    agent_config,
    broker_snapshot,
    publish_event,
    start_agent,
    valid_payload,
)
from tests.agents.releases import NEWEST_ENV, RELEASES, Release, releases_under_test
from tests.agents.site_agent_venv import ensure_site_agent_venv
from tests.brokers import BROKER
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Agent, Backend

IDENTITIES = "/api/marketplace-site-agent-identities/"
PROJECT_GROUPS = "service_provider_project_group"
# 1.0.5 and 1.0.7 run this file's first scenario, with more asserted (the exact requests, whole
# bodies and headers, the broker's objects), in files of their own (test_site_agent_e2e.py,
# test_site_agent_107_e2e.py): the matrix runs the other rows, and whatever release
# `QK_AGENT_VERSION` names (make check-newest-agent).
OWN_FILES = {"1.0.5", "1.0.7"}
MATRIX = [
    release
    for release in releases_under_test()
    if os.environ.get(NEWEST_ENV) or release.version not in OWN_FILES
]


async def agent_python(release: Release) -> Path:
    return await asyncio.to_thread(ensure_site_agent_venv, release.version)


async def site(
    http: httpx.AsyncClient, server: Server, tmp_path: Path
) -> tuple[Agent, uuid.UUID, Path]:
    """A user with access to an offering, and the agent configuration for them."""
    agent, offering = await Backend(http, SERVICE_TOKEN).agent_with_offering()
    config = agent_config(tmp_path / "agent.yaml", f"{server.url}/api/", agent.token, offering.hex)
    return agent, offering, config


def runner_flags(release: Release) -> list[str]:
    flags = ["--initial-processing"] if release.protocol == "unified" else []
    if PROJECT_GROUPS in release.types:
        flags.append("--project-groups")
    return flags


async def start(
    python: Path, config: Path, workdir: Path, name: str, release: Release
) -> tuple[RunningAgent, dict[str, Any]]:
    running = await start_agent(python, config, workdir, name, *runner_flags(release))
    return running, await running.ready(timeout=180)


def queues_by_type(status: dict[str, Any], offering: uuid.UUID) -> dict[str, str]:
    """The queue each subscribed type arrives on, from what the agent set up."""
    found: dict[str, str] = {}
    for consumer in status["consumers"]:
        assert consumer["connected"], status
        if "queue_name" in consumer:  # unified: one queue for every type
            for object_type in consumer["observable_object_types"]:
                found[object_type] = consumer["queue_name"]
        else:  # legacy: the agent computes the name of each type's queue
            found[consumer["object_type"]] = (
                f"subscription_{consumer['subscription']}_offering_{offering.hex}_"
                f"{consumer['object_type']}"
            )
    return found


publish = publish_event


async def publish_every_type(
    http: httpx.AsyncClient, offering: uuid.UUID, queue_of: dict[str, str]
) -> dict[str, tuple[str, dict[str, Any]]]:
    sent: dict[str, tuple[str, dict[str, Any]]] = {}
    for object_type, queue in queue_of.items():
        payload = valid_payload(object_type)
        answer = await publish(http, offering, object_type, payload)
        assert [(d["queue_name"], d["state"]) for d in answer["deliveries"]] == [
            (queue, "published")
        ], answer
        sent[object_type] = (answer["event_id"], payload)
    return sent


def assert_each_handled_once(
    received: list[dict[str, Any]], sent: dict[str, tuple[str, dict[str, Any]]], log: str
) -> None:
    handled = sorted(item["object_type"] for item in received)
    assert handled == sorted(sent), f"handled {handled}, sent {sorted(sent)}\n{log}"
    for item in received:
        event_id, payload = sent[item["object_type"]]
        body = json.loads(item["body"])
        # The handler that ran is the one for the type in the body (the agent's own router
        # for unified queues, the queue's handler for legacy ones).
        assert body["object_type"] == item["object_type"], item
        assert {key: body[key] for key in payload} == payload, item
        assert item["headers"]["amqp-message-id"] == event_id, item


async def broker_consumers(vhost: str) -> list[dict[str, Any]]:
    """The broker's consumers in `vhost` (Management API): queue, ack_required, prefetch."""
    async with httpx.AsyncClient(
        base_url=BROKER.management_url, auth=(BROKER.user, BROKER.password), timeout=10
    ) as management:
        response = await management.get(f"/api/consumers/{vhost}")
        response.raise_for_status()
        found: list[dict[str, Any]] = response.json()
        return found


async def assert_ack_mode(vhost: str, queues: set[str], release: Release) -> dict[str, Any]:
    """Every queue has one consumer, subscribed as the release says it subscribes."""
    for _ in range(50):  # the Management API's view lags a connect by a moment
        consumers = [c for c in await broker_consumers(vhost) if c["queue"]["name"] in queues]
        if len(consumers) == len(queues):
            break
        await asyncio.sleep(0.2)
    assert sorted(c["queue"]["name"] for c in consumers) == sorted(queues), consumers
    observed = {(c["ack_required"], c["prefetch_count"]) for c in consumers}
    assert {ack for ack, _ in observed} == {release.ack != "auto"}, observed
    if release.prefetch is not None:
        assert {prefetch for _, prefetch in observed} == {release.prefetch}, observed
    ack_required, prefetch = observed.pop()
    return {"ack_required": ack_required, "prefetch_count": prefetch}


def registered_types(status: dict[str, Any]) -> list[str]:
    types: list[str] = []
    for consumer in status["consumers"]:
        types += consumer.get("observable_object_types") or [consumer.get("object_type")]
    return types


@pytest.mark.timeout(900)
@pytest.mark.parametrize("release", MATRIX, ids=[release.version for release in MATRIX])
async def test_published_agent_sets_up_receives_every_type_once_and_restarts_idempotently(
    release: Release,
    server: Server,
    management: ManagementClient,
    settings: Settings,
    tmp_path: Path,
) -> None:
    python = await agent_python(release)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        agent, offering, config = await site(http, server, tmp_path)

        # --- first start ---------------------------------------------------------------
        first, status = await start(python, config, tmp_path, "first", release)
        try:
            queue_of = queues_by_type(status, offering)
            types = registered_types(status)
            if release in RELEASES:  # a known release subscribes exactly as recorded
                assert types == list(release.types), first.log_tail()
            else:  # the newest on PyPI: report what it asked for
                print(f"\n{release.version} subscribes to {types}", file=sys.stderr)
            identities = await http.get(IDENTITIES, headers=agent.headers)
            (identity,) = identities.json()
            assert identity["compatibility"]["status"] == "compatible", identity
            ack = await assert_ack_mode(agent.vhost, set(queue_of.values()), release)

            sent = await publish_every_type(http, offering, queue_of)
            received = await first.wait_received(len(sent), timeout=60)
            assert_each_handled_once(received, sent, first.log_tail())
            before = await broker_snapshot(management, settings, agent.vhost)
        finally:
            await first.stop()
        assert first.process.returncode == 0, first.log_tail()

        # --- while it is down, an event waits in its queue -------------------------------
        waiting = valid_payload("order")
        answer = await publish(http, offering, "order", waiting)
        assert answer["deliveries"][0]["state"] == "published", answer

        # --- restart: the same names, nothing new on the broker, the waiting event ------
        second, again = await start(python, config, tmp_path, "second", release)
        try:
            assert queues_by_type(again, offering) == queue_of
            assert await broker_snapshot(management, settings, agent.vhost) == before
            (early,) = await second.wait_received(1, timeout=60)
            assert json.loads(early["body"])["order_uuid"] == waiting["order_uuid"]
            sent = await publish_every_type(http, offering, queue_of)
            received = (await second.wait_received(1 + len(sent), timeout=60))[1:]
            assert_each_handled_once(received, sent, second.log_tail())
        finally:
            await second.stop()
        assert second.process.returncode == 0, second.log_tail()
        await asyncio.sleep(1)  # nothing arrives twice, even late
        assert len(second.received()) == 1 + len(sent), second.received()
    print(
        f"\nwaldur-site-agent {release.version}: {release.protocol}, {len(types)} types "
        f"handled once each, restart idempotent, ack {ack}",
        file=sys.stderr,
    )


ACKING = [release for release in releases_under_test() if release.ack != "auto"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("release", ACKING, ids=[release.version for release in ACKING])
async def test_an_unacked_message_is_redelivered_after_a_reconnect_and_prefetch_holds_the_next(
    release: Release,
    server: Server,
    management: ManagementClient,
    tmp_path: Path,
) -> None:
    python = await agent_python(release)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        agent, offering, config = await site(http, server, tmp_path)
        running, status = await start(python, config, tmp_path, "acks", release)
        try:
            (consumer,) = status["consumers"]
            queue = consumer["queue_name"]
            # A handler that runs long: the message it handles stays unacknowledged...
            held = {**valid_payload("order"), "e2e_hold": True}
            await publish(http, offering, "order", held)
            (first,) = await running.wait_received(1)
            assert first["headers"].get("redelivered") != "true", first
            # ...and with prefetch-count 1 the next one is not handed to the agent.
            following = valid_payload("resource")
            await publish(http, offering, "resource", following)
            counts = await queue_counts(management, agent.vhost, queue, unacked=1, ready=1)
            assert counts == (1, 1), counts
            assert len(running.received()) == 1

            # The connection drops (here: closed by the broker) while the handler runs.
            assert await management.close_user_connections(consumer["rmq_username"])
            # RabbitMQ requeues the unacked message; the agent reconnects and gets it again.
            running.record.with_suffix(".release").touch()
            received = await running.wait_received(3, timeout=90)
            assert [item["object_type"] for item in received] == ["order", "order", "resource"], (
                running.log_tail()
            )
            assert received[1]["headers"].get("redelivered") == "true", received[1]
            assert json.loads(received[1]["body"])["order_uuid"] == held["order_uuid"]
            # Everything handled is acknowledged: nothing left, nothing unacked.
            assert await queue_counts(management, agent.vhost, queue, unacked=0, ready=0) == (
                0,
                0,
            )
        finally:
            running.record.with_suffix(".release").touch()
            await running.stop()


async def queue_counts(
    management: ManagementClient, vhost: str, queue: str, *, unacked: int, ready: int
) -> tuple[int, int]:
    """(messages_unacknowledged, messages_ready), waiting up to 15 s for the expected pair
    (the Management API's counts lag by a few seconds)."""
    seen = (-1, -1)
    for _ in range(75):
        async with httpx.AsyncClient(
            base_url=BROKER.management_url, auth=(BROKER.user, BROKER.password), timeout=10
        ) as client:
            response = await client.get(f"/api/queues/{vhost}/{queue}")
            body = response.json()
        seen = (int(body.get("messages_unacknowledged", -1)), int(body.get("messages_ready", -1)))
        if seen == (unacked, ready):
            break
        await asyncio.sleep(0.2)
    return seen
