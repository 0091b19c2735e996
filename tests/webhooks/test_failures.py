"""What a receiver can do wrong (slow, silent, a huge answer, a closed connection, gone for a
restart of queuekeeper) and what the owner can lose (access): each a failed attempt or a
copy given up, recorded, and never a dispatcher stuck (contract §13)."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
from aiohttp import web
from sqlalchemy import text

from queuekeeper.app import running
from queuekeeper.config import Settings
from queuekeeper.db import create_engine
from queuekeeper.events.outbox import Outbox
from queuekeeper.models import utcnow
from queuekeeper.webhooks.dispatcher import CONSUMER_GONE, WebhookDispatcher, connection_error
from tests.events.support import order_event, post_event
from tests.helpers import Backend
from tests.webhooks.support import (
    WEBHOOK_SETTINGS,
    Answer,
    consumer_row,
    copies,
    eventually,
    receiving,
    webhook_consumer,
)

pytestmark = pytest.mark.settings(**WEBHOOK_SETTINGS)


async def _states(settings: Settings, consumer: object) -> list[str]:
    return [c["state"] for c in await copies(settings, consumer)]  # type: ignore[arg-type]


@pytest.mark.settings(**{**WEBHOOK_SETTINGS, "webhook_timeout_seconds": 10.0})
async def test_a_slow_receiver_does_not_delay_another_consumer(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    async def slow(_request: web.Request, _number: int) -> web.StreamResponse:
        await asyncio.sleep(5)
        return web.Response(status=200)

    agent, offering = await backend.agent_with_offering()
    async with receiving(slow) as slow_one, receiving() as fast_one:
        slow_hook = await webhook_consumer(settings, agent.uuid, offering, slow_one.url)
        fast_hook = await webhook_consumer(settings, agent.uuid, offering, fast_one.url)
        started = time.monotonic()
        for n in range(3):
            answer = await post_event(client, order_event(offering, event_id=f"both-{n}"))
            assert answer.json()["queued"] == 2
        await fast_one.wait_for(3, timeout=4)
        assert fast_one.ids() == ["both-0", "both-1", "both-2"]
        assert fast_one.received[-1].at - started < 2.0
        assert len(slow_one.received) == 1  # still on its first copy, one at a time
        assert await _states(settings, slow_hook.uuid) == ["pending"] * 3
        assert (await consumer_row(settings, fast_hook.uuid))["last_delivered_at"] is not None


async def test_a_receiver_that_never_answers_is_a_timeout_and_the_next_consumer_goes_on(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    async def silent(_request: web.Request, _number: int) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.Response(status=200)

    agent, offering = await backend.agent_with_offering()
    async with receiving(silent) as mute, receiving() as fine:
        hook = await webhook_consumer(settings, agent.uuid, offering, mute.url)
        other = await webhook_consumer(settings, agent.uuid, offering, fine.url)
        await post_event(client, order_event(offering, event_id="silent-1"))

        async def timed_out() -> bool:
            return (await consumer_row(settings, hook.uuid))["last_error"] == "timeout after 1 s"

        await eventually(timed_out, what="the timeout recorded")
        await post_event(client, order_event(offering, event_id="silent-2"))
        await fine.wait_for(2, timeout=3)
        assert fine.ids() == ["silent-1", "silent-2"]
        assert (await consumer_row(settings, other.uuid))["last_error"] == ""


async def test_a_huge_answer_is_read_only_up_to_the_cap(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    """A 200 with an endless body is delivered (the status decides) without reading it all,
    and the next copy follows at once."""
    sent = {"bytes": 0}

    async def endless(request: web.Request, _number: int) -> web.StreamResponse:
        answer = web.StreamResponse(status=200)
        await answer.prepare(request)
        chunk = b"x" * 65536
        try:
            for _ in range(4096):  # 256 MiB, if anyone read it all
                await answer.write(chunk)
                sent["bytes"] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass
        return answer

    agent, offering = await backend.agent_with_offering()
    async with receiving(endless) as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        started = time.monotonic()
        await post_event(client, order_event(offering, event_id="huge-1"))
        await post_event(client, order_event(offering, event_id="huge-2"))
        await receiver.wait_for(2, timeout=5)
        assert receiver.ids() == ["huge-1", "huge-2"]

        async def delivered() -> bool:
            return await _states(settings, hook.uuid) == ["published", "published"]

        await eventually(delivered, timeout=5, what="both delivered")
        assert time.monotonic() - started < 5
        assert sent["bytes"] < 64 * 1024 * 1024


async def test_a_connection_closed_without_an_answer_is_a_failed_attempt(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    seen: list[bytes] = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.read(65536))
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    agent, offering = await backend.agent_with_offering()
    try:
        hook = await webhook_consumer(
            settings, agent.uuid, offering, f"http://127.0.0.1:{port}/hook"
        )
        await post_event(client, order_event(offering, event_id="hang-up-1"))

        async def recorded() -> bool:
            row = await consumer_row(settings, hook.uuid)
            return row["last_error"].startswith("connection closed by the receiver")

        await eventually(recorded, what="the closed connection recorded")
        assert seen
        assert b"webhook-id: hang-up-1" in seen[0].lower()
        assert await _states(settings, hook.uuid) == ["pending"]
    finally:
        server.close()
        await server.wait_closed()


async def test_an_answer_that_is_not_http_is_a_failed_attempt_that_never_shows_the_url(
    client: httpx.AsyncClient,
    backend: Backend,
    settings: Settings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A bad status line is a failed attempt on the retry schedule, recorded for the owner;
    neither the record nor the log shows the URL's credential (decision 027)."""

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(b"NOT-HTTP \x00\x01 nonsense\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    agent, offering = await backend.agent_with_offering()
    try:
        url = f"http://user:pa55word@127.0.0.1:{port}/hook?key=s3cret-credential"
        hook = await webhook_consumer(settings, agent.uuid, offering, url)
        await post_event(client, order_event(offering, event_id="garbage-1"))

        async def recorded() -> bool:
            return bool((await consumer_row(settings, hook.uuid))["last_error"])

        await eventually(recorded, what="the bad answer recorded")
        row = await consumer_row(settings, hook.uuid)
        assert row["last_error"] == "invalid HTTP answer", row["last_error"]
        assert row["webhook_failing_since"] is not None

        # Between attempts (not claimed: a claim's `next_attempt_at` is its lease's end).
        # The retries come 0.2 s apart, so a slow machine may read one already due.
        seen: list[dict[str, Any]] = []

        async def between_attempts() -> bool:  # the same read is asserted on below
            seen[:] = await copies(settings, hook.uuid)
            return seen[0]["claimed_by"] is None

        await eventually(between_attempts, what="the copy between two attempts")
        (copy,) = seen
        assert copy["state"] == "pending"
        # On the retry schedule (0.2 s, then 0.4 s, plus up to 20 %), not the lease (30 s).
        assert copy["next_attempt_at"] < utcnow() + timedelta(seconds=1)
        assert settings.relay_lease_seconds >= 30
    finally:
        server.close()
        await server.wait_closed()
    logged = capsys.readouterr()
    for secret in ("s3cret-credential", "pa55word", "dXNlcjpwYTU1d29yZA"):
        assert secret not in logged.out + logged.err


def test_a_connection_error_never_repeats_the_clients_text() -> None:
    """aiohttp's messages name the URL (`Can not write request body for <url>`)."""
    leaking = OSError(None, "Can not write request body for http://h/x?key=s3cret")
    assert "s3cret" not in connection_error(leaking)
    refused = OSError(errno.ECONNREFUSED, "Connect call failed")
    assert connection_error(refused) == "connection refused"
    reset = OSError(errno.ECONNRESET, "reset by http://h/x?key=s3cret")
    assert connection_error(reset) == f"connection failed: {os.strerror(errno.ECONNRESET)}"


@pytest.mark.settings(**{**WEBHOOK_SETTINGS, "webhook_allowed_networks": ""})
async def test_an_address_outside_the_allowed_networks_is_refused_at_each_attempt(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    """Loopback is not allowed here: the attempt fails before any connection is made."""
    agent, offering = await backend.agent_with_offering()
    async with receiving() as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        await post_event(client, order_event(offering, event_id="refused-1"))

        async def refused() -> bool:
            row = await consumer_row(settings, hook.uuid)
            return "loopback" in row["last_error"]

        await eventually(refused, what="the refusal recorded")
        assert receiver.received == []
        (copy,) = await copies(settings, hook.uuid)
        assert copy["state"] == "pending"
        assert "127.0.0.1 is a loopback address" in copy["last_error"]


async def test_a_revoked_owner_s_copy_is_given_up_not_posted(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    """The first attempt fails; the owner's token then expires: the retry's claim judges the
    copy again and gives it up instead of posting it."""
    agent, offering = await backend.agent_with_offering()
    async with receiving(_status(503)) as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        await post_event(client, order_event(offering, event_id="revoked-1"))
        await receiver.wait_for(1)
        await backend.expire_token_at(agent, utcnow() - timedelta(minutes=1))
        receiver.answer = _status(200)

        async def given_up() -> bool:
            return await _states(settings, hook.uuid) == ["given_up"]

        await eventually(given_up, what="the copy given up")
        (copy,) = await copies(settings, hook.uuid)
        assert "not authorized when published" in copy["last_error"]
        await asyncio.sleep(0.5)
        assert len(receiver.received) == 1


def _status(code: int) -> Answer:
    async def answer(_request: web.Request, _number: int) -> web.StreamResponse:
        return web.Response(status=code)

    return answer


@pytest.mark.settings(**{**WEBHOOK_SETTINGS, "relay_enabled": False, "relay_lease_seconds": 1.0})
async def test_a_dispatcher_that_dies_holding_a_copy_loses_nothing(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    """A dispatcher claims and dies (its lease is never renewed nor its copy settled): when
    the lease runs out another posts the copy, with the same webhook-id."""
    agent, offering = await backend.agent_with_offering()
    async with receiving() as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        await post_event(client, order_event(offering, event_id="crash-1"))
        await post_event(client, order_event(offering, event_id="crash-2"))
        engine = create_engine(settings)
        try:
            outbox = Outbox(engine, settings)
            taken, _lease = await outbox.claim_webhooks("dead-dispatcher", utcnow(), 32, 10)
        finally:
            await engine.dispose()
        assert [c.claimed.event_id for c in taken] == ["crash-1", "crash-2"]
        async with running(settings, relay=True):
            await receiver.wait_for(2, timeout=10)
            assert receiver.ids() == ["crash-1", "crash-2"]

            async def delivered() -> bool:
                return await _states(settings, hook.uuid) == ["published", "published"]

            await eventually(delivered, what="both delivered")


@pytest.mark.settings(
    **{**WEBHOOK_SETTINGS, "relay_enabled": False, "webhook_timeout_seconds": 20.0}
)
async def test_a_restart_mid_delivery_posts_the_copy_again_with_the_same_id(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    """queuekeeper stops while a receiver holds its request: the copy is posted again by the
    next start, with the same webhook-id, and then the next one; nothing is lost."""
    release = asyncio.Event()

    async def hold_first(_request: web.Request, number: int) -> web.StreamResponse:
        if number == 0:
            await release.wait()
        return web.Response(status=200)

    agent, offering = await backend.agent_with_offering()
    async with receiving(hold_first) as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        await post_event(client, order_event(offering, event_id="restart-1"))
        await post_event(client, order_event(offering, event_id="restart-2"))
        async with running(settings, relay=True) as state:
            await receiver.wait_for(1)
            assert state.webhooks is not None
            await state.webhooks.stop(grace=0.2)  # cut short mid-request
            state.webhooks = None
        assert await _states(settings, hook.uuid) == ["pending", "pending"]
        release.set()
        async with running(settings, relay=True):
            await receiver.wait_for(3)

            async def delivered() -> bool:
                return await _states(settings, hook.uuid) == ["published", "published"]

            await eventually(delivered, what="both delivered")
        assert receiver.ids() == ["restart-1", "restart-1", "restart-2"]


@pytest.mark.settings(**{**WEBHOOK_SETTINGS, "event_retention_days": 2 / 86400})
async def test_copies_no_claim_takes_are_given_up(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    """A deleted consumer's copies, and a disabled (410) consumer's copies past retention,
    are given up by the dispatcher's housekeeping rather than kept pending for ever."""
    agent, offering = await backend.agent_with_offering()
    async with receiving(_status(503)) as failing, receiving(_status(410)) as gone:
        deleted = await webhook_consumer(settings, agent.uuid, offering, failing.url)
        disabled = await webhook_consumer(settings, agent.uuid, offering, gone.url)
        await post_event(client, order_event(offering, event_id="stranded-1"))
        await failing.wait_for(1)
        await gone.wait_for(1)
        engine = create_engine(settings)
        try:
            async with engine.begin() as connection:
                await connection.execute(
                    text("DELETE FROM event_consumers WHERE uuid = :uuid"), {"uuid": deleted.uuid}
                )
            await asyncio.sleep(2.5)  # the disabled consumer's copy is past retention now
            dispatcher = WebhookDispatcher(settings, engine)
            try:
                assert await dispatcher.give_up_stranded() == 2
            finally:
                await dispatcher.close()
            async with engine.connect() as connection:
                rows = (
                    await connection.execute(
                        text(
                            "SELECT consumer_uuid, state, last_error FROM deliveries"
                            " WHERE event_id = 'stranded-1' ORDER BY id"
                        )
                    )
                ).all()
        finally:
            await engine.dispose()
        reasons = {row[0]: (row[1], row[2]) for row in rows}
        assert reasons[None] == ("given_up", CONSUMER_GONE)
        assert reasons[disabled.uuid][0] == "given_up"
        assert reasons[disabled.uuid][1].startswith("retention")
