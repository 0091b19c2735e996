"""`queuekeeper serve --workers 2`: whichever worker answers a scrape reports the totals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from queuekeeper.cli import app as cli_app
from queuekeeper.common.processes import MULTIPROC_ENV
from queuekeeper.config import Settings
from tests.proxy import closed_port

QUEUEKEEPER = str(Path(sys.executable).parent / "queuekeeper")


@pytest.fixture
def two_workers(settings: Settings, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    port = closed_port()
    env = {key: value for key, value in os.environ.items() if key != MULTIPROC_ENV}
    env.update(
        {
            "QUEUEKEEPER_DATABASE_URL": settings.database_url,
            "QUEUEKEEPER_INSTANCE_NAME": settings.instance_name,
            "QUEUEKEEPER_LOG_FORMAT": "json",
        }
    )
    log = tmp_path / "serve.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [QUEUEKEEPER, "serve", "--workers", "2", "--port", str(port)],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while log.read_text().count('"queuekeeper_started"') < 2:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield base, log
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _count(text: str, route: str, status: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "queuekeeper_http_requests_total"
                and sample.labels.get("route") == route
                and sample.labels.get("status") == status
            ):
                return sample.value
    return 0.0


def test_metrics_total_over_workers(two_workers: tuple[str, Path]) -> None:
    base, log = two_workers
    requests = 24
    for _ in range(requests):
        # A new connection each time, so the kernel spreads them over both workers.
        response = httpx.get(f"{base}/api/users/me/", headers={"Connection": "close"})
        assert response.status_code == 401
    pids = {
        line.split('"pid": ')[1].split(",")[0].rstrip("}")
        for line in log.read_text().splitlines()
        if '"queuekeeper_started"' in line
    }
    assert len(pids) == 2
    for _ in range(6):
        scrape = httpx.get(f"{base}/metrics", headers={"Connection": "close"})
        assert scrape.status_code == 200
        assert _count(scrape.text, "/api/users/me/", "401") == requests

    # The container's HEALTHCHECK command, against the real server.
    result = CliRunner().invoke(cli_app, ["healthcheck", "--url", base])
    assert result.exit_code == 0, result.output
    assert "/healthz: 200" in result.output
