"""The job commands of the `queuekeeper` CLI, run as an operator would: a separate process
(each once; the same commands again through the CLI's app in this process)."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from queuekeeper.cli import app
from queuekeeper.config import Settings, get_settings
from tests.helpers import Backend
from tests.reconcile.test_reconcile import SPEC_ARGUMENTS, registered_queue

CLI = str(Path(sys.executable).parent / "queuekeeper")


async def queuekeeper(settings: Settings, *args: str, **env: str) -> tuple[int, str, str]:
    """The command as an operator runs it: a process of its own."""
    environment = {
        **os.environ,
        "QUEUEKEEPER_DATABASE_URL": settings.database_url,
        "QUEUEKEEPER_INSTANCE_NAME": settings.instance_name,
        **env,
    }
    process = await asyncio.create_subprocess_exec(
        CLI,
        *args,
        env=environment,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def in_this_process(settings: Settings, *args: str, **env: str) -> tuple[int, str, str]:
    """The same command through the CLI's app in this process (in a thread: the command runs
    its own event loop): a process start costs ~1.4 s of CPU, importing the app. `reconcile`,
    `queues` and `cleanup-stale` run as processes too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUEUEKEEPER_DATABASE_URL", settings.database_url)
        patch.setenv("QUEUEKEEPER_INSTANCE_NAME", settings.instance_name)
        for name, value in env.items():
            patch.setenv(name, value)
        get_settings.cache_clear()
        try:
            result = await asyncio.to_thread(
                CliRunner().invoke, app, list(args), catch_exceptions=False
            )
        finally:
            get_settings.cache_clear()
    return result.exit_code, result.stdout, result.stderr


async def test_reconcile_dry_run_then_for_real(
    backend: Backend, management: ManagementClient, settings: Settings
) -> None:
    agent, subscription, _ = await registered_queue(backend)
    orphan = topology.queue_name(uuid.UUID(subscription["uuid"]), uuid.uuid4(), "order")
    await management.put_queue(agent.vhost, orphan, arguments=SPEC_ARGUMENTS)

    code, out, _ = await queuekeeper(settings, "reconcile", "--dry-run")
    assert code == 0, out
    assert "reconcile (dry run, trigger cli): succeeded" in out
    assert f"would delete_queue {agent.vhost}/{orphan}" in out
    assert await management.get_queue(agent.vhost, orphan) is not None

    code, out, _ = await in_this_process(settings, "reconcile")
    assert code == 0, out
    assert "orphans_deleted=1" in out
    assert await management.get_queue(agent.vhost, orphan) is None


async def test_queues_prints_a_table(
    backend: Backend, management: ManagementClient, settings: Settings
) -> None:
    agent, _, queue = await registered_queue(backend)
    code, out, _ = await queuekeeper(settings, "queues")
    assert code == 0, out
    assert queue["queue_name"] in out
    assert agent.vhost in out
    assert "queues: 1" in out
    await management.delete_queue(agent.vhost, queue["queue_name"])
    code, out, _ = await in_this_process(settings, "queues", "--state", "missing")
    assert code == 0, out
    assert "missing" in out
    assert queue["queue_name"] in out


async def test_other_job_commands_run(backend: Backend, settings: Settings) -> None:
    await registered_queue(backend)
    code, out, _ = await queuekeeper(settings, "cleanup-stale")
    assert code == 0, out
    assert "cleanup_stale (trigger cli): succeeded" in out
    code, out, _ = await in_this_process(settings, "redrive-dead-letters")
    assert code == 0, out
    assert "found: dead_letters" not in out  # empty dead-letter queues: nothing found
    assert "redrive_dead_letters (trigger cli): succeeded" in out


async def test_unreachable_broker_exits_non_zero(backend: Backend, settings: Settings) -> None:
    await registered_queue(backend)
    code, out, err = await in_this_process(
        settings, "reconcile", QUEUEKEEPER_MANAGEMENT_URL="http://127.0.0.1:9"
    )
    assert code == 1, out
    assert "failed" in out
    assert "unreachable" in err
