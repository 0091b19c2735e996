"""Races between a user's writers, each run with real concurrency: many requests
at once against the service, then real broker logins (AMQP and STOMP) to see what holds.

Every writer of a user's broker users, vhost and consumer rows holds the owner lock
(docs/decisions/002-owner-lock.md). Before it, 15 registrations in flight beside a token
change left the old token working on the broker on the first trial; 8 identical consumer
registrations made 8 consumers; parallel registrations passed the quotas; deletions
racing registrations left broker users, queues and vhosts without rows.

Each test repeats its race `RACE_TRIALS` times (QK_RACE_TRIALS, default 4), with the
competing call started at a different moment in each trial.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid
from collections.abc import Awaitable
from typing import Any

import aiormq
import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.passwords import rabbit_password_hash
from queuekeeper.config import Settings
from queuekeeper.db import create_engine
from queuekeeper.models import AgentIdentity, EventConsumer, EventSubscription
from tests.brokers import BROKER
from tests.conftest import SERVICE_TOKEN
from tests.consumers.test_register_queue import new_identity, register_queue
from tests.helpers import Agent, Backend, database_statements
from tests.identities.test_identities import IDENTITIES, agent_body
from tests.stomp_client import StompConsumer

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
RACE_TRIALS = int(os.environ.get("QK_RACE_TRIALS", "4"))
IN_FLIGHT = 15
# When the competing call starts, after the registrations were sent (seconds), by trial.
DELAYS = [0.0, 0.005, 0.02, 0.05, 0.1]

pytestmark = pytest.mark.settings(registration_rate_limit="10000/second")


# Shifts which delay each trial uses (a driver running one trial per process sets it).
DELAY_OFFSET = int(os.environ.get("QK_RACE_DELAY_OFFSET", "0"))


def delay(trial: int) -> float:
    return DELAYS[(trial + DELAY_OFFSET) % len(DELAYS)]


async def amqp_login(vhost: str, user: str, password: str) -> bool:
    """Whether the broker lets `user` in with `password` over AMQP. On aiormq: a refused
    aio-pika connection left behind schedules its own close when collected, which outside
    a running loop is a coroutine never awaited (a RuntimeWarning in the suite)."""
    try:
        async with asyncio.timeout(5):
            connection = await aiormq.connect(BROKER.amqp_url(vhost, user=user, password=password))
    except (aiormq.exceptions.AMQPConnectionError, ConnectionError, OSError, TimeoutError):
        return False
    await connection.close()
    return True


async def stomp_login(vhost: str, user: str, password: str) -> bool:
    """Whether the broker lets `user` in with `password` over STOMP (as the agent logs in)."""
    consumer = StompConsumer(vhost, user, password)
    try:
        await asyncio.to_thread(consumer.connect)
    except Exception:
        return False
    try:
        return not await asyncio.to_thread(consumer.wait_refused, 1.0)
    finally:
        await asyncio.to_thread(consumer.close)


async def rows_of(settings: Settings, owner: uuid.UUID) -> dict[str, set[str]]:
    """The owner's rows as broker objects: broker user names and consumer queue names."""
    engine = create_engine(settings)
    try:
        async with engine.connect() as connection:
            subscriptions = set(
                await connection.scalars(
                    select(EventSubscription.uuid).where(EventSubscription.user_uuid == owner)
                )
            )
            consumers = set(
                await connection.scalars(
                    select(EventConsumer.uuid).where(EventConsumer.user_uuid == owner)
                )
            )
            identities = set(
                await connection.scalars(
                    select(AgentIdentity.uuid).where(AgentIdentity.created_by == owner)
                )
            )
    finally:
        await engine.dispose()
    return {
        "users": {u.hex for u in subscriptions | consumers},
        "queues": {topology.consumer_queue_name(c) for c in consumers},
        "identities": {i.hex for i in identities},
    }


async def broker_of(
    management: ManagementClient, owner: uuid.UUID, known: set[str]
) -> dict[str, Any]:
    """What the broker holds for the owner: its vhost, agent users (those with rights in
    the vhost, and those of `known` that exist at all: a user whose vhost went still logs
    in), consumer queues."""
    vhost = owner.hex
    users = {
        p.user
        for p in await management.list_permissions()
        if p.vhost == vhost and topology.named_like_subscription_user(p.user)
    }
    users |= {u.name for u in await management.list_users() if u.name in known}
    present = await management.get_vhost(vhost) is not None
    queues: set[str] = set()
    if present:
        page = await management.list_queues_page(vhost, page=1, page_size=500)
        queues = {q.name for q in page.items if q.name.startswith("consumer_")}
    return {"vhost": present, "users": users, "queues": queues}


async def assert_broker_matches_rows(
    settings: Settings,
    management: ManagementClient,
    owner: uuid.UUID,
    known: set[str] | None = None,
) -> dict[str, set[str]]:
    rows = await rows_of(settings, owner)
    broker = await broker_of(management, owner, known or set())
    assert broker["users"] == rows["users"], (broker, rows)
    assert broker["queues"] == rows["queues"], (broker, rows)
    if not rows["users"]:
        assert not broker["vhost"], "an empty vhost was left behind"
    return rows


async def _gather(calls: list[Awaitable[httpx.Response]]) -> list[httpx.Response]:
    return list(await asyncio.gather(*calls))


async def _race(
    calls: list[Awaitable[httpx.Response]], competitor: Awaitable[Any], trial: int
) -> tuple[list[httpx.Response], Any]:
    """`calls` in flight at once, and `competitor` started `delay(trial)` after them."""
    batch = asyncio.create_task(_gather(calls))
    await asyncio.sleep(delay(trial))
    other = await competitor
    return await batch, other


def register_subscription(agent: Agent, identity: str) -> Awaitable[httpx.Response]:
    return agent.client.post(
        f"{IDENTITIES}{identity}/register_event_subscription/",
        json={"observable_object_type": "order"},
        headers=agent.headers,
    )


# --- 1: a registration in flight never brings the old token back ------------------------


@pytest.mark.parametrize("route", ["register_event_subscription", "register_queue"])
@pytest.mark.parametrize("change", ["rotate", "deactivate"])
async def test_registrations_in_flight_never_bring_an_old_token_back(
    backend: Backend,
    settings: Settings,
    management: ManagementClient,
    route: str,
    change: str,
) -> None:
    """15 registrations of a started agent in flight while the backend changes the token
    (or deactivates the user): afterwards the old token logs in nowhere on the broker, and
    a rotated token logs in everywhere. Before: the old token was back on the first trial."""
    for trial in range(RACE_TRIALS):
        agent, offering = await backend.agent_with_offering()
        identity = await new_identity(agent, offering)
        register = register_queue if route == "register_queue" else register_subscription
        first = await register(agent, identity)
        assert first.status_code == 201, first.text
        new_token = secrets.token_hex(20)
        body: dict[str, Any] = {"token": new_token} if change == "rotate" else {"is_active": False}
        change_user = (
            backend.put_user(agent.uuid, token=agent.token, **body)
            if change == "deactivate"
            else backend.put_user(agent.uuid, **body)
        )
        answers, _ = await _race(
            [register(agent, identity) for _ in range(IN_FLIGHT)],
            change_user,
            trial,
        )
        assert {a.status_code for a in answers} <= {200, 201, 401}, [a.text for a in answers]
        rows = await rows_of(settings, agent.uuid)
        assert rows["users"], "the registration made no broker user"
        for name in sorted(rows["users"]):
            assert not await amqp_login(agent.vhost, name, agent.token), (
                f"trial {trial}: old token still logs in as {name} (AMQP)"
            )
            if change == "rotate":
                assert await amqp_login(agent.vhost, name, new_token), (
                    f"trial {trial}: the new token is locked out of {name}"
                )
        name = sorted(rows["users"])[0]
        assert not await stomp_login(agent.vhost, name, agent.token), f"trial {trial} (STOMP)"
        if change == "rotate":
            assert await stomp_login(agent.vhost, name, new_token), f"trial {trial} (STOMP)"


@pytest.mark.settings(scheduler_enabled=True, token_expiry_interval_seconds=1)
@pytest.mark.parametrize("made", ["now", "before_identities"])
async def test_revoke_expired_compares_with_what_the_broker_holds(
    app: FastAPI, backend: Backend, management: ManagementClient, settings: Settings, made: str
) -> None:
    """A broker user left holding an old password while its row says the current one (what
    the race above did before the owner lock) is set right and its connections closed
    within seconds by `revoke_expired`, which lists the broker's users. Before: the row
    agreed with the owner, so nothing was done (the login still worked after 45 s). A broker
    user made before installation identities (the instance tag alone, not yet adopted by
    reconcile) is compared too (decision 001)."""
    agent, offering = await backend.agent_with_offering()
    identity = await new_identity(agent, offering)
    answer = (await register_queue(agent, identity)).json()
    name = answer["rmq_username"]
    old_token = agent.token
    await backend.put_user(agent.uuid, token=secrets.token_hex(20))
    # What a lost race leaves: the broker user holds the old token, the row the new one.
    tags = await app.state.queuekeeper.provisioner.tags()
    if made == "before_identities":
        tags = [settings.instance_tag]
    await management.put_user(name, password_hash=rabbit_password_hash(old_token), tags=tags)
    consumer = StompConsumer(agent.vhost, name, old_token)
    await asyncio.to_thread(consumer.connect)
    try:
        consumer.subscribe(f"/amq/queue/{answer['queue_name']}")
        assert await asyncio.to_thread(consumer.wait_refused, 6.0), "connection still open"
    finally:
        await asyncio.to_thread(consumer.close)
    assert not await amqp_login(agent.vhost, name, old_token)


# --- 2: consumer registration is idempotent under concurrency ---------------------------


async def test_identical_consumer_registrations_in_parallel_make_one_consumer(
    backend: Backend, settings: Settings, management: ManagementClient
) -> None:
    """Before: 8 identical calls made 8 consumers, queues and broker users."""
    for _ in range(RACE_TRIALS):
        agent, offering = await backend.agent_with_offering()
        other = await backend.put_offering()
        await backend.grant(agent, other)
        body = {"scopes": [{"type": "offering", "uuid": str(o)} for o in (offering, other)]}
        answers = await asyncio.gather(
            *(
                agent.client.post(
                    "/api/event-consumers/register/", json=body, headers=agent.headers
                )
                for _ in range(8)
            )
        )
        codes = sorted(a.status_code for a in answers)
        assert codes == [200] * 7 + [201], [a.text for a in answers]
        assert len({a.json()["rmq_username"] for a in answers}) == 1
        rows = await assert_broker_matches_rows(settings, management, agent.uuid)
        assert len(rows["queues"]) == 1

        identity = await new_identity(agent, offering)
        answers = await asyncio.gather(*(register_queue(agent, identity) for _ in range(8)))
        assert sorted(a.status_code for a in answers) == [200] * 7 + [201]
        rows = await assert_broker_matches_rows(settings, management, agent.uuid)
        assert len(rows["queues"]) == 2


# --- 3: quotas hold against parallel calls ----------------------------------------------


@pytest.mark.settings(
    max_consumers_per_user=6, max_identities_per_user=5, registration_rate_limit="10000/second"
)
async def test_parallel_registrations_never_pass_a_quota(
    backend: Backend, settings: Settings, management: ManagementClient
) -> None:
    """Before: holding 15 consumers (limit 20), 20 parallel registrations gave 35."""
    for _ in range(RACE_TRIALS):
        agent = await backend.put_user()
        offerings = [await backend.put_offering() for _ in range(12)]
        for offering in offerings:
            await backend.grant(agent, offering)
        for offering in offerings[:2]:  # two held already
            response = await agent.client.post(
                "/api/event-consumers/register/",
                json={"scopes": [{"type": "offering", "uuid": str(offering)}]},
                headers=agent.headers,
            )
            assert response.status_code == 201, response.text
        answers = await asyncio.gather(
            *(
                agent.client.post(
                    "/api/event-consumers/register/",
                    json={"scopes": [{"type": "offering", "uuid": str(offering)}]},
                    headers=agent.headers,
                )
                for offering in offerings[2:]
            )
        )
        assert sorted(a.status_code for a in answers) == [201] * 4 + [409] * 6
        rows = await assert_broker_matches_rows(settings, management, agent.uuid)
        assert len(rows["queues"]) == 6

        created = await asyncio.gather(
            *(
                agent.client.post(
                    IDENTITIES,
                    json=agent_body(offerings[0].hex, name=f"agent-{index}"),
                    headers=agent.headers,
                )
                for index in range(10)
            )
        )
        assert sorted(a.status_code for a in created) == [201] * 5 + [409] * 5
        assert len((await rows_of(settings, agent.uuid))["identities"]) == 5


# --- 4: a deletion that commits leaves nothing on the broker ----------------------------


@pytest.mark.parametrize("deletion", ["identity", "consumer", "user", "offering"])
async def test_a_deletion_racing_registrations_leaves_no_broker_object(
    backend: Backend,
    client: httpx.AsyncClient,
    settings: Settings,
    management: ManagementClient,
    deletion: str,
) -> None:
    """register_queue in flight while the identity, its consumer or the user is deleted:
    afterwards the broker holds exactly what the rows say (no user, queue or vhost without
    a row) and the token logs in to nothing that has no row. Before: the identity or
    consumer DELETE left a live broker user, queue and vhost (1 of 4), the user DELETE saw
    its broker user made again with the old password (4 of 4); the offering DELETE, taking
    no lock, could miss a consumer committed between its read and its delete."""
    for trial in range(RACE_TRIALS):
        agent, offering = await backend.agent_with_offering()
        identity = await new_identity(agent, offering)
        first = await register_queue(agent, identity)
        assert first.status_code == 201, first.text
        name = first.json()["rmq_username"]

        path = {
            "identity": f"{IDENTITIES}{identity}/",
            "consumer": f"/api/event-consumers/{name}/",
            "user": f"/api/internal/users/{agent.uuid}/",
            "offering": f"/api/internal/offerings/{offering}/",
        }[deletion]
        headers = agent.headers if deletion == "identity" else SERVICE
        answers, deleted = await _race(
            [register_queue(agent, identity) for _ in range(IN_FLIGHT)],
            client.delete(path, headers=headers),
            trial,
        )
        assert deleted.status_code == 204, deleted.text
        # A call authenticated before the user went finds no user (401), no grant (403), or
        # its identity kept without an owner (409: it belongs to a user who was deleted).
        # A call that finds the offering gone: no grant (403), no identity (404)
        allowed = {200, 201, 401, 404} | ({403, 409} if deletion == "user" else set())
        if deletion == "offering":  # or an unknown offering (400)
            allowed |= {400, 403}
        # On a machine loaded past what it can serve, a connection the race needs may take
        # longer than the database's connect timeout (5 s): a 503 for that call, by design.
        # What this test guards is below: the broker matches the rows whatever answered.
        unexpected = [
            (a.status_code, a.text)
            for a in answers
            if a.status_code not in allowed
            and not (a.status_code == 503 and "database is unavailable" in a.text)
        ]
        assert not unexpected, unexpected
        known = {name} | {a.json()["rmq_username"] for a in answers if a.status_code < 300}
        rows = await assert_broker_matches_rows(settings, management, agent.uuid, known)
        if name not in rows["users"]:
            assert not await amqp_login(agent.vhost, name, agent.token), f"trial {trial}"
        if deletion != "consumer":
            assert not rows["users"], f"trial {trial}: rows left {rows}"


async def test_refused_registrations_racing_a_deletion_leave_no_empty_vhost(
    backend: Backend, client: httpx.AsyncClient, settings: Settings, management: ManagementClient
) -> None:
    """The identity is deleted while 15 first registrations of its consumer are in flight:
    those refused (404) leave no vhost behind. Before: 11 empty vhosts in one probe."""
    for trial in range(RACE_TRIALS):
        agent, offering = await backend.agent_with_offering()
        identity = await new_identity(agent, offering)
        answers, deleted = await _race(
            [register_queue(agent, identity) for _ in range(IN_FLIGHT)],
            client.delete(f"{IDENTITIES}{identity}/", headers=agent.headers),
            trial,
        )
        assert deleted.status_code == 204
        assert {a.status_code for a in answers} <= {200, 201, 404}, [a.text for a in answers]
        rows = await assert_broker_matches_rows(settings, management, agent.uuid)
        assert not rows["users"]


# --- the cost of a registration stays O(1) ---------------------------------------------


# Counted statements are the request's own: no relay or presence writer beside it.
@pytest.mark.settings(
    registration_rate_limit="10000/second", relay_enabled=False, presence_events_enabled=False
)
async def test_a_repeat_registration_costs_the_same_however_much_its_owner_holds(
    app: FastAPI, backend: Backend
) -> None:
    """The owner lock adds one statement, never one per row the owner holds: a repeat
    register_queue and register_event_subscription send as many statements and Management
    API calls with one identity as with nine (docs/benchmarks.md has the timings)."""
    state = app.state.queuekeeper
    agent, offering = await backend.agent_with_offering()
    calls: list[str] = []
    send = state.management._request

    async def counted(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(f"{method} {path}")
        return await send(method, path, *args, **kwargs)

    async def cost(identity: str) -> dict[str, tuple[int, int]]:
        found = {}
        for route in ("register_queue", "register_event_subscription"):
            call = register_queue if route == "register_queue" else register_subscription
            calls.clear()
            with (
                pytest.MonkeyPatch.context() as patch,
                database_statements(state.engine, own_only=True) as statements,
            ):
                patch.setattr(state.management, "_request", counted)
                response = await call(agent, identity)
            assert response.status_code == 200, response.text
            found[route] = (len(statements), len(calls))
        return found

    first = await new_identity(agent, offering, name="agent-0")
    for _ in range(2):  # made, then the repeat whose cost is measured
        await register_queue(agent, first)
        await register_subscription(agent, first)
    alone = await cost(first)
    for index in range(1, 9):
        identity = await new_identity(agent, offering, name=f"agent-{index}")
        assert (await register_queue(agent, identity)).status_code == 201
        assert (await register_subscription(agent, identity)).status_code == 201
    print(f"repeat cost (statements, Management API calls): {alone}")
    assert all(statements > 0 for statements, _ in alone.values()), alone  # counted at all
    assert await cost(first) == alone


@pytest.mark.settings(max_queues_per_user=5, registration_rate_limit="10000/second")
async def test_parallel_create_queue_calls_never_pass_the_queue_quota(
    backend: Backend, settings: Settings, management: ManagementClient
) -> None:
    """Holding 2 queues (limit 5), 12 parallel create_queue calls for new queues: 3 are made,
    9 refused, and no refused call leaves a broker queue. Before: all 12 were made."""
    for _ in range(RACE_TRIALS):
        agent, offering = await backend.agent_with_offering()
        subscription = (await agent.create_subscription())["uuid"]
        types = ["order", "resource", "offering_user", "user_role", "importable_resources"]
        others = [await backend.put_offering() for _ in range(3)]
        for other in others:
            await backend.grant(agent, other)
        pairs = [(o, t) for o in (offering, *others) for t in types[:4]][:14]
        for held in pairs[:2]:
            assert (await agent.create_queue(subscription, *held)).status_code == 201
        answers = await asyncio.gather(*(agent.create_queue(subscription, *p) for p in pairs[2:]))
        assert sorted(a.status_code for a in answers) == [201] * 3 + [409] * 9, [
            a.text for a in answers if a.status_code not in (201, 409)
        ]
        page = await management.list_queues_page(agent.vhost, page=1, page_size=100)
        made = {q.name for q in page.items if q.name.startswith("subscription_")}
        assert len(made) == 5, made
