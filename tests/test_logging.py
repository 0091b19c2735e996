"""Logs: one format for every library, a request id on every line of a request, no secrets."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import secrets
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import structlog
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from sqlalchemy import select

from queuekeeper.config import Settings
from queuekeeper.db import create_engine, create_sessionmaker
from queuekeeper.logging import configure_logging
from queuekeeper.models import User
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Backend

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


class LogCapture:
    def __init__(self) -> None:
        self.stream = io.StringIO()

    def clear(self) -> None:
        self.stream.seek(0)
        self.stream.truncate()

    @property
    def text(self) -> str:
        return self.stream.getvalue()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.text.splitlines() if line.strip()]


@pytest.fixture
def logs(settings: Settings) -> LogCapture:
    capture = LogCapture()
    configure_logging(settings, level="DEBUG", log_format="json", stream=capture.stream)
    return capture


# The relay's housekeeping logs its own statements (no request) every few seconds: off here.
# So is the presence listener: it starts beside the app and hears every consumer arriving or
# leaving on the shared broker, whichever test made it, so its lines (aio_pika's and aiormq's,
# not all naming its connection) fall inside the request at any moment.
@pytest.mark.settings(relay_enabled=False, scheduler_enabled=False, presence_events_enabled=False)
async def test_request_id_is_returned_and_on_every_line_of_the_request(
    logs: LogCapture, client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, _offering = await backend.agent_with_offering()
    logs.clear()
    response = await client.post(
        "/api/event-subscriptions/",
        json={"description": "traced"},
        headers={**agent.headers, "X-Request-ID": "req-7f3a.agent-A"},
    )
    assert response.status_code == 201
    assert response.headers["X-Request-ID"] == "req-7f3a.agent-A"
    # The test's own HTTP client logs too (httpx, "http://testserver/…"): not the server's.
    lines = [line for line in logs.lines() if "http://testserver/" not in line["event"]]
    events = {line["event"] for line in lines}
    # The endpoint's own line, the access line, and the libraries' lines (httpx calls to
    # the Management API) all belong to this request.
    assert {"subscription_created", "http_request"} <= events
    assert {line["logger"] for line in lines} > {"queuekeeper.http"}
    assert [line for line in lines if line.get("request_id") != "req-7f3a.agent-A"] == []


async def test_request_id_is_generated_when_missing_or_unusable(
    logs: LogCapture, client: httpx.AsyncClient
) -> None:
    plain = await client.get("/api/users/me/")
    generated = plain.headers["X-Request-ID"]
    assert len(generated) == 32
    assert int(generated, 16) >= 0
    for unusable in ("has spaces in it", "x" * 200, "<script>"):
        response = await client.get("/api/users/me/", headers={"X-Request-ID": unusable})
        assert response.headers["X-Request-ID"] != unusable
        assert len(response.headers["X-Request-ID"]) == 32
    assert generated in logs.text
    assert (await client.get("/api/users/me/")).headers["X-Request-ID"] != generated


async def test_no_token_password_or_hash_reaches_the_logs(
    logs: LogCapture, client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    first_token, second_token = secrets.token_hex(20), secrets.token_urlsafe(24)
    user_uuid = uuid.uuid4()
    agent = await backend.put_user(user_uuid, token=first_token)
    offering = await backend.put_offering()
    await backend.grant(agent, offering)
    subscription = await agent.create_subscription(description="secrets")
    assert (await agent.create_queue(subscription["uuid"], offering)).status_code == 201
    # A token change is pushed to the subscription's broker user (a password_hash PUT).
    changed = await backend.put_user(user_uuid, token=second_token)
    assert (await client.get("/api/users/me/", headers=changed.headers)).status_code == 200
    # Refused credentials are logged as refusals, not with the credentials.
    await client.get("/api/users/me/", headers={"Authorization": f"Token {first_token}"})
    await client.get("/api/internal/users/x/", headers={"Authorization": f"Bearer {first_token}"})

    # What code (ours or a library's) might log about connections and callers.
    amqp_password = "Amqp-Passw0rd-" + secrets.token_hex(4)
    log = structlog.get_logger("queuekeeper.test")
    log.info(
        "connecting",
        url=f"amqp://queuekeeper:{amqp_password}@rabbit:5672/",
        token=first_token,
        headers={"Authorization": f"Token {first_token}", "Accept": "*/*"},
        passcode=second_token,
    )
    logging.getLogger("aio_pika").warning(
        "Connection to amqp://queuekeeper:%s@rabbit:5672/ failed", amqp_password
    )
    logging.getLogger("uvicorn.error").info('"Authorization: Bearer %s"', SERVICE_TOKEN)
    try:
        raise ConnectionError(f"login refused: amqp://queuekeeper:{amqp_password}@rabbit/")
    except ConnectionError:
        log.exception("broker_login_failed")

    engine = create_engine(settings)
    async with create_sessionmaker(engine)() as session:
        broker_hash = await session.scalar(
            select(User.broker_password_hash).where(User.uuid == user_uuid)
        )
    await engine.dispose()
    assert broker_hash

    output = logs.text
    assert "subscription_created" in output
    assert "broker_passwords_updated" in output
    assert "broker_login_failed" in output
    assert "Traceback" in output
    for secret in (first_token, second_token, SERVICE_TOKEN, amqp_password, broker_hash):
        assert secret not in output
    assert output.count("***") >= 6


def test_library_logs_come_out_in_the_same_format(settings: Settings) -> None:
    stream = io.StringIO()
    configure_logging(settings, level="INFO", log_format="json", stream=stream)
    for name in ("uvicorn.error", "uvicorn.access", "sqlalchemy.engine", "aio_pika", "apscheduler"):
        logging.getLogger(name).warning("hello from %s", name)
    structlog.get_logger("queuekeeper.test").warning("hello", source="structlog")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["logger"] for line in lines] == [
        "uvicorn.error",
        "uvicorn.access",
        "sqlalchemy.engine",
        "aio_pika",
        "apscheduler",
        "queuekeeper.test",
    ]
    for line in lines:
        assert line["level"] == "warning"
        assert line["timestamp"].endswith("Z")
    assert lines[0]["event"] == "hello from uvicorn.error"


def test_console_format_is_readable_not_json(settings: Settings) -> None:
    stream = io.StringIO()
    configure_logging(settings, level="INFO", log_format="console", stream=stream)
    structlog.get_logger("queuekeeper.test").info("queue_registered", queue="q1")
    text = stream.getvalue()
    assert "queue_registered" in text
    assert "queue=q1" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_duplicate_and_chatty_library_lines_stay_out_at_info(settings: Settings) -> None:
    stream = io.StringIO()
    configure_logging(settings, level="INFO", log_format="json", stream=stream)
    # uvicorn's access line duplicates queuekeeper's http_request line (which has the id).
    logging.getLogger("uvicorn.access").info('127.0.0.1 - "GET / HTTP/1.1" 200')
    logging.getLogger("sqlalchemy.orm.mapper.Mapper").info("(User|users) initialize prop uuid")
    logging.getLogger("sqlalchemy.engine.Engine").info("SELECT users.uuid FROM users")
    logging.getLogger("httpx").info("HTTP Request: GET http://127.0.0.1:15672/api/overview")
    logging.getLogger("uvicorn.error").info("Uvicorn running", extra={"color_message": "\x1b[1m"})
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines == [
        {
            "event": "Uvicorn running",
            "level": "info",
            "logger": "uvicorn.error",
            "timestamp": lines[0]["timestamp"],
        }
    ]


async def _accept_lines(
    settings: Settings, client: httpx.AsyncClient, backend: Backend, level: str
) -> list[dict[str, Any]]:
    """The access lines of a stored event, a recognised repeat and a refused event."""
    capture = LogCapture()
    configure_logging(settings, level=level, log_format="json", stream=capture.stream)
    offering = await backend.put_offering()
    event = {"offering_uuid": offering.hex, "object_type": "order", "event_id": f"logged-{level}"}
    event["payload"] = {"order_uuid": offering.hex}
    bad = {**event, "event_id": f"refused-{level}", "offering_uuid": "0" * 32}
    for body, status in ((event, 202), (event, 200), (bad, 400)):
        response = await client.post("/api/internal/events/", json=body, headers=SERVICE)
        assert response.status_code == status, response.text
    lines = capture.lines()
    return [
        x
        for x in lines
        if x.get("path") == "/api/internal/events/" and x["event"] == "http_request"
    ]


@pytest.mark.settings(relay_enabled=False, scheduler_enabled=False)
async def test_accepted_events_are_not_an_info_line_each_unless_asked_for(
    settings: Settings, client: httpx.AsyncClient, backend: Backend
) -> None:
    """A backend's single events cost no access line each at INFO: their answers are logged
    at DEBUG; a refusal is logged at INFO as every other request."""
    lines = await _accept_lines(settings, client, backend, "INFO")
    assert [(line["level"], line["status"]) for line in lines] == [("info", 400)]
    lines = await _accept_lines(settings, client, backend, "DEBUG")
    assert [(line["level"], line["status"]) for line in lines] == [
        ("debug", 202),
        ("debug", 200),
        ("info", 400),
    ]


@pytest.mark.settings(relay_enabled=False, scheduler_enabled=False, log_accepted_events=True)
async def test_accepted_events_are_an_info_line_each_when_asked_for(
    settings: Settings, client: httpx.AsyncClient, backend: Backend
) -> None:
    lines = await _accept_lines(settings, client, backend, "INFO")
    assert [(line["level"], line["status"]) for line in lines] == [
        ("info", 202),
        ("info", 200),
        ("info", 400),
    ]


async def test_the_scheduler_runs_its_jobs_without_a_line_each_at_info(
    settings: Settings,
) -> None:
    """APScheduler logs two INFO lines a run ("Running job", "executed successfully"): with
    a job every 10 s, some 17,000 lines a day on an idle service. Its failures still show."""
    stream = io.StringIO()
    configure_logging(settings, level="INFO", log_format="json", stream=stream)
    scheduler = AsyncIOScheduler(timezone=UTC)
    done = asyncio.Event()

    async def fine() -> None:
        done.set()

    async def broken() -> None:
        raise RuntimeError("this job broke")

    scheduler.add_job(fine, "date", run_date=datetime.now(UTC), id="fine")
    scheduler.add_job(broken, "date", run_date=datetime.now(UTC), id="broken")
    scheduler.start()
    try:
        await asyncio.wait_for(done.wait(), 10)
        await asyncio.sleep(0.2)  # the library logs after the job's coroutine returned
    finally:
        scheduler.shutdown(wait=False)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    scheduled = [line for line in lines if line["logger"].startswith("apscheduler")]
    assert [line["level"] for line in scheduled] == ["error"], scheduled
    assert "this job broke" in scheduled[0]["exception"]
