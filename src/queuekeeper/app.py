"""The FastAPI application and its lifespan: what starts, in which order, and what stops."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI

from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.broker.publisher import AmqpPublisher
from queuekeeper.config import Settings, get_settings
from queuekeeper.db import create_engine, create_sessionmaker
from queuekeeper.directory.endpoints import agent_router as users_router
from queuekeeper.directory.endpoints import internal_router as directory_router
from queuekeeper.errors import install_error_handlers
from queuekeeper.events.endpoints import admin_router as outbox_router
from queuekeeper.events.endpoints import internal_router as events_router
from queuekeeper.events.relay import Relay
from queuekeeper.events.service import outbox_signals
from queuekeeper.observability.metrics import observe_management_call
from queuekeeper.state import AppState
from queuekeeper.subscriptions.endpoints import router as subscriptions_router

log = structlog.get_logger(__name__)

TAGS = [
    {"name": "agents", "description": "Site agents: `Authorization: Token <api token>`."},
    {"name": "internal", "description": "The backend: `Authorization: Bearer <service token>`."},
    {"name": "admin", "description": "Operators: `Authorization: Bearer <service token>`."},
    {"name": "health", "description": "Liveness, readiness and metrics."},
]


def build_state(settings: Settings) -> AppState:
    engine = create_engine(settings)
    management = ManagementClient(settings, observer=observe_management_call)
    return AppState(
        settings=settings,
        engine=engine,
        sessions=create_sessionmaker(engine),
        management=management,
        provisioner=Provisioner(management, settings),
    )


def start_relay(state: AppState) -> Relay:
    """The outbox relay and its AMQP publisher, in this process (`queuekeeper relay` too)."""
    settings = state.settings
    state.publisher = AmqpPublisher(settings)
    # Its own small pool without pre-ping: the relay retries a statement that fails on
    # a dead connection anyway, and a ping per statement would triple its round trips.
    engine = create_engine(settings, pre_ping=False, pool_size=settings.relay_concurrency + 2)
    state.extras["relay_engine"] = engine
    relay = Relay(settings, engine, state.publisher, state.provisioner, outbox_signals(state))
    relay.start()
    state.relay = relay
    return relay


async def stop_relay(state: AppState) -> None:
    if state.relay is not None:
        await state.relay.stop()
        state.relay = None
    if state.publisher is not None:
        await state.publisher.close()
        state.publisher = None
    engine = state.extras.pop("relay_engine", None)
    if engine is not None:
        await engine.dispose()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = build_state(settings)
        app.state.queuekeeper = state
        if settings.relay_enabled:
            start_relay(state)
        log.info("queuekeeper_started", instance=settings.instance_name)
        try:
            yield
        finally:
            await stop_relay(state)
            await state.management.aclose()
            await state.engine.dispose()
            log.info("queuekeeper_stopped")

    app = FastAPI(
        title="queuekeeper",
        version="0.1.0",
        description="Owns the RabbitMQ queues through which a marketplace backend sends events "
        "to remote site agents.",
        openapi_tags=TAGS,
        lifespan=lifespan,
        root_path=settings.root_path,
        # Agents do not follow redirects: never answer a missing slash with a 307.
        redirect_slashes=False,
    )
    install_error_handlers(app, settings)
    app.include_router(subscriptions_router)
    app.include_router(users_router)
    app.include_router(directory_router)
    app.include_router(events_router)
    app.include_router(outbox_router)

    @app.get("/healthz", tags=["health"], summary="Liveness", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
