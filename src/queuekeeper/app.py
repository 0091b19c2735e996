"""The FastAPI application and its lifespan: what starts, in which order, and what stops."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import cache, partial

import structlog
from fastapi import APIRouter, Depends, FastAPI
from fastapi.telemetry import TelemetryConfig
from prometheus_client import multiprocess
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.routing import BaseRoute
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from queuekeeper.admin.endpoints import router as runs_router
from queuekeeper.auth.guard import RequestGuard
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.presence import PresenceListener
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.broker.publisher import AmqpPublisher
from queuekeeper.common.access import declared_routes
from queuekeeper.common.docs import install_docs
from queuekeeper.common.input_guard import reject_unstorable_input
from queuekeeper.common.openapi import install_openapi, operation_id
from queuekeeper.common.prefix import PathPrefixMiddleware
from queuekeeper.common.processes import shared_directory
from queuekeeper.common.signals import OutboxSignals
from queuekeeper.config import Settings, get_settings
from queuekeeper.config_reference import unknown_in_environment
from queuekeeper.consumers import sweep
from queuekeeper.consumers.endpoints import router as consumers_router
from queuekeeper.db import create_engine, create_sessionmaker
from queuekeeper.deadletters import service as deadletters
from queuekeeper.deadletters.endpoints import router as dead_letters_router
from queuekeeper.directory import service as directory
from queuekeeper.directory.endpoints import agent_router as users_router
from queuekeeper.directory.endpoints import internal_router as directory_router
from queuekeeper.errors import install_error_handlers
from queuekeeper.events.endpoints import accept_router
from queuekeeper.events.endpoints import admin_router as outbox_router
from queuekeeper.events.endpoints import internal_router as events_router
from queuekeeper.events.intake import Intake
from queuekeeper.events.openapi import document_payloads
from queuekeeper.events.relay import Relay
from queuekeeper.health.endpoints import router as health_router
from queuekeeper.health.service import refresh_survey
from queuekeeper.identities.endpoints import admin_router as identities_admin_router
from queuekeeper.identities.endpoints import router as identities_router
from queuekeeper.installation import service as installation
from queuekeeper.installation.service import Survey
from queuekeeper.jobs.runs import Job, JobContext, JobRunner, JobSpec, JobTable
from queuekeeper.jobs.scheduler import JobScheduler
from queuekeeper.observability.endpoints import router as metrics_router
from queuekeeper.observability.http import ObservabilityMiddleware
from queuekeeper.observability.metrics import observe_management_call
from queuekeeper.parking import retention
from queuekeeper.parking.endpoints import agent_router as replay_router
from queuekeeper.parking.endpoints import queues_router as queue_replay_router
from queuekeeper.parking.gate import ParkingGate
from queuekeeper.parking.release import MAX_RELEASES, Releaser
from queuekeeper.presence import service as presence
from queuekeeper.presence.endpoints import router as presence_router
from queuekeeper.reconcile import service as reconcile
from queuekeeper.reconcile import stale
from queuekeeper.reconcile.endpoints import router as admin_router
from queuekeeper.state import AppState
from queuekeeper.subscriptions.endpoints import router as subscriptions_router
from queuekeeper.webhooks.dispatcher import WebhookDispatcher
from queuekeeper.webhooks.endpoints import router as webhooks_router

log = structlog.get_logger(__name__)

TAGS = [
    {
        "name": "agents",
        "description": "Site agents register event subscriptions and queues, then consume "
        "them over STOMP. Authentication: `Authorization: Token <api token>`.",
    },
    {
        "name": "internal",
        "description": "The backend pushes its directory (users, offerings, grants) and "
        "publishes events. Authentication: `Authorization: Bearer <service token>`.",
    },
    {
        "name": "admin",
        "description": "Operators inspect queues, run reconciles and redrive dead letters. "
        "Authentication: `Authorization: Bearer <service token>`.",
    },
    {
        "name": "health",
        "description": "Probes and metrics for load balancers, orchestrators and Prometheus. "
        "No authentication; not counted as HTTP traffic.",
    },
]

DESCRIPTION = """\
queuekeeper owns the RabbitMQ queues through which a marketplace backend sends events to
remote site agents.

* **Agents** (`agents`, `Authorization: Token <api token>`) create an event subscription,
  register one queue per (offering, object type) with `create_queue` (waldur-site-agent
  1.0.7: one queue per identity with `register_queue`), then subscribe over STOMP to
  `/amq/queue/<queue_name>` in vhost `<user uuid hex>`, logging in as
  `<subscription uuid hex>` with their API token.
* **The backend** (`internal`, `Authorization: Bearer <service token>`) pushes users,
  offerings and access grants, and publishes events; an accepted event is never lost.
* **Operators** (`admin`, `health`) see every queue's state, reconcile the broker with the
  database, redrive dead letters, and scrape `/metrics`.

## Quickstart

1. **A service token.** Set `QUEUEKEEPER_SERVICE_TOKENS` (comma-separated, for rotation)
   before starting the server; without one every `internal` and `admin` call answers 401
   and the start-up log says so. Use it here with **Authorize**: `Bearer <service token>`.
2. **The backend's pushes come first**, with the service token:
   `PUT /api/internal/users/{user_uuid}/` `{"username": "alice", "token": "<api token>"}`,
   `PUT /api/internal/offerings/{offering_uuid}/` `{"name": "HPC"}`,
   `PUT /api/internal/offerings/{offering_uuid}/users/{user_uuid}/`.
3. **The agent**, with `Token <api token>`: `POST /api/event-subscriptions/` `{}` (its
   `uuid` is the STOMP login), then
   `POST /api/event-subscriptions/{uuid}/create_queue/`
   `{"offering_uuid": "...", "object_type": "order"}` (its `queue_name` is the destination).
4. **Publish**, with the service token: `POST /api/internal/events/?wait=true`
   `{"offering_uuid": "...", "object_type": "order", "payload": {"order_uuid": "...",
   "order_state": "executing"}}`.
5. **Consume** over STOMP: RabbitMQ's `ws://<broker>:15674/ws` (WebSocket; plain STOMP on
   61613), vhost = the user's uuid hex, login = the subscription's uuid hex, passcode = the
   API token, `SUBSCRIBE` to `/amq/queue/<queue_name>`.

The README's Quickstart has these as commands to paste, with a ten-line consumer.

Every error answers with `{"detail": "...", "errors": [{"field", "message"}]?}`. A request
may carry `X-Request-ID`; the response always does, and every log line of the request has it.
"""


# --- the job table: what the scheduler, the admin API and the CLI can run ----------------
JOBS: JobTable = {
    Job.RECONCILE: JobSpec(
        Job.RECONCILE,
        reconcile.reconcile,
        interval=lambda settings: settings.reconcile_interval_seconds,
        on_change=reconcile.count_change,
    ),
    Job.CLEANUP_STALE: JobSpec(
        Job.CLEANUP_STALE,
        stale.cleanup_stale,
        interval=lambda settings: settings.stale_cleanup_interval_seconds,
        on_change=reconcile.count_change,
    ),
    Job.REDRIVE: JobSpec(
        Job.REDRIVE,
        deadletters.redrive,
        interval=lambda settings: settings.redrive_interval_seconds,
        on_change=deadletters.count_change,
    ),
    Job.REVOKE_EXPIRED: JobSpec(
        Job.REVOKE_EXPIRED,
        directory.revoke_expired,
        interval=lambda settings: settings.token_expiry_interval_seconds,
        quiet=True,
    ),
    Job.RETENTION: JobSpec(
        Job.RETENTION,
        retention.apply_retention,
        interval=lambda settings: settings.retention_interval_seconds,
        on_change=retention.count_change,
    ),
    Job.PRESENCE: JobSpec(
        Job.PRESENCE,
        presence.check,
        interval=lambda settings: settings.presence_interval_seconds,
        quiet=True,  # its gauges are set once per run (presence.refresh_gauges)
    ),
    # Woken by the access triggers' NOTIFY; the interval finds expiries that come by time
    # (docs/decisions/030-queued-copies-on-every-access-loss.md).
    Job.SWEEP_ACCESS: JobSpec(
        Job.SWEEP_ACCESS,
        sweep.sweep_access,
        interval=lambda settings: settings.access_sweep_interval_seconds,
        quiet=True,
        wake=sweep.on_access_change,
        nothing_to_do=sweep.nothing_to_sweep,
    ),
}


@dataclass(kw_only=True)
class Runtime(AppState):
    """What the process runs, beside what endpoints depend on (`AppState`)."""

    # The job table's runner for the admin API (jobs/dependencies.py) and the CLI.
    jobs: JobRunner
    # Opens connections only when used; readiness probes the broker through it.
    publisher: AmqpPublisher
    # Stores accepted events; requests arriving together share a transaction.
    intake: Intake
    # Started by the lifespan when configured; None otherwise (and in tests without them).
    relay: Relay | None = None
    # Releases parked copies when their queue's agent returns (beside the relay).
    releaser: Releaser | None = None
    relay_engine: AsyncEngine | None = None
    # Posts webhook consumers' copies (contract §13), beside the relay, on its own pool.
    webhooks: WebhookDispatcher | None = None
    webhooks_engine: AsyncEngine | None = None
    scheduler: JobScheduler | None = None
    # Consumers arriving and leaving, from the broker's event exchange (contract §11).
    presence_listener: PresenceListener | None = None
    presence_writer: presence.PresenceWriter | None = None
    # What readiness last reported down, so a change is logged once, not per probe.
    readiness_down: tuple[str, ...] = ()
    readiness_nodes_down: tuple[str, ...] = ()
    # What the broker holds under our instance name that this database does not know
    # (installation/service.py); taken at start-up and again when /readyz finds it old.
    survey: Survey | None = None
    survey_task: asyncio.Task[None] | None = None


def build_state(settings: Settings) -> Runtime:
    engine = create_engine(settings)
    management = ManagementClient(settings, observer=observe_management_call)
    sessions = create_sessionmaker(engine)
    provisioner = Provisioner(
        management, settings, identity=partial(installation.identity, sessions)
    )
    context = JobContext(settings, engine, sessions, management, provisioner)
    signals = OutboxSignals()
    return Runtime(
        settings=settings,
        engine=engine,
        sessions=sessions,
        management=management,
        provisioner=provisioner,
        # Opens nothing until used; readiness probes the broker through it.
        publisher=AmqpPublisher(settings, management),
        jobs=JobRunner(context, JOBS),
        intake=Intake(engine, sessions, settings, signals),
        signals=signals,
    )


WEBHOOK_POOL_SIZE = 6


def start_relay(state: Runtime) -> Relay:
    """The outbox relay and the webhook dispatcher, in this process (`queuekeeper relay`
    too)."""
    settings = state.settings
    # Its own small pool: the relay's statements never wait behind the API's requests.
    engine = create_engine(settings, pool_size=settings.relay_concurrency + 2 + MAX_RELEASES)
    state.relay_engine = engine
    relay = Relay(settings, engine, state.publisher, state.provisioner, state.signals)
    gate = ParkingGate(settings, engine)
    relay.hold_back = gate.hold_back
    relay.start()
    state.relay = relay
    state.intake.relay = relay  # events accepted here go to it already claimed
    state.releaser = Releaser(settings, engine, relay, state.publisher, gate, state.jobs)
    state.releaser.start()
    # A claim, a listener, a renewal and the runs' settlements at once, each brief.
    state.webhooks_engine = create_engine(settings, pool_size=WEBHOOK_POOL_SIZE)
    state.webhooks = WebhookDispatcher(settings, state.webhooks_engine, state.signals)
    state.webhooks.start()
    return relay


def start_presence(state: Runtime) -> None:
    """Every replica listens: each writes what it hears as absolute counts, so the replica
    that hears a consumer leave need not be the one that holds its queue's copies."""
    writer = presence.PresenceWriter(state.settings, state.sessions)
    writer.start()
    listener = PresenceListener(state.settings, writer.on_event)
    listener.start()
    state.presence_writer, state.presence_listener = writer, listener


def start_scheduler(state: Runtime) -> JobScheduler:
    scheduler = JobScheduler(state.jobs.context, JOBS)
    scheduler.start()
    state.scheduler = scheduler
    return scheduler


async def shutdown(state: Runtime) -> None:
    """Stop what started, last started first: jobs, relay, then the connections they used."""
    if state.survey_task is not None:
        state.survey_task.cancel()
        await asyncio.gather(state.survey_task, return_exceptions=True)
    if state.scheduler is not None:
        await state.scheduler.stop()
        state.scheduler = None
    await state.jobs.stop()  # runs started with `Prefer: respond-async`
    # The store under way hands its copies to the relay still running; then its connection
    # goes back before the pool is disposed.
    await state.intake.close()
    if state.releaser is not None:
        await state.releaser.stop()
        state.releaser = None
    if state.presence_listener is not None:
        await state.presence_listener.stop()
        state.presence_listener = None
    if state.presence_writer is not None:
        await state.presence_writer.stop()
        state.presence_writer = None
    if state.webhooks is not None:
        await state.webhooks.stop()
        state.webhooks = None
    if state.webhooks_engine is not None:
        await state.webhooks_engine.dispose()
        state.webhooks_engine = None
    if state.relay is not None:
        state.intake.relay = None
        await state.relay.stop()
        state.relay = None
    if state.relay_engine is not None:
        await state.relay_engine.dispose()
        state.relay_engine = None
    await state.publisher.close()
    await state.provisioner.dead_letters.aclose()
    await state.management.aclose()
    await state.engine.dispose()


@asynccontextmanager
async def running(
    settings: Settings,
    *,
    relay: bool = False,
    scheduler: bool = False,
    presence_events: bool = False,
) -> AsyncIterator[Runtime]:
    """The one start-up and shutdown: `serve` (through the lifespan), `relay`, and the CLI's
    job and import commands all run inside it."""
    state = build_state(settings)
    try:
        if relay:
            start_relay(state)
        if scheduler:
            start_scheduler(state)
        if presence_events:
            start_presence(state)
        yield state
    finally:
        await shutdown(state)


def fastapi_telemetry(environment: Mapping[str, str]) -> TelemetryConfig | None:
    """FastAPI's own OpenTelemetry as FastAPI has it (None: its defaults) when the
    environment configures OpenTelemetry (an `OTEL_*` or `FASTAPI_OTEL_*` variable, as
    `opentelemetry-instrument` and FastAPI's auto-configuration read); else off, because
    its per-request check of three global providers costs about 1 % of a single event's
    CPU to find nothing configured (docs/decisions/033-intake-keeps-its-connection.md).
    queuekeeper's own metrics and request log do not depend on it (observability/http.py)."""
    if any(name.startswith(("OTEL_", "FASTAPI_OTEL_")) for name in environment):
        return None
    return {"tracing": False, "metrics": False, "logs": False}


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        declared_routes(app.routes)  # a route that declares no caller stops the start
        async with running(
            settings,
            relay=settings.relay_enabled,
            scheduler=settings.scheduler_enabled,
            presence_events=settings.presence_events_enabled,
        ) as state:
            app.state.queuekeeper = state
            log.info(
                "queuekeeper_started",
                instance=settings.instance_name,
                pid=os.getpid(),
                url=settings.public_url,
                docs=f"{settings.public_url}/docs",
            )
            for unknown in unknown_in_environment():
                log.warning(
                    "unknown_setting",
                    variable=unknown.name,
                    closest=unknown.closest,
                    detail=unknown.detail,
                )
            if not settings.service_tokens:
                # Every internal and admin call is refused then, and the backend's pushes
                # come first: say so where the operator looks (README, Quickstart).
                log.warning(
                    "no_service_token_configured",
                    detail="every /api/internal/ and /api/admin/ call will answer 401: set "
                    "QUEUEKEEPER_SERVICE_TOKENS (comma-separated) and restart",
                )
            # In the background: a broker or database still starting does not delay serving.
            state.survey_task = asyncio.create_task(refresh_survey(state), name="survey")
            yield
        if shared_directory():
            # Drops this worker's live gauges (pool size, outbox depth) from the totals.
            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]
        log.info("queuekeeper_stopped")

    app = FastAPI(
        title="queuekeeper",
        version="0.1.0",
        description=DESCRIPTION,
        openapi_tags=TAGS,
        lifespan=lifespan,
        # Agents do not follow redirects: never answer a missing slash with a 307.
        redirect_slashes=False,
        generate_unique_id_function=operation_id,
        # Served from the package (common/docs.py), not from a CDN.
        docs_url=None,
        redoc_url=None,
        telemetry=fastapi_telemetry(os.environ),
    )
    install_error_handlers(app, settings)
    install_openapi(app, settings, extend=document_payloads)
    install_docs(app)
    # Added first, so innermost of these: the request is logged with its id and real peer.
    app.add_middleware(RequestGuard, settings=settings)
    app.add_middleware(ObservabilityMiddleware, log_accepted_events=settings.log_accepted_events)
    # X-Forwarded-For only from the proxies the operator lists; otherwise the real peer.
    app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=settings.forwarded_allow_ips)
    if settings.root_path:
        # Added last, so outermost: everything inside sees the canonical path.
        app.add_middleware(PathPrefixMiddleware, prefix=settings.root_path)
    # Built once per process, shared by every app made in it (decision 036).
    app.router.routes.extend(_routes())
    return app


@cache
def _routes() -> tuple[BaseRoute, ...]:
    """The app's routes: each domain's router included, as `FastAPI.include_router` would
    include it in the app, into a router that stands for the app's (the same operation ids,
    no prefix or dependencies of its own). FastAPI resolves an included router's routes (the
    dependencies, every parameter's validator) once per inclusion, at an app's start: made
    here once, every app of the process shares them (docs/decisions/036-routes-built-once.md)."""
    root = APIRouter(generate_unique_id_function=operation_id, strict_content_type=True)
    # First: the backend's accept routes are the busiest, and the router tries routes in
    # order. They check their input themselves (events/endpoints.py).
    root.include_router(accept_router)
    # A NUL character or NaN/Infinity is a 400 naming the field, before any endpoint.
    checked = [Depends(reject_unstorable_input)]
    for router in (
        events_router,
        subscriptions_router,
        users_router,
        directory_router,
        identities_router,
        consumers_router,
        webhooks_router,
        presence_router,
        identities_admin_router,
        admin_router,
        runs_router,
        dead_letters_router,
        health_router,
        metrics_router,
        outbox_router,
        replay_router,
        queue_replay_router,
    ):
        root.include_router(router, dependencies=checked)
    return tuple(root.routes)


def serve_app() -> FastAPI:
    """The factory `queuekeeper serve` hands uvicorn: every worker process calls it, so
    each configures its own logging before it builds the app."""
    from queuekeeper.logging import configure_logging

    settings = get_settings()
    configure_logging(settings)
    return create_app(settings)
