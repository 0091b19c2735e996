"""A copy reaches a consumer only if its owner may receive the event when the copy is
published, not only when the event was accepted (contract §11,
docs/decisions/021-authorized-when-published.md): parked copies of a revoked offering, a
replay after a revocation, an identity moved to another offering, a removed token; and
replay bounded. Each was seen delivered (or unbounded) before, by a real consumer reading
the queue."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import delete, select

from queuekeeper.app import Runtime
from queuekeeper.config import Settings
from queuekeeper.events.outbox import Outbox
from queuekeeper.events.outbox_postgres import REFUSED_REASON
from queuekeeper.models import Delivery, OfferingAccess, utcnow
from tests.consumers.sweeps import swept
from tests.consumers.test_register_queue import new_identity, register_queue
from tests.events.support import SERVICE, drain, event_detail, order_event, post_event
from tests.helpers import Agent, Backend
from tests.identities.test_identities import IDENTITIES, agent_body
from tests.parking.support import set_presence, wait_for_states
from tests.stomp_client import StompConsumer

FAST = {"park_after_seconds": 60, "park_check_interval": 0.1}
AWAY_LONG = 600  # seconds: past park_after, so new copies park


async def _consumer(agent: Agent, offerings: list[uuid.UUID]) -> tuple[str, str]:
    """A consumer of `offerings`: (queue name, broker login)."""
    scopes = [{"type": "offering", "uuid": o.hex} for o in offerings]
    answer = await agent.client.post(
        "/api/event-consumers/register/", json={"scopes": scopes}, headers=agent.headers
    )
    assert answer.status_code == 201, answer.text
    return answer.json()["queue_name"], answer.json()["rmq_username"]


async def _post_all(client: httpx.AsyncClient, offerings: list[uuid.UUID]) -> list[str]:
    ids = []
    for offering in offerings:
        response = await post_event(client, order_event(offering))
        assert response.status_code in (200, 201, 202), response.text
        ids.append(response.json()["event_id"])
    return ids


async def _revoke(client: httpx.AsyncClient, offering: uuid.UUID, agent: Agent) -> None:
    response = await client.delete(
        f"/api/internal/offerings/{offering}/users/{agent.uuid}/", headers=SERVICE
    )
    assert response.status_code == 204, response.text


async def _stomp(vhost: str, login: str, token: str, queue: str) -> StompConsumer:
    consumer = StompConsumer(vhost, login, token)
    await asyncio.to_thread(consumer.connect)
    consumer.subscribe(f"/amq/queue/{queue}")
    return consumer


async def _received(consumer: StompConsumer, count: int, settle: float = 1.5) -> list[str]:
    """What the consumer has received once `count` arrived (or its wait ran out), after a
    further `settle` seconds in which nothing else may arrive."""
    await asyncio.to_thread(consumer.wait_for, count, 15.0)
    await asyncio.sleep(settle)
    return [message.headers["amqp-message-id"] for message in consumer.listener.messages]


def _replay_body(since: datetime) -> dict[str, Any]:
    return {"since": since.isoformat()}


@pytest.mark.settings(**FAST)
async def test_parked_copies_of_a_revoked_offering_are_not_delivered_on_return(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    """Finding 1: a consumer of X and Z, away; X, Z, X, Z parked; X revoked. Before: status
    kept `parked: 4` and X's two copies arrived on reconnect."""
    state: Runtime = app.state.queuekeeper
    agent, revoked = await backend.agent_with_offering()
    kept = await backend.put_offering()
    await backend.grant(agent, kept)
    queue, login = await _consumer(agent, [revoked, kept])
    await set_presence(state.sessions, agent.vhost, queue, consumers=0, away_for=AWAY_LONG)
    await asyncio.sleep(0.3)  # a few looks of the gate
    ids = await _post_all(client, [revoked, kept, revoked, kept])
    await wait_for_states(state.sessions, queue, {"parked": 4})

    await _revoke(client, revoked, agent)
    await wait_for_states(state.sessions, queue, {"parked": 2, "given_up": 2})
    status = (await client.get(f"/api/event-consumers/{login}/status/", headers=SERVICE)).json()
    assert status["parked"] == 2

    consumer = await _stomp(agent.vhost, login, agent.token, queue)
    try:
        await set_presence(state.sessions, agent.vhost, queue, consumers=1)
        assert await _received(consumer, 2) == [ids[1], ids[3]]
        offerings = {m.headers.get("offering_uuid") for m in consumer.listener.messages}
        assert offerings == {kept.hex}
    finally:
        await asyncio.to_thread(consumer.close)


@pytest.mark.settings(relay_enabled=False)
async def test_a_copy_is_judged_when_claimed_whatever_removed_the_access(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    """The claim itself checks the owner: access gone by any path (here the grant's row
    deleted behind the revocation's back) and the waiting copy is given up when a relay
    takes it, never handed to the broker; a copy of an offering still granted is claimed."""
    state: Runtime = app.state.queuekeeper
    agent, lost = await backend.agent_with_offering()
    kept = await backend.put_offering()
    await backend.grant(agent, kept)
    queue, _login = await _consumer(agent, [lost, kept])
    lost_id, kept_id = await _post_all(client, [lost, kept])
    async with state.sessions() as session:
        await session.execute(
            delete(OfferingAccess).where(
                OfferingAccess.user_uuid == agent.uuid, OfferingAccess.offering_uuid == lost
            )
        )
        await session.commit()

    # Claimed at once: the store's judgment of a moment ago proves nothing after the
    # change (docs/decisions/029-judged-as-it-leaves.md).
    claimed, _lease = await Outbox(state.engine, state.settings).claim("relay-t", utcnow(), 10)
    assert [item.event_id for item in claimed] == [kept_id]
    detail = await event_detail(client, lost_id)
    assert [(d["queue_name"], d["state"]) for d in detail["deliveries"]] == [(queue, "given_up")]
    async with state.sessions() as session:
        reason = await session.scalar(
            select(Delivery.last_error).where(Delivery.event_id == lost_id)
        )
    assert reason == REFUSED_REASON


async def test_a_replay_after_a_revocation_sends_only_what_the_owner_may_receive(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    """Finding 2: after revoking X, a replay of a window from before sent X's events next
    to Z's (`{"replayed": 8}` for four of each). Now only Z's."""
    agent, revoked = await backend.agent_with_offering()
    kept = await backend.put_offering()
    await backend.grant(agent, kept)
    queue, login = await _consumer(agent, [revoked, kept])
    since = utcnow() - timedelta(seconds=1)
    ids = []
    for offering in (revoked, kept, revoked, kept):
        response = await post_event(client, order_event(offering), wait=True)
        assert response.status_code == 200, response.text
        ids.append(response.json()["event_id"])
    assert [m.message_id for m in await drain(agent.vhost, queue)] == ids
    await _revoke(client, revoked, agent)
    # The sweep reads the queue through (the agent's login off meanwhile): the revoked
    # offering's copies were confirmed to it
    # (docs/decisions/030-queued-copies-on-every-access-loss.md).
    await swept(settings)

    response = await agent.client.post(
        f"/api/event-consumers/{login}/replay/", json=_replay_body(since), headers=agent.headers
    )
    assert response.status_code == 202, response.text
    assert response.json() == {"replayed": 2}
    consumer = await _stomp(agent.vhost, login, agent.token, queue)
    try:
        assert await _received(consumer, 2) == [ids[1], ids[3]]
    finally:
        await asyncio.to_thread(consumer.close)
    # The operator's replay of the same queue, once that one is out, by the same rule.
    await wait_for_states(app.state.queuekeeper.sessions, queue, {"published": 6})
    response = await client.post(
        "/api/admin/queues/replay/",
        json={**_replay_body(since), "vhost": agent.vhost, "queue_name": queue},
        headers=SERVICE,
    )
    assert response.status_code == 202, response.text
    assert response.json() == {"replayed": 2}


@pytest.mark.settings(**FAST)
async def test_an_identity_moved_to_another_offering_takes_none_of_the_old_ones_events(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    """Finding 3: identity on X -> consumer C; one X copy waits in the queue and one is
    parked; the identity is PUT to Y and C registered again (scopes [Y]); X revoked.
    Before: the waiting copy was delivered, the parked one released on reconnect, and a
    replay sent X's events."""
    state: Runtime = app.state.queuekeeper
    agent, old = await backend.agent_with_offering()
    new = await backend.put_offering()
    await backend.grant(agent, new)
    identity = await new_identity(agent, old)
    answer = await register_queue(agent, identity, {"object_types": ["order"]})
    assert answer.status_code == 201, answer.text
    queue, login = answer.json()["queue_name"], answer.json()["rmq_username"]
    since = utcnow() - timedelta(seconds=1)
    waiting = await post_event(client, order_event(old), wait=True)
    assert waiting.json()["queued"] == 1
    await set_presence(state.sessions, agent.vhost, queue, consumers=0, away_for=AWAY_LONG)
    await asyncio.sleep(0.3)
    await _post_all(client, [old])
    await wait_for_states(state.sessions, queue, {"published": 1, "parked": 1})

    moved = await client.put(
        f"{IDENTITIES}{identity}/", json=agent_body(new.hex), headers=agent.headers
    )
    assert moved.status_code == 200, moved.text
    again = await register_queue(agent, identity, {"object_types": ["order"]})
    assert again.status_code == 200, again.text
    assert again.json()["queue_name"] == queue
    await wait_for_states(state.sessions, queue, {"published": 1, "given_up": 1})
    await _revoke(client, old, agent)
    await swept(settings)  # the waiting copy of the old offering is out of the queue

    replay = await agent.client.post(
        f"/api/event-consumers/{login}/replay/", json=_replay_body(since), headers=agent.headers
    )
    assert replay.status_code == 202, replay.text
    assert replay.json() == {"replayed": 0}
    fresh = await post_event(client, order_event(new))
    consumer = await _stomp(agent.vhost, login, agent.token, queue)
    try:
        await set_presence(state.sessions, agent.vhost, queue, consumers=1)
        assert await _received(consumer, 1) == [fresh.json()["event_id"]]
    finally:
        await asyncio.to_thread(consumer.close)


@pytest.mark.settings(replay_max_copies=3, replay_copies_per_second=0.01)
async def test_replay_is_one_at_a_time_per_queue_and_bounded_in_copies(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    """Finding 4: 40 concurrent replays of one window were 36 accepted and 72,000 copies.
    Now one replay of a queue is in flight at a time (the others 409, naming it), its
    copies are written once, and a window over the limit is a 400 naming limit and count."""
    state: Runtime = app.state.queuekeeper
    agent, offering = await backend.agent_with_offering()
    queue, login = await _consumer(agent, [offering])
    since = utcnow() - timedelta(seconds=1)
    for _ in range(3):
        assert (await post_event(client, order_event(offering), wait=True)).status_code == 200
    await drain(agent.vhost, queue)
    path = f"/api/event-consumers/{login}/replay/"

    # The replays' copies are spaced far apart, so the first stays in flight throughout.
    answers = await asyncio.gather(
        *(
            agent.client.post(path, json=_replay_body(since), headers=agent.headers)
            for _ in range(8)
        )
    )
    codes = sorted(answer.status_code for answer in answers)
    assert codes == [202] + [409] * 7, [answer.text for answer in answers]
    refused = next(answer.json() for answer in answers if answer.status_code == 409)
    assert "still being published" in refused["detail"]
    async with state.sessions() as session:
        replays = await session.scalar(
            select(Delivery.id).where(Delivery.queue_name == queue, Delivery.replay).limit(1)
        )
        rows = (
            await session.execute(
                select(Delivery.next_attempt_at).where(
                    Delivery.queue_name == queue, Delivery.replay
                )
            )
        ).all()
    assert replays is not None
    assert len(rows) == 3
    due = sorted(row[0] for row in rows)
    # 1 / 0.01 s apart (the first is due at once, and claimed: its due time is its lease's)
    assert due[2] - due[1] >= timedelta(seconds=99)


@pytest.mark.settings(replay_max_copies=3)
async def test_a_replay_window_over_the_limit_is_a_400_naming_it(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    queue, login = await _consumer(agent, [offering])
    since = utcnow() - timedelta(seconds=1)
    for _ in range(4):
        assert (await post_event(client, order_event(offering), wait=True)).status_code == 200
    response = await agent.client.post(
        f"/api/event-consumers/{login}/replay/", json=_replay_body(since), headers=agent.headers
    )
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["copies"] == 4
    assert body["max_copies"] == 3
    assert "QUEUEKEEPER_REPLAY_MAX_COPIES=3" in body["detail"]
    assert len(await drain(agent.vhost, queue)) == 4  # the originals only


async def test_a_removed_token_receives_nothing_and_nothing_comes_with_a_new_token(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    """Finding 6: a user pushed with `"token": null` kept getting copies (parked, then all
    delivered once a token came back). Now no copy is made while the token is missing."""
    agent, offering = await backend.agent_with_offering()
    queue, _login = await _consumer(agent, [offering])
    username = f"user-{agent.uuid.hex[:8]}"
    response = await client.put(
        f"/api/internal/users/{agent.uuid}/",
        json={"username": username, "token": None},
        headers=SERVICE,
    )
    assert response.status_code == 200, response.text
    missing = await post_event(client, order_event(offering), wait=True)
    assert missing.json()["queued"] == 0

    token = uuid.uuid4().hex + uuid.uuid4().hex
    response = await client.put(
        f"/api/internal/users/{agent.uuid}/",
        json={"username": username, "token": token},
        headers=SERVICE,
    )
    assert response.status_code == 200, response.text
    later = await post_event(client, order_event(offering), wait=True)
    assert later.json()["queued"] == 1
    assert [m.message_id for m in await drain(agent.vhost, queue)] == [later.json()["event_id"]]
