"""Shared fixtures: real PostgreSQL, real RabbitMQ.

Isolation: one database per test session, emptied before each test; one
instance name per test, so every vhost and broker user a test makes carries a
tag of its own and is removed when the test ends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import respx.mocks
import structlog
import uvloop
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from sqlalchemy import text

from queuekeeper.app import create_app
from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from queuekeeper.db import create_engine
from queuekeeper.logging import QueuekeeperHandler
from queuekeeper.models import Base
from tests.brokers import BROKER, BrokerAddresses
from tests.cpu_profile import DATABASES
from tests.helpers import Backend, Operator
from tests.respx_aiohttp import AiohttpTransportMocker

# `respx.mock` intercepts the Management API client's transport (tests/respx_aiohttp.py).
respx.mocks.DEFAULT_MOCKER = AiohttpTransportMocker.name


# Files of long tests and their rough length (seconds of a loaded 4-worker run).
LONG_FILES = {
    "tests/ops/test_fuzz.py": 60,
    "tests/agents/test_site_agent_away.py": 95,
    "tests/agents/test_agent_matrix.py": 70,
    "tests/agents/test_tls_deployment.py": 70,
    "tests/agents/test_api_clients.py": 70,
    "tests/agents/test_site_agent_107_e2e.py": 60,
    "tests/agents/test_site_agent_e2e.py": 50,
}


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With workers, each long file at the head of another worker's share. xdist's worksteal
    hands each of N workers a contiguous 1/N of the tests and an idle worker steals from the
    tail of another's, so the long files, all in tests/agents/ and so at the head of the
    first share, ran one after the other on one worker, and the fuzz run (halfway) started
    minutes in; the suite waited on that worker at the end. Files stay whole (their module
    fixtures are made once), and every test still runs once."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    long = {name: [i for i in items if i.nodeid.startswith(name + "::")] for name in LONG_FILES}
    if workers < 2 or not any(long.values()):
        return
    heads: list[list[pytest.Item]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for name, weight in sorted(LONG_FILES.items(), key=lambda pair: -pair[1]):
        if long[name]:
            share = loads.index(min(loads))  # the least loaded so far
            heads[share].extend(long[name])
            loads[share] += weight
    placed = {id(item) for head in heads for item in head}
    rest = [item for item in items if id(item) not in placed]
    ordered: list[pytest.Item] = []
    remaining = len(items)
    for share, head in enumerate(heads):
        size = remaining // (workers - share)  # as worksteal's first hand-out counts
        take = max(0, size - len(head))
        ordered.extend(head + rest[:take])
        rest = rest[take:]
        remaining -= len(head) + take
    items[:] = ordered + rest


def pytest_configure(config: pytest.Config) -> None:
    # structlog's own defaults, but a plain traceback: its default renderer draws an
    # exception with rich and every frame's locals, and a test of a database outage logged
    # one of 1,200 lines every few seconds (most of a core while the outage lasted). Every
    # level stays, for a failing test's captured output; `capture_logs` replaces these.
    *processors, _renderer = structlog.get_config()["processors"]
    plain = structlog.dev.ConsoleRenderer(
        colors=False, exception_formatter=structlog.dev.plain_traceback
    )
    structlog.configure(processors=[*processors, plain])
    # QK_CPU_PROFILE=<file>: each test's CPU and the brokers' (tests/cpu_profile.py).
    if os.environ.get("QK_CPU_PROFILE"):
        from tests.cpu_profile import CpuProfile

        config.pluginmanager.register(CpuProfile(os.environ["QK_CPU_PROFILE"]), "qk-cpu-profile")


PG_ADMIN_DSN = os.environ.get("QK_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
SERVICE_TOKEN = "service-token-primary-0123456789"
SERVICE_TOKEN_OLD = "service-token-rotated-9876543210"
ROOT = Path(__file__).resolve().parents[1]


def _migrate(url: str) -> None:
    from alembic import command
    from alembic.config import Config

    config = Config(str(ROOT / "alembic.ini"))
    config.attributes["database_url"] = url
    command.upgrade(config, "head")


async def pg_admin(sql: str) -> None:
    """One statement as PostgreSQL's superuser (CREATE/DROP DATABASE)."""
    import asyncpg

    connection = await asyncpg.connect(PG_ADMIN_DSN)
    try:
        await connection.execute(sql)
    finally:
        await connection.close()


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    name = f"qk_test_{uuid.uuid4().hex[:12]}"
    DATABASES.add(name)
    asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    base = PG_ADMIN_DSN.rsplit("/", 1)[0]
    url = f"{base.replace('postgresql://', 'postgresql+asyncpg://')}/{name}"
    _migrate(url)
    yield url
    asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def empty_database() -> Iterator[str]:
    """A PostgreSQL database of its own with no tables (what `queuekeeper migrate` starts
    from), as a user writes its URL; dropped afterwards."""
    name = f"qk_test_{uuid.uuid4().hex[:12]}"
    DATABASES.add(name)
    asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    yield f"{PG_ADMIN_DSN.rsplit('/', 1)[0]}/{name}"
    asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def pg_rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    """One query's rows on the database at `url` (a test outside an event loop)."""
    import asyncpg

    async def fetch() -> list[tuple[Any, ...]]:
        connection = await asyncpg.connect(url.replace("+asyncpg", ""))
        try:
            return [tuple(row) for row in await connection.fetch(sql)]
        finally:
            await connection.close()

    return asyncio.run(fetch())


@pytest.fixture
def broker() -> BrokerAddresses:
    """The RabbitMQ the suite runs against (tests/brokers.py)."""
    return BROKER


def _settings(database_url: str, request: pytest.FixtureRequest) -> Settings:
    marker = request.node.get_closest_marker("settings")
    fields: dict[str, Any] = {
        "amqp_url": BROKER.amqp_url(),
        "management_url": BROKER.management_url,
        "database_url": database_url,
        "instance_name": f"qkt-{uuid.uuid4().hex[:10]}",
        "service_tokens": [SERVICE_TOKEN, SERVICE_TOKEN_OLD],
        "public_url": "http://testserver",
        # Generous, as the tests assert what happens, not how fast: under `make test` (four
        # workers and an image build on two cores) a new PostgreSQL backend has taken over
        # 5 s to start (a test of concurrent registrations got the 503 of a connect
        # timeout), and a registration's broker calls took 5.5 s. The tests of an
        # unreachable dependency refuse connections, or set a short timeout of their own.
        "management_timeout": 15.0,
        "database_connect_timeout": 30.0,
        "retry_after_seconds": 7,
    }
    return Settings(**{**fields, **(marker.kwargs if marker else {})})


@pytest.fixture
def settings(database_url: str, request: pytest.FixtureRequest) -> Settings:
    """A test's settings; `@pytest.mark.settings(relay_enabled=False, ...)` on a test, a
    class or a module (`pytestmark`) changes fields, in any test package."""
    return _settings(database_url, request)


async def _empty_database(settings: Settings) -> None:
    engine = create_engine(settings)
    tables = [table.name for table in reversed(Base.metadata.sorted_tables)]
    # DELETE, children first, not TRUNCATE: a test leaves a few rows, and PostgreSQL's
    # TRUNCATE of every table costs ~0.1 s (new files for each) against ~1 ms.
    async with engine.begin() as connection:
        # Without the access triggers (migration 0016_access_changes): emptying the
        # directory is no revocation to sweep. The suite's user is PostgreSQL's superuser.
        await connection.execute(text("SET LOCAL session_replication_role = replica"))
        for table in tables:
            await connection.execute(text(f'DELETE FROM "{table}"'))
    await engine.dispose()


async def _remove_broker_objects(settings: Settings) -> None:
    """Everything named for the test's instance, whichever installation made it."""
    management = ManagementClient(settings)
    tag = settings.instance_tag
    try:
        for vhost in await management.list_vhosts():
            if tag in vhost.tags:
                await management.delete_vhost(vhost.name)
        for user in await management.list_users():
            if tag in user.tags:
                await management.delete_user(user.name)
    finally:
        await management.aclose()


@pytest.fixture
async def clean_state(settings: Settings) -> AsyncIterator[None]:
    await _empty_database(settings)
    yield
    await _remove_broker_objects(settings)


@pytest.fixture
async def app(settings: Settings, clean_state: None) -> AsyncIterator[FastAPI]:
    application = create_app(settings)
    async with LifespanManager(application, startup_timeout=30, shutdown_timeout=30):
        yield application


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def module_client(
    database_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[httpx.AsyncClient]:
    """One app, and one instance name, for all the tests of a module that asks for it, for
    tests that only send requests and read the answers, each with objects of its own (fresh
    UUIDs), so that no test depends on the database being emptied for it: starting and
    stopping an app costs ~0.25 s of CPU, most of a short test's. Such a module runs its
    tests in the module's event loop (`pytest.mark.asyncio(loop_scope="module")`) and
    overrides `client` with this one."""
    settings = _settings(database_url, request)
    await _empty_database(settings)
    application = create_app(settings)
    try:
        async with LifespanManager(application, startup_timeout=30, shutdown_timeout=30):
            transport = httpx.ASGITransport(app=application, client=("10.1.2.3", 40000))
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
                yield http
    finally:
        await _remove_broker_objects(settings)


@pytest.fixture
async def management(settings: Settings) -> AsyncIterator[ManagementClient]:
    """A Management API client for assertions about what the broker really holds."""
    client = ManagementClient(settings)
    yield client
    await client.aclose()


@pytest.fixture
def backend(client: httpx.AsyncClient) -> Backend:
    return Backend(client, SERVICE_TOKEN)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Code that configures logging (CLI commands, logging tests) writes to streams that
    close with the test: take its handler off again, and restore the root level."""
    root = logging.getLogger()
    level = root.level
    yield
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, QueuekeeperHandler)]
    root.setLevel(level)


@pytest.fixture
async def make_client(settings: Settings, clean_state: None) -> AsyncIterator[Any]:
    """Start another app on the same database with some settings changed (e.g. a dead broker)."""
    managers: list[LifespanManager] = []
    clients: list[httpx.AsyncClient] = []

    async def factory(**overrides: Any) -> httpx.AsyncClient:
        application = create_app(settings.model_copy(update=overrides))
        manager = LifespanManager(application, startup_timeout=30, shutdown_timeout=30)
        await manager.__aenter__()
        managers.append(manager)
        transport = httpx.ASGITransport(app=manager.app, client=("10.1.2.3", 40000))
        http = httpx.AsyncClient(transport=transport, base_url="http://testserver")
        clients.append(http)
        return http

    yield factory
    for http in clients:
        await http.aclose()
    for manager in reversed(managers):
        await manager.__aexit__(None, None, None)


@pytest.fixture
def operator(client: httpx.AsyncClient) -> Operator:
    return Operator(client, SERVICE_TOKEN)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """uvloop, as `serve` runs on (uvicorn's default when it is installed): the tests exercise
    the loop the service has, and its I/O costs a test less CPU than asyncio's own."""
    return {"uvloop": uvloop.new_event_loop}
