"""The deployment a site runs: deploy/nginx/queuekeeper-beside-waldur.conf as shipped (only
the lines marked SET made local) serving one host name over TLS, with a certificate from a
CA made here, in front of queuekeeper, RabbitMQ's web-STOMP and a stand-in for Waldur.

The published agents are configured as a site configures them: `waldur_api_url:
https://queuekeeper.test/api/` and nothing about the broker or TLS, so they use their own
defaults (wss on the REST host, port 443, path /rmqws-stomp, certificates checked) and
trust the test CA the way a site with a private CA does (SSL_CERT_FILE, which both their
REST client, httpx, and their WebSocket client, websocket-client, read). Each sets up and
receives one event of every type it subscribes to, through nginx.

Port 443 is the agents' default, so nginx listens on 443 of a loopback address of this test
alone (site_proxy.free_loopback_address); the name resolves to it in the agent's process
only (agent_runner.py `--resolve`), as curl's `--resolve` does, never via /etc/hosts. A
second check: a client failing STOMP logins in a loop is answered 429 by nginx once its
burst is spent, before the broker sees it."""

from __future__ import annotations

import asyncio
import re
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
import yaml
from websockets.exceptions import InvalidStatus

from queuekeeper.waldur_standin import WaldurStandIn
from tests.agents.harness import Server, agent_config, start_agent
from tests.agents.releases import RELEASES, Release
from tests.agents.site_agent_venv import ensure_site_agent_venv
from tests.agents.site_proxy import (
    SHIPPED,
    Certificate,
    certificate_for,
    free_loopback_address,
    free_port,
    nginx,
    serving,
)
from tests.agents.test_agent_matrix import (
    assert_each_handled_once,
    publish_every_type,
    queues_by_type,
    runner_flags,
)
from tests.brokers import BROKER
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Agent, Backend

NAME = "queuekeeper.test"  # RFC 6761: .test is never delegated, so it reaches nobody else
HTTPS = 443
# The releases sites run with the unified protocol.
DEPLOYED = [r for r in RELEASES if r.protocol == "unified"]


def tls_site(
    certificate: Certificate, address: str, *, queuekeeper: str, waldur: str, web_stomp: str
) -> str:
    """The shipped file with the lines marked SET made local, the rest as shipped."""
    text = SHIPPED.read_text()
    replacements = [
        (r"server 127\.0\.0\.1:8000;", f"server {queuekeeper};"),
        (r"server 127\.0\.0\.1:8080;", f"server {waldur};"),
        (r"server 127\.0\.0\.1:15674;", f"server {web_stomp};"),
        (r"listen 443 ssl http2;", f"listen {address}:{HTTPS} ssl http2;"),
        (r"server_name waldur\.example\.org;", f"server_name {certificate.name};"),
        (r"ssl_certificate /\S+;", f"ssl_certificate {certificate.chain};"),
        (r"ssl_certificate_key /\S+;", f"ssl_certificate_key {certificate.key};"),
    ]
    for pattern, replacement in replacements:
        text, count = re.subn(pattern, replacement, text)
        assert count == 1, f"{SHIPPED.name} no longer has {pattern!r} once"
    return text


def shipped_burst() -> int:
    (burst,) = re.findall(r"limit_req zone=queuekeeper_stomp burst=(\d+)", SHIPPED.read_text())
    return int(burst)


@dataclass(frozen=True)
class Deployed:
    certificate: Certificate
    address: str  # nginx listens on port 443 of it
    access_log: Path

    def agent_options(self, release: Release) -> list[str]:
        return [*runner_flags(release), "--resolve", f"{self.certificate.name}:{self.address}"]


@asynccontextmanager
async def deployed(server: Server, tmp_path: Path) -> AsyncIterator[Deployed]:
    """The shipped site over TLS, in front of `server`, RabbitMQ and a stand-in for Waldur."""
    certificate = certificate_for(NAME, tmp_path / "tls")
    address = free_loopback_address(HTTPS)
    waldur, waldur_port = WaldurStandIn(), free_port()
    site = tls_site(
        certificate,
        address,
        queuekeeper=server.url.removeprefix("http://"),
        waldur=f"127.0.0.1:{waldur_port}",
        web_stomp=f"{BROKER.host}:{BROKER.web_stomp_port}",
    )
    async with serving(waldur, waldur_port):
        with nginx(site, tmp_path / "nginx", (address, HTTPS)) as access_log:
            yield Deployed(certificate, address, access_log)


def site_agent_config(path: Path, agent: Agent, offering: uuid.UUID, **extra: Any) -> Path:
    """As a site writes it: the proxy's https URL, nothing about the broker or TLS."""
    config = agent_config(
        path, f"https://{NAME}/api/", agent.token, offering.hex, stomp_defaults=True
    )
    written = yaml.safe_load(config.read_text())
    (offering_config,) = written["offerings"]
    assert not {key for key in offering_config if key.startswith("stomp_ws")}, written
    assert not {"websocket_use_tls", "verify_ssl"} & set(offering_config), written
    offering_config.update(extra)
    config.write_text(yaml.safe_dump(written))
    return config


@pytest.mark.timeout(900)
@pytest.mark.parametrize("release", DEPLOYED, ids=[release.version for release in DEPLOYED])
async def test_a_published_agent_on_its_defaults_receives_every_type_over_wss_through_nginx(
    release: Release, server: Server, tmp_path: Path
) -> None:
    python = await asyncio.to_thread(ensure_site_agent_venv, release.version)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=30) as direct,
        deployed(server, tmp_path) as site,
    ):
        backend = Backend(direct, SERVICE_TOKEN)  # the backend talks to queuekeeper directly
        agent, offering = await backend.agent_with_offering()
        config = site_agent_config(tmp_path / "agent.yaml", agent, offering)
        running = await start_agent(
            python,
            config,
            tmp_path,
            release.version,
            *site.agent_options(release),
            env={"SSL_CERT_FILE": str(site.certificate.ca)},
        )
        try:
            status = await running.ready(timeout=180)
            queue_of = queues_by_type(status, offering)
            assert sorted(queue_of) == sorted(release.types), running.log_tail()
            sent = await publish_every_type(direct, offering, queue_of)
            received = await running.wait_received(len(sent), timeout=60)
            assert_each_handled_once(received, sent, running.log_tail())
        finally:
            await running.stop()
    proxied = site.access_log.read_text()  # complete once nginx stopped
    log = running.output.read_text(errors="replace")
    # The agent chose wss://queuekeeper.test:443/rmqws-stomp on its own...
    assert f"Using {NAME}:{HTTPS}/{agent.vhost}/rmqws-stomp broker" in log, log
    # ...and both its REST set-up and its STOMP connection went through nginx.
    assert re.search(
        r'"POST /api/marketplace-site-agent-identities/\w+/register_queue/ ', proxied
    ), proxied
    assert re.search(r'"GET /rmqws-stomp HTTP/1\.1" 101 ', proxied), proxied


NEWEST = DEPLOYED[-1:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("release", NEWEST, ids=[release.version for release in NEWEST])
async def test_the_agents_stomp_client_checks_the_certificate(
    release: Release, server: Server, tmp_path: Path
) -> None:
    """Without the site's CA, and REST checks switched off (`verify_ssl: false`, which the
    WebSocket ignores), the agent registers but its wss connection is refused: the agent
    does check the broker's certificate (websocket-client requires and checks it)."""
    python = await asyncio.to_thread(ensure_site_agent_venv, release.version)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=30) as direct,
        deployed(server, tmp_path) as site,
    ):
        agent, offering = await Backend(direct, SERVICE_TOKEN).agent_with_offering()
        config = site_agent_config(tmp_path / "agent.yaml", agent, offering, verify_ssl=False)
        running = await start_agent(
            python, config, tmp_path, "untrusting", *site.agent_options(release)
        )
        try:
            status = await running.ready(timeout=180)
            (consumer,) = status["consumers"]
            assert not consumer["connected"], running.log_tail()
        finally:
            await running.stop()
    log = running.output.read_text(errors="replace")
    assert "CERTIFICATE_VERIFY_FAILED" in log, log
    assert not re.search(r'"GET /rmqws-stomp HTTP/1\.1" 101 ', site.access_log.read_text())


async def stomp_login(address: str, certificate: Certificate) -> int:
    """One web-STOMP login with a wrong passcode through nginx, over TLS: the handshake's
    status (101 when the broker got the login and refused it)."""
    context = ssl.create_default_context(cafile=str(certificate.ca))
    try:
        async with websockets.connect(
            f"wss://{certificate.name}/rmqws-stomp",
            ssl=context,
            host=address,
            port=HTTPS,
            subprotocols=[websockets.Subprotocol("v12.stomp")],
            open_timeout=10,
        ) as socket:
            await socket.send(
                "CONNECT\naccept-version:1.2\nhost:/\nlogin:guessing\npasscode:wrong\n\n\x00"
            )
            frame = await asyncio.wait_for(socket.recv(), 10)
            assert str(frame).startswith("ERROR"), frame
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


@pytest.mark.timeout(120)
async def test_a_client_failing_stomp_logins_in_a_loop_is_throttled_at_the_proxy(
    tmp_path: Path,
) -> None:
    certificate = certificate_for(NAME, tmp_path / "tls")
    address = free_loopback_address(HTTPS)
    site = tls_site(
        certificate,
        address,
        queuekeeper=f"127.0.0.1:{free_port()}",  # not asked: only web-STOMP is used here
        waldur=f"127.0.0.1:{free_port()}",
        web_stomp=f"{BROKER.host}:{BROKER.web_stomp_port}",
    )
    burst = shipped_burst()
    with nginx(site, tmp_path / "nginx", (address, HTTPS)):
        started = time.monotonic()
        statuses = [await stomp_login(address, certificate) for _ in range(burst + 10)]
        elapsed = time.monotonic() - started
    reached_broker = statuses.count(101)
    assert set(statuses) == {101, 429}, statuses
    # The first logins reach the broker (which refuses them); after the burst nginx answers
    # 429 itself, and only the shipped rate (30 a minute) gets more through.
    assert statuses[: burst + 1] == [101] * (burst + 1), statuses
    assert statuses[-1] == 429, statuses
    assert reached_broker <= burst + 1 + int(elapsed / 2) + 1, (statuses, elapsed)
