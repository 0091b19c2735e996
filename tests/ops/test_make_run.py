"""`make run` by itself: it makes sure the local RabbitMQ (with its plugins) and PostgreSQL
are up (scripts/ensure-services.sh rabbitmq), migrates the database and serves."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import asyncpg
import httpx
import pytest

from queuekeeper.config import Settings
from tests.conftest import _remove_broker_objects
from tests.ops.tools import unavailable

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.timeout(180)
async def test_make_run_serves_with_its_services_up(tmp_path: Path, empty_database: str) -> None:
    if shutil.which("make") is None:
        unavailable("make is not installed")
    port = free_port()
    instance = f"qkr-{uuid.uuid4().hex[:10]}"
    env = {
        **os.environ,
        "QUEUEKEEPER_DATABASE_URL": empty_database,
        "QUEUEKEEPER_PORT": str(port),
        "QUEUEKEEPER_INSTANCE_NAME": instance,
        "QUEUEKEEPER_SCHEDULER_ENABLED": "false",
        "QUEUEKEEPER_LOG_FORMAT": "json",
    }
    output = tmp_path / "make-run.log"
    with output.open("w") as log:
        process = subprocess.Popen(
            ["make", "--no-print-directory", "run"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        ready = None
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            while time.monotonic() < deadline and process.poll() is None:
                try:
                    response = await http.get("/readyz")
                    if response.status_code == 200:
                        ready = response
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.5)
            assert ready is not None, output.read_text()[-5000:]
            assert (await http.get("/docs")).status_code == 200
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        await _remove_broker_objects(Settings(instance_name=instance))
    text = output.read_text()
    up = "ensure-services: up: PostgreSQL RabbitMQ (management, STOMP, web-STOMP, event exchange)"
    assert up in text, text[-3000:]
    connection = await asyncpg.connect(empty_database)
    try:
        assert await connection.fetchval("SELECT version_num FROM alembic_version")
    finally:
        await connection.close()
