"""Ownership is exact: two installations sharing one broker under the same instance name,
a database restored from an older backup, and objects made before installation identities.

Real apps on real databases (a second PostgreSQL database per test) and the real broker."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from queuekeeper.app import Runtime, create_app
from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from tests.conftest import PG_ADMIN_DSN, SERVICE_TOKEN, _migrate, pg_admin
from tests.helpers import Agent, Backend, Operator

Serve = Callable[[Settings], AbstractAsyncContextManager[tuple[httpx.AsyncClient, Runtime]]]


@asynccontextmanager
async def serve(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, Runtime]]:
    """One queuekeeper on these settings; its state, to wait for the start-up survey."""
    application = create_app(settings)
    async with LifespanManager(application, startup_timeout=30, shutdown_timeout=30) as manager:
        transport = httpx.ASGITransport(app=manager.app, client=("10.1.2.3", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            yield http, application.state.queuekeeper


class Databases:
    """Extra databases for a test: empty and migrated, or restored from a backup."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.names: list[str] = []

    def _pg(self, name: str) -> str:
        return f"{PG_ADMIN_DSN.rsplit('/', 1)[0]}/{name}"

    async def new(self) -> str:
        name = f"qk_test_{uuid.uuid4().hex[:12]}"
        await pg_admin(f'CREATE DATABASE "{name}"')
        self.names.append(name)
        url = self._pg(name).replace("postgresql://", "postgresql+asyncpg://")
        await asyncio.to_thread(_migrate, url)
        return url

    async def backup(self, url: str) -> Path:
        """What an operator's nightly backup does: pg_dump."""
        target = self.tmp_path / f"backup-{uuid.uuid4().hex[:8]}"
        dsn = self._pg(url.rsplit("/", 1)[1])
        await asyncio.to_thread(
            subprocess.run, ["pg_dump", "-Fc", "-f", str(target), dsn], check=True
        )
        return target

    async def restore(self, backup: Path) -> str:
        """Into a new database, as a restore onto a fresh server would."""
        name = f"qk_test_{uuid.uuid4().hex[:12]}"
        await pg_admin(f'CREATE DATABASE "{name}"')
        self.names.append(name)
        await asyncio.to_thread(
            subprocess.run,
            ["pg_restore", "--no-owner", "-d", self._pg(name), str(backup)],
            check=True,
        )
        return self._pg(name).replace("postgresql://", "postgresql+asyncpg://")

    async def drop(self) -> None:
        for name in self.names:
            await pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def databases(tmp_path: Path, clean_state: None) -> AsyncIterator[Databases]:
    found = Databases(tmp_path)
    yield found
    await found.drop()


async def registered(client: httpx.AsyncClient) -> tuple[Agent, str]:
    """A user of this installation with a subscription and one queue; (agent, queue name)."""
    agent, offering = await Backend(client, SERVICE_TOKEN).agent_with_offering()
    subscription = await agent.create_subscription()
    response = await agent.create_queue(subscription["uuid"], offering)
    assert response.status_code == 201, response.text
    return agent, response.json()["queue_name"]


async def queue_names(management: ManagementClient, vhost: str) -> set[str]:
    page = await management.list_queues_page(vhost, page=1, page_size=500, columns="name")
    return {queue.name for queue in page.items}


def failures_of(run: dict[str, Any]) -> dict[str, str]:
    return {failure["item"]: failure["reason"] for failure in run["failures"]}


async def readiness_after_survey(client: httpx.AsyncClient, state: Runtime) -> str:
    assert state.survey_task is not None
    await state.survey_task
    response = await client.get("/readyz")
    assert response.status_code == 200, response.text
    detail: str = response.json()["detail"]
    return detail


async def test_two_installations_with_one_name_never_delete_each_others_objects(
    settings: Settings, databases: Databases, management: ManagementClient
) -> None:
    """The issue's trap: a second installation with its own database and the same instance
    name. Before installation identities the first one's reconcile deleted the second's
    vhost ("no subscriptions left")."""
    other = settings.model_copy(update={"database_url": await databases.new()})
    async with serve(settings) as (first, first_state), serve(other) as (second, second_state):
        mine, my_queue = await registered(first)
        theirs, their_queue = await registered(second)
        assert first_state.provisioner.installation != second_state.provisioner.installation

        for client, foreign in ((first, theirs), (second, mine)):
            operator = Operator(client, SERVICE_TOKEN)
            planned = await operator.reconcile(dry_run=True)
            assert not [a for a in planned["actions"] if a["item"].startswith(foreign.vhost)]
            assert "another queuekeeper" in failures_of(planned)[foreign.vhost]
            done = await operator.reconcile()
            assert done["changed"] == {}, done
            assert done["found"]["vhosts_other_installation"] == 1
            stale = await operator.cleanup_stale()
            assert stale["changed"] == {}, stale

        # Both installations' objects are all still there.
        assert await queue_names(management, mine.vhost) >= {my_queue}
        assert await queue_names(management, theirs.vhost) >= {their_queue}

        # A registration in the other installation's vhost is refused, not merged into it.
        intruder = await Backend(second, SERVICE_TOKEN).put_user(mine.uuid)
        response = await second.post("/api/event-subscriptions/", json={}, headers=intruder.headers)
        assert response.status_code == 409, response.text
        assert "another queuekeeper" in response.json()["detail"]

    # A start of the first installation now warns, and says so in /readyz (still ready).
    async with serve(settings) as (client, state):
        detail = await readiness_after_survey(client, state)
        assert detail.startswith("Ready.")
        assert "1 vhosts of another installation" in detail
        assert "1 broker users of another installation" in detail
        assert "reconcile --dry-run" in detail


async def test_restored_older_backup_holds_deletions_until_forced(
    settings: Settings, databases: Databases, management: ManagementClient
) -> None:
    """Everything registered since the backup looks orphaned to the restored database: the
    start-up survey says so, and reconcile deletes nothing until told to."""
    live = settings.model_copy(update={"database_url": await databases.new()})
    async with serve(live) as (client, _state):
        early, early_queue = await registered(client)
        backup = await databases.backup(live.database_url)
        late, late_queue = await registered(client)  # after the backup

    restored = settings.model_copy(update={"database_url": await databases.restore(backup)})
    async with serve(restored) as (client, state):
        detail = await readiness_after_survey(client, state)
        assert "1 vhosts without a user here" in detail
        assert "1 broker users without a subscription here" in detail
        operator = Operator(client, SERVICE_TOKEN)

        planned = await operator.reconcile(dry_run=True)
        assert {"action": "delete_vhost", "item": late.vhost} in [
            {"action": a["action"], "item": a["item"]} for a in planned["actions"]
        ]
        assert failures_of(planned)["deletion guard"].startswith("a real run would stop")

        held = await operator.reconcile()
        assert held["status"] == "partial"
        assert held["changed"] == {}
        assert "nothing was deleted" in failures_of(held)["deletion guard"]
        assert await queue_names(management, late.vhost) >= {late_queue}
        assert await queue_names(management, early.vhost) >= {early_queue}

        forced = await operator.reconcile(force=True)
        assert forced["changed"]["vhosts_deleted"] == 1, forced
        assert await management.get_vhost(late.vhost) is None
        assert await queue_names(management, early.vhost) >= {early_queue}


async def test_objects_made_before_identities_are_adopted_only_with_rows(
    settings: Settings, client: httpx.AsyncClient, management: ManagementClient, app: Any
) -> None:
    """The upgrade path: objects tagged with the instance name alone. Those this database
    has rows for become ours; the others are reported and never deleted, even forced."""
    state: Runtime = app.state.queuekeeper
    agent, queue = await registered(client)
    legacy = [settings.instance_tag]
    vhost_info = await management.get_vhost(agent.vhost)
    assert vhost_info is not None
    user_name = next(
        user.name
        for user in await management.list_users()
        if user.name != agent.vhost
        and topology.installations_of(user.tags)
        and settings.instance_tag in user.tags
    )
    user = await management.get_user(user_name)
    assert user is not None
    # As the previous version made them: the instance tag only.
    await management.put_vhost(agent.vhost, description="old", tags=legacy)
    await management.put_user(user_name, password_hash=user.password_hash, tags=legacy)
    stray = uuid.uuid4().hex
    await management.put_vhost(stray, description="old", tags=legacy)

    # The first start of the new release adopts the vhost (the upgrade path) ...
    ours = topology.installation_tag(await state.provisioner.identify())
    async with serve(settings) as (_client, restarted):
        assert restarted.survey_task is not None
        await restarted.survey_task
    adopted_at_start = await management.get_vhost(agent.vhost)
    assert adopted_at_start is not None
    assert ours in adopted_at_start.tags
    stray_info = await management.get_vhost(stray)
    assert stray_info is not None
    assert ours not in stray_info.tags
    # ... and reconcile adopts the broker user (whose password it checks), the vhost again
    # when it is still unclaimed.
    await management.put_vhost(agent.vhost, description="old", tags=legacy)
    run = await Operator(client, SERVICE_TOKEN).reconcile(force=True)
    assert run["changed"]["vhosts_adopted"] == 1, run
    assert run["changed"]["users_restored"] == 1, run
    assert "without an installation identity" in failures_of(run)[stray]
    adopted_vhost = await management.get_vhost(agent.vhost)
    adopted_user = await management.get_user(user_name)
    assert adopted_vhost is not None
    assert ours in adopted_vhost.tags
    assert adopted_user is not None
    assert ours in adopted_user.tags
    assert await queue_names(management, agent.vhost) >= {queue}
    assert await management.get_vhost(stray) is not None
