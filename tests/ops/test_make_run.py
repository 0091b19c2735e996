"""`make run` by itself: it makes sure the local RabbitMQ is up with its plugins
(scripts/ensure-services.sh rabbitmq), migrates the embedded PostgreSQL default and serves on
it, and its stop stops that server too."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

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
async def test_make_run_serves_with_its_services_up(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        unavailable("make is not installed")
    port = free_port()
    instance = f"qkr-{uuid.uuid4().hex[:10]}"
    data_dir = tmp_path / "pg"
    env = {
        **{k: v for k, v in os.environ.items() if k != "QUEUEKEEPER_DATABASE_URL"},
        "QUEUEKEEPER_EMBEDDED_DATA_DIR": str(data_dir),
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
        # make exits at the signal at once; `serve`, signalled with it, stops the server as
        # it exits, a moment later (a fast shutdown takes a second or two).
        pid_file = data_dir / "data" / "postmaster.pid"
        deadline = time.monotonic() + 20
        while pid_file.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        left_running = pid_file.exists()
        if left_running:  # the server `make run` started (in its own session): by its pid
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGQUIT)
        await _remove_broker_objects(Settings(instance_name=instance))
    text = output.read_text()
    assert "ensure-services: up: RabbitMQ (management, STOMP, web-STOMP, event exchange)" in text
    assert (data_dir / "data" / "PG_VERSION").exists()
    assert not left_running, "the embedded server outlived `make run`"
