"""/healthz and /readyz against the real services, with outages made by a proxy we close."""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import respx
from asgi_lifespan import LifespanManager
from structlog.testing import capture_logs

from queuekeeper.app import create_app
from queuekeeper.config import Settings
from tests.brokers import BROKER
from tests.proxy import closed_port, tcp_proxy


@asynccontextmanager
async def serving(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    # A dependency that is up must not look down because a loaded test machine answered
    # slowly: a generous timeout, unless the test is about timeouts.
    if "readiness_timeout" not in settings.model_fields_set:
        settings = settings.model_copy(update={"readiness_timeout": 15.0})
    app = create_app(settings)
    async with LifespanManager(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            yield http, app.state.queuekeeper


def _down(response: httpx.Response) -> set[str]:
    return {name for name, check in response.json()["checks"].items() if not check["ok"]}


async def test_healthz_answers_without_touching_dependencies(settings: Settings) -> None:
    dead = settings.model_copy(
        update={
            "amqp_url": f"amqp://guest:guest@127.0.0.1:{closed_port()}/",
            "management_url": f"http://127.0.0.1:{closed_port()}",
        }
    )
    async with serving(dead) as (http, _state):
        response = await http.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_ready_when_database_broker_and_management_answer(
    settings: Settings, clean_state: None
) -> None:
    async with serving(settings) as (http, _state):
        response = await http.get("/readyz")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ready"
    assert set(body["checks"]) == {"database", "amqp", "management"}
    assert all(check["ok"] for check in body["checks"].values())


async def test_closed_ports_make_readiness_503_naming_amqp_and_management(
    settings: Settings,
) -> None:
    dead = settings.model_copy(
        update={
            "amqp_url": f"amqp://guest:secret-amqp-pw@127.0.0.1:{closed_port()}/",
            "management_url": f"http://127.0.0.1:{closed_port()}",
        }
    )
    async with serving(dead) as (http, _state):
        response = await http.get("/readyz")
    assert response.status_code == 503
    assert response.headers["Retry-After"] == str(settings.retry_after_seconds)
    assert _down(response) == {"amqp", "management"}
    assert "amqp" in response.json()["detail"]
    assert "management" in response.json()["detail"]
    assert "secret-amqp-pw" not in response.text


async def test_readiness_follows_a_broker_outage_and_its_end(settings: Settings) -> None:
    with tcp_proxy() as amqp, tcp_proxy(BROKER.host, BROKER.management_port) as management:
        proxied = settings.model_copy(
            update={
                "amqp_url": amqp.amqp_url(),
                "management_url": f"http://127.0.0.1:{management.port}",
            }
        )
        async with serving(proxied) as (http, _state):
            assert (await http.get("/readyz")).status_code == 200

            with capture_logs() as logs:
                amqp.stop()
                for _ in range(2):
                    response = await http.get("/readyz")
                    assert response.status_code == 503
                    assert _down(response) == {"amqp"}
                    assert response.json()["detail"] == "Not ready: amqp down."

                amqp.start()
                assert (await http.get("/readyz")).status_code == 200

                management.stop()
                response = await http.get("/readyz")
                assert response.status_code == 503
                assert _down(response) == {"management"}

                management.start()
                response = await http.get("/readyz")
                assert response.status_code == 200, response.text

    # One line per change, not one per probe.
    changes = [
        (entry["event"], entry.get("down") or entry.get("was_down"))
        for entry in logs
        if entry["event"] in ("not_ready", "ready_again")
    ]
    assert changes == [
        ("not_ready", ["amqp"]),
        ("ready_again", ["amqp"]),
        ("not_ready", ["management"]),
        ("ready_again", ["management"]),
    ]


async def test_database_outage_is_reported(settings: Settings) -> None:
    url = urlsplit(settings.database_url)
    with tcp_proxy(url.hostname or "127.0.0.1", url.port or 5432) as database:
        proxied = settings.model_copy(
            update={
                "database_url": settings.database_url.replace(
                    f"{url.hostname}:{url.port or 5432}", f"127.0.0.1:{database.port}"
                )
            }
        )
        async with serving(proxied) as (http, _state):
            assert (await http.get("/readyz")).status_code == 200
            database.stop()
            # The database alone is down; a broker probe of a loaded machine may miss once
            # (its kept connection found closed: the next probe connects again).
            for _ in range(3):
                response = await http.get("/readyz")
                assert response.status_code == 503
                if _down(response) == {"database"}:
                    break
            assert _down(response) == {"database"}, response.json()
            database.start()
            # Ready again once the database is: a pooled connection the outage cut fails
            # its first statement and is dropped (db.create_engine), so a probe may still
            # meet one; a loaded machine may need a moment more.
            for _ in range(20):
                response = await http.get("/readyz")
                if response.status_code == 200:
                    break
                await asyncio.sleep(0.5)
            assert response.status_code == 200, response.json()


async def test_management_5xx_is_not_ready(settings: Settings) -> None:
    async with serving(settings) as (http, _state):
        with respx.mock(assert_all_called=False) as mock:
            overview = mock.get(url__startswith=f"{settings.management_url}/api/overview")
            overview.respond(503, json={"error": "not_ready", "reason": "node is booting"})
            mock.route().pass_through()
            response = await http.get("/readyz")
    assert overview.called
    assert response.status_code == 503
    assert _down(response) == {"management"}
    assert "node is booting" in response.json()["checks"]["management"]["error"]


async def test_management_that_hangs_is_not_ready_within_the_timeout(settings: Settings) -> None:
    # Long enough that the database and the broker, which are up, answer within it on a
    # loaded machine; far shorter than the hang.
    quick = settings.model_copy(update={"readiness_timeout": 2.0})

    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200, json={})

    async with serving(quick) as (http, _state):
        with respx.mock(assert_all_called=False) as mock:
            mock.get(url__startswith=f"{settings.management_url}/api/overview").mock(
                side_effect=hang
            )
            mock.route().pass_through()
            started = time.perf_counter()
            response = await http.get("/readyz")
            elapsed = time.perf_counter() - started
    assert response.status_code == 503
    assert _down(response) == {"management"}
    assert response.json()["checks"]["management"]["error"] == "no answer within 2 s"
    assert elapsed < 6


async def test_readiness_names_each_node_and_stays_ready_while_one_answers(
    settings: Settings,
) -> None:
    dead_amqp, dead_management = closed_port(), closed_port()
    with tcp_proxy() as amqp:
        clustered = settings.model_copy(
            update={
                "amqp_url": f"amqp://guest:guest@127.0.0.1:{dead_amqp}/,{amqp.amqp_url()}",
                "management_url": f"http://127.0.0.1:{dead_management},{settings.management_url}",
            }
        )
        async with serving(clustered) as (http, _state):
            with capture_logs() as logs:
                for _ in range(2):
                    response = await http.get("/readyz")
                    assert response.status_code == 200, response.text
                body = response.json()
                assert body["detail"] == (
                    f"Ready; not answering: amqp 127.0.0.1:{dead_amqp}, "
                    f"management 127.0.0.1:{dead_management}."
                )
                amqp_nodes = body["checks"]["amqp"]["nodes"]
                assert {label: node["ok"] for label, node in amqp_nodes.items()} == {
                    f"127.0.0.1:{dead_amqp}": False,
                    f"127.0.0.1:{amqp.port}": True,
                }
                # ECONNREFUSED: asyncio words it "Connect call failed", uvloop (serve's loop)
                # "Connection refused".
                assert (
                    f"[Errno {errno.ECONNREFUSED}]" in amqp_nodes[f"127.0.0.1:{dead_amqp}"]["error"]
                )
                management_nodes = body["checks"]["management"]["nodes"]
                assert management_nodes[f"127.0.0.1:{dead_management}"]["ok"] is False
                assert management_nodes[f"{BROKER.host}:{BROKER.management_port}"]["ok"] is True

                # The last node goes too: not ready, and the error names every node.
                amqp.stop()
                response = await http.get("/readyz")
                assert response.status_code == 503
                assert _down(response) == {"amqp"}
                error = response.json()["checks"]["amqp"]["error"]
                assert f"127.0.0.1:{dead_amqp}" in error
                assert f"127.0.0.1:{amqp.port}" in error
                amqp.start()
                assert (await http.get("/readyz")).status_code == 200

    changes = ("broker_nodes_not_answering", "not_ready")
    events = [(entry["event"], entry.get("nodes") or entry.get("down")) for entry in logs]
    assert [event for event in events if event[0] in changes] == [
        (
            "broker_nodes_not_answering",
            [f"amqp 127.0.0.1:{dead_amqp}", f"management 127.0.0.1:{dead_management}"],
        ),
        ("not_ready", ["amqp"]),
    ]


async def test_readiness_reuses_one_broker_connection_and_reconnects_after_a_cut(
    settings: Settings,
) -> None:
    with tcp_proxy() as amqp:
        # The presence listener's own connection (contract §11) is not the probes' business.
        proxied = settings.model_copy(
            update={"amqp_url": amqp.amqp_url(), "presence_events_enabled": False}
        )
        async with serving(proxied) as (http, _state):
            for _ in range(5):
                assert (await http.get("/readyz")).status_code == 200
            # Five probes, one AMQP connection: the publisher's, kept open between probes.
            assert amqp.accepted == 1

            amqp.sever()  # the broker drops the connection; the port still answers
            response = await http.get("/readyz")
            if response.status_code == 503:  # the cut may be noticed by this probe...
                response = await http.get("/readyz")
            assert response.status_code == 200  # ...and the next one reconnects
            assert amqp.accepted == 2
