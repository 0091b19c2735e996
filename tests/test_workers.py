"""The options every `serve` process runs uvicorn with, and what its keep-alive must outlast
(docs/decisions/037-http-keep-alive.md)."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from queuekeeper import workers
from queuekeeper.config import Settings

NGINX_SITE = Path(__file__).parents[1] / "deploy" / "nginx" / "queuekeeper-beside-waldur.conf"


def test_idle_connections_outlast_the_agents_client_and_the_shipped_proxy() -> None:
    """A server that closes an idle connection first can close it as a client sends on it:
    that request fails (nginx answers a POST with a 502 and does not retry it)."""
    kept = Settings.model_fields["http_keep_alive_seconds"].default
    # Agents reach queuekeeper through waldur-api-client: an httpx client with its defaults.
    assert kept > (httpx.Limits().keepalive_expiry or 0) > 0
    upstream = re.search(r"upstream queuekeeper \{(.*?)\}", NGINX_SITE.read_text(), re.S)
    assert upstream is not None
    timeout = re.search(r"^\s*keepalive_timeout (\d+)s;", upstream.group(1), re.M)
    assert timeout is not None, "the shipped site states how long nginx keeps one idle"
    assert int(timeout.group(1)) < kept


def test_an_accept_worker_runs_uvicorn_with_serve_s_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`serve` in one process passes the same options to uvicorn.run: its keep-alive is
    shown on a running `serve` (tests/ops/test_process_model.py)."""
    settings = Settings(http_keep_alive_seconds=42)
    options = workers.server_options(settings)
    assert options["timeout_keep_alive"] == 42
    assert options["proxy_headers"] is False
    assert options["access_log"] is False

    made: list[dict[str, Any]] = []

    class Server:
        def __init__(self, config: uvicorn.Config) -> None:
            made.append(vars(config))

        def run(self, sockets: list[socket.socket]) -> None:
            assert len(sockets) == 1

    monkeypatch.setattr(workers, "get_settings", lambda: settings)
    monkeypatch.setattr(workers, "configure_logging", lambda settings: None)
    monkeypatch.setattr(workers, "freeze_startup_objects", lambda: None)
    monkeypatch.setattr(uvicorn, "Server", Server)
    with socket.socket() as listening:
        workers.accept_worker(os.dup(listening.fileno()), os.getppid())
    assert len(made) == 1
    assert {name: made[0][name] for name in options} == options
