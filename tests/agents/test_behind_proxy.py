"""queuekeeper beside Waldur behind one host name: deploy/nginx/queuekeeper-beside-waldur.conf,
as shipped (only its addresses made local and TLS left out), in front of queuekeeper and a
stand-in for Waldur's other endpoints; the published site agent 1.0.5 is given the proxy's
URL as its `waldur_api_url`, sets up through it, and receives an event over STOMP."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.agents.harness import Server, agent_config, publisher_for, start_agent, valid_payload
from tests.conftest import ROOT, SERVICE_TOKEN
from tests.helpers import Backend
from tests.ops.tools import require

SHIPPED = ROOT / "deploy" / "nginx" / "queuekeeper-beside-waldur.conf"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class StandInWaldur:
    """Answers every path 200 with who served it, and records what it was asked."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.paths.append(scope["path"])
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"served_by": "waldur"}'})


@asynccontextmanager
async def serving(app: StandInWaldur, port: int) -> AsyncIterator[None]:
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the stand-in did not start"
        await asyncio.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def site_config(queuekeeper: str, waldur: str, listen: int) -> str:
    """The shipped file with the lines marked SET made local, and no TLS."""
    text = SHIPPED.read_text()
    replacements = [
        (r"server 127\.0\.0\.1:8000;", f"server {queuekeeper};"),
        (r"server 127\.0\.0\.1:8080;", f"server {waldur};"),
        (r"listen 443 ssl http2;", f"listen 127.0.0.1:{listen};"),
        (r"\n\s*ssl_certificate[^\n]*", ""),
    ]
    for pattern, replacement in replacements:
        text, count = re.subn(pattern, replacement, text)
        assert count, f"{SHIPPED.name} no longer has {pattern!r}"
    return text


@contextmanager
def nginx(site: str, workdir: Path, port: int) -> Iterator[Path]:
    """nginx in the foreground with this site; yields its access log."""
    binary = require("nginx")
    workdir.mkdir()
    (workdir / "site.conf").write_text(site)
    access = workdir / "access.log"
    temp = "\n".join(f"    {kind}_temp_path {workdir / kind};" for kind in ("client_body", "proxy"))
    (workdir / "nginx.conf").write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"worker_processes 1;\npid {workdir / 'nginx.pid'};\n"
        f"error_log {workdir / 'error.log'} info;\nevents {{}}\nhttp {{\n"
        f"    access_log {access};\n{temp}\n    include {workdir / 'site.conf'};\n}}\n"
    )
    process = subprocess.Popen(
        [binary, "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-g", "daemon off;"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "nginx did not listen within 20 s"
            time.sleep(0.1)
        yield access
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.mark.timeout(600)
async def test_a_published_agent_sets_up_and_receives_through_the_shipped_proxy(
    server: Server, site_agent_python: Path, tmp_path: Path
) -> None:
    waldur = StandInWaldur()
    waldur_port, proxy_port = free_port(), free_port()
    site = site_config(server.url.removeprefix("http://"), f"127.0.0.1:{waldur_port}", proxy_port)
    proxy = f"http://127.0.0.1:{proxy_port}"
    async with (
        serving(waldur, waldur_port),
        httpx.AsyncClient(base_url=server.url, timeout=30) as direct,
        httpx.AsyncClient(base_url=proxy, timeout=30) as through_proxy,
    ):
        backend = Backend(direct, SERVICE_TOKEN)  # the backend talks to queuekeeper directly
        agent, offering = await backend.agent_with_offering()
        with nginx(site, tmp_path / "nginx", proxy_port) as access_log:
            # What goes where: the agents' event paths to queuekeeper, the rest to Waldur.
            mine = await through_proxy.get("/api/event-subscriptions/", headers=agent.headers)
            assert mine.status_code == 200, mine.text
            assert mine.json() == []
            for path in (
                "/api/users/me/",
                "/api/marketplace-provider-offerings/",
                "/api/event-subscriptionsX/",
                "/api/internal/events/",
                "/api/admin/queues/",
            ):
                answer = await through_proxy.get(path, headers=agent.headers)
                assert answer.json() == {"served_by": "waldur"}, path
            assert waldur.paths[-5:] == [
                "/api/users/me/",
                "/api/marketplace-provider-offerings/",
                "/api/event-subscriptionsX/",
                "/api/internal/events/",
                "/api/admin/queues/",
            ]

            config = agent_config(
                tmp_path / "agent.yaml", f"{proxy}/api/", agent.token, offering.hex, all_types=False
            )
            running = await start_agent(site_agent_python, config, tmp_path, "proxied")
            try:
                status = await running.ready(timeout=120)
                (consumer,) = status["consumers"]
                assert consumer["connected"], running.log_tail()
                queue = f"subscription_{consumer['subscription']}_offering_{offering.hex}_order"
                publish = publisher_for(direct, offering, {"order": queue})
                event_id = await publish("order", valid_payload("order"))
                (received,) = await running.wait_received(1)
                assert received["headers"]["amqp-message-id"] == event_id
            finally:
                await running.stop()
            proxied = access_log.read_text()
            assert "/api/marketplace-site-agent-identities/" in proxied
            assert "/create_queue/" in proxied
        # The agent's set-up reached queuekeeper (through nginx, not around it).
        paths = [entry[1] for entry in server.log.agent_requests()]
        assert any(path.endswith("/register_event_subscription/") for path in paths), paths
