"""Agents do not follow redirects and derive their base URL by stripping characters.

waldur-site-agent's client has `follow_redirects=False` and treats a 3xx as a
failure; it sends `<waldur_api_url>.rstrip("/api") + "/api/..."` (agent-protocols 1.0.5 §6).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from prometheus_client import REGISTRY

from queuekeeper.app import create_app
from queuekeeper.config import Settings
from tests.helpers import Agent, Backend

# Every request the agent makes during its event-processing set-up (agent-protocols 1.0.5 §2).
AGENT_REQUESTS = [
    ("GET", "/api/marketplace-site-agent-identities/?name=agent-x"),
    ("POST", "/api/marketplace-site-agent-identities/"),
    ("PUT", "/api/marketplace-site-agent-identities/{uuid}/"),
    ("POST", "/api/marketplace-site-agent-identities/{uuid}/register_event_subscription/"),
    ("POST", "/api/event-subscriptions/{uuid}/create_queue/"),
]


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", uuid.uuid4().hex, path)


def _routes(app: FastAPI) -> list[tuple[str, str]]:
    """Every documented route (included routers do not show up in `app.routes`)."""
    return [
        (method.upper(), path)
        for path, operations in app.openapi()["paths"].items()
        for method in operations
    ]


async def test_no_route_answers_a_redirect_with_or_without_the_slash(
    app: FastAPI, client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, _offering = await backend.agent_with_offering()
    routes = _routes(app) + [(method, path.split("?")[0]) for method, path in AGENT_REQUESTS]
    assert len(routes) > 15
    for method, template in routes:
        path = _concrete(template)
        for headers in (agent.headers, backend.headers):
            response = await client.request(method, path, json={}, headers=headers)
            assert not response.is_redirect, (method, path, response.status_code)
            assert response.status_code != 500, (method, path, response.text)
        if path.endswith("/"):
            bare = path.rstrip("/")
            response = await client.request(method, bare, json={}, headers=agent.headers)
            assert response.status_code == 404, (method, bare, response.status_code)
            if method != "HEAD":  # a HEAD answer has no body to say it in
                assert f"did you mean {bare}/" in response.json()["detail"]


@pytest.fixture
async def prefixed(settings: Settings, clean_state: None) -> AsyncIterator[FastAPI]:
    application = create_app(settings.model_copy(update={"root_path": "/qk"}))
    async with LifespanManager(application):
        yield application


def agent_base(waldur_api_url: str) -> str:
    """What waldur-site-agent 1.0.5 does with its configured URL (common/utils.get_client)."""
    return waldur_api_url.rstrip("/api")


@pytest.mark.parametrize("proxy_strips_prefix", [False, True])
async def test_served_under_a_prefix_whether_or_not_the_proxy_strips_it(
    prefixed: FastAPI, proxy_strips_prefix: bool
) -> None:
    base = agent_base("http://testserver/qk/api/")
    assert base == "http://testserver/qk"
    transport = httpx.ASGITransport(app=prefixed)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        backend = Backend(http, "service-token-primary-0123456789")
        agent, offering = await backend.agent_with_offering()
        agent = Agent(http, agent.uuid, agent.token)

        def url(path: str) -> str:
            # A stripping proxy forwards `/api/...`; a plain one `/qk/api/...`.
            return path if proxy_strips_prefix else f"{base}{path}"

        labels = {
            "method": "POST",
            "route": "/api/marketplace-site-agent-identities/",
            "status": "201",
        }
        counted = REGISTRY.get_sample_value("queuekeeper_http_requests_total", labels) or 0.0
        response = await http.post(
            url("/api/marketplace-site-agent-identities/"),
            json={"offering": offering.hex, "name": f"agent-{offering.hex}"},
            headers=agent.headers,
        )
        assert response.status_code == 201, response.text
        # HTTP metrics see the route template either way (the prefix is handled outside them).
        assert REGISTRY.get_sample_value("queuekeeper_http_requests_total", labels) == counted + 1
        response = await http.get(
            url("/api/marketplace-site-agent-identities/"),
            params={"name": f"agent-{offering.hex}", "page_size": 1},
            headers=agent.headers,
        )
        assert response.status_code == 200
        assert len(response.json()) == 1

        for _ in range(2):
            response = await http.post(
                url("/api/event-subscriptions/"), json={}, headers=agent.headers
            )
            assert response.status_code == 201
        response = await http.get(
            url("/api/event-subscriptions/"), params={"page_size": 1}, headers=agent.headers
        )
        assert response.status_code == 200
        # Links are built from the public path, prefix included, either way.
        assert (
            "http://testserver/qk/api/event-subscriptions/?page_size=1&page=2"
            in (response.headers["Link"])
        )
        assert (await http.get(url("/healthz"))).status_code == 200
        # A path outside the prefix and outside the API is still a plain 404, not a redirect.
        response = await http.get("/qkx/api/users/me/", headers=agent.headers)
        assert response.status_code == 404


def test_a_host_name_ending_in_a_p_or_i_loses_characters() -> None:
    """Why docs/tutorial/site-agent.md warns about host names: rstrip strips characters, not
    a suffix."""
    assert agent_base("http://h:8000/api/") == "http://h:8000"
    assert agent_base("http://wapi/api/") == "http://w"
    assert agent_base("http://h/api/v1/") == "http://h/api/v1"
