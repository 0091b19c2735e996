"""queuekeeper beside Waldur behind one host name: deploy/nginx/queuekeeper-beside-waldur.conf,
as shipped (only its addresses made local and TLS left out), in front of queuekeeper and a
stand-in for Waldur's other endpoints; the published site agent 1.0.5 is given the proxy's
URL as its `waldur_api_url`, sets up through it, and receives an event over STOMP."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from queuekeeper.waldur_standin import WaldurStandIn
from tests.agents.harness import Server, agent_config, publisher_for, start_agent, valid_payload
from tests.agents.site_proxy import SHIPPED, free_port, nginx, serving
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Backend


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


@pytest.mark.timeout(600)
async def test_a_published_agent_sets_up_and_receives_through_the_shipped_proxy(
    server: Server, site_agent_python: Path, tmp_path: Path
) -> None:
    waldur = WaldurStandIn()
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
        with nginx(site, tmp_path / "nginx", ("127.0.0.1", proxy_port)) as access_log:
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
                assert answer.headers["x-served-by"] == "waldur-standin", path
            assert [path for _, path in waldur.requests[-5:]] == [
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
