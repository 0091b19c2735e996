"""Probes for load balancers and orchestrators. Neither is counted as HTTP traffic."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from queuekeeper.common.access import Caller
from queuekeeper.common.access import router as caller_router
from queuekeeper.health import service
from queuekeeper.health.schemas import Liveness, Readiness


async def watched(request: Request) -> service.Watched:
    state: service.Watched = request.app.state.queuekeeper
    return state


WatchedDep = Annotated[service.Watched, Depends(watched)]

router = caller_router(Caller.PUBLIC, tags=["health"])


@router.get(
    "/healthz",
    summary="Liveness",
    description="Answers while the process lives; touches no dependency. Restart the "
    "process when this fails.",
)
async def healthz() -> Liveness:
    return Liveness()


@router.get(
    "/readyz",
    summary="Readiness",
    description="Checks the database (`SELECT 1`), an AMQP connection and the RabbitMQ "
    "Management API, concurrently, each within `QUEUEKEEPER_READINESS_TIMEOUT` seconds. "
    "With several broker node URLs every node is checked and named under `nodes`; the "
    "broker counts as up while one node answers. 503 names what is down; take the replica "
    "out of rotation until it answers 200.",
    response_model=Readiness,
    responses={
        503: {
            "model": Readiness,
            "description": "A dependency is down; `detail` and `checks` say which and why.",
            "headers": {
                "Retry-After": {
                    "description": "Seconds to wait before probing again.",
                    "schema": {"type": "integer"},
                }
            },
        }
    },
)
async def readyz(state: WatchedDep) -> JSONResponse:
    report = await service.readiness(state)
    if report.status == "ready":
        return JSONResponse(report.model_dump(mode="json"))
    return JSONResponse(
        report.model_dump(mode="json"),
        status_code=503,
        headers={"Retry-After": str(state.settings.retry_after_seconds)},
    )
