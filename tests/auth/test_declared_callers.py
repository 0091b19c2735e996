"""Who may call a route is what its router declares, not where its path lies
(docs/decisions/004-declared-callers.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import APIRouter, FastAPI

from queuekeeper.admin.routes import admin_router
from queuekeeper.app import create_app
from queuekeeper.common.access import Caller, router
from queuekeeper.config import Settings
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Backend

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


def _new_admin_routes() -> list[APIRouter]:
    # The guard alone authenticates this one (no dependency), as it does the accept routes.
    guarded_only = router(Caller.SERVICE, tags=["admin"])

    @guarded_only.get("/api/operations/ping/")
    async def ping() -> dict[str, str]:
        return {"pong": "yes"}

    # An admin route the usual way, outside /api/admin/ all the same.
    admin = admin_router()
    admin.prefix = ""

    @admin.post("/api/operations/note/")
    async def note(body: dict[str, str]) -> dict[str, str]:
        return body

    return [guarded_only, admin]


@pytest.fixture
async def extended(settings: Settings, clean_state: None) -> AsyncIterator[httpx.AsyncClient]:
    application = create_app(settings)
    for extra in _new_admin_routes():
        application.include_router(extra)
    async with LifespanManager(application, startup_timeout=30, shutdown_timeout=30) as manager:
        transport = httpx.ASGITransport(app=manager.app, client=("10.1.2.3", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            yield http


async def test_a_new_admin_route_outside_api_admin_is_guarded_as_a_service_route(
    extended: httpx.AsyncClient,
) -> None:
    backend = Backend(extended, SERVICE_TOKEN)
    agent = await backend.put_user()
    # An agent's GET is never authenticated by the guard: were this an agent route by its
    # path, these would pass.
    refused = await extended.get("/api/operations/ping/")
    assert refused.status_code == 401, refused.text
    assert refused.headers["WWW-Authenticate"].startswith("Bearer")
    assert (await extended.get("/api/operations/ping/", headers=agent.headers)).status_code == 403
    answered = await extended.get("/api/operations/ping/", headers=SERVICE)
    assert answered.status_code == 200, answered.text
    # Nor is a service route's POST counted against an agent's rate limit, nor documented so.
    posted = await extended.post("/api/operations/note/", json={"a": "b"}, headers=SERVICE)
    assert posted.status_code == 200, posted.text
    document = (await extended.get("/openapi.json")).json()
    responses = document["paths"]["/api/operations/note/"]["post"]["responses"]
    assert "429" not in responses
    assert "413" in responses


def test_a_documented_route_that_declares_no_caller_stops_the_start(settings: Settings) -> None:
    application: FastAPI = create_app(settings)
    undeclared = APIRouter()

    @undeclared.get("/api/somewhere/")
    async def somewhere() -> None:
        return None

    application.include_router(undeclared)

    async def start() -> None:
        async with LifespanManager(application, startup_timeout=30, shutdown_timeout=30):
            pass

    with pytest.raises(RuntimeError, match="declares no caller"):
        asyncio.run(start())
